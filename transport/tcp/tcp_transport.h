// The TCP transport: Boost.Asio stream sockets, one per peer, with TCP_NODELAY.
//
// Address: a wire::TcpAddress {host, port} of the listening socket, serialized.
// Connect: for each pair the lower rank dials and sends a wire::ConnectionHello; the higher rank
// accepts and checks the hello (so a stray or misrouted connection is rejected by name). Dials
// that are refused are retried every 100 ms until the deadline, so ranks may start in any order.
// Data: the bytes of each Op, back to back; framing is the collective's business.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"

namespace pipesgd::transport::tcp {

struct TcpOptions {
  int rank = 0;
  int world_size = 1;
  // Numeric IP to listen on and publish; peers must be able to reach it. Choose it with
  // LocalIpToward(master_addr, master_port) (transport/message_io.h).
  std::string bind_host = "127.0.0.1";
};

// Opens the listening socket (an ephemeral port on bind_host). Throws Error kIo if it cannot.
std::unique_ptr<Transport> CreateTcpTransport(const TcpOptions& options);

}  // namespace pipesgd::transport::tcp
