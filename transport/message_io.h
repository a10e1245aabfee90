// Framed protobuf control messages over Boost.Asio stream sockets, used only at start-up
// (rendezvous, connection hello). Frame: [u32 magic 0x4d475350 "PSGM"][u32 length][bytes],
// little-endian. A bad magic or a length above kMaxMessageBytes is rejected before any
// allocation, so garbage on a port cannot make us allocate or crash.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "transport/asio.h"
#include <google/protobuf/message_lite.h>

#include "core/base/deadline.h"
#include "core/base/error.h"

namespace pipesgd::transport {

inline constexpr uint32_t kMessageMagic = 0x4d475350;  // "PSGM" read as little-endian bytes
inline constexpr uint32_t kMaxMessageBytes = 1 << 20;   // 1 MiB: room for 64k ranks' addresses
inline constexpr uint32_t kProtocolVersion = 2;  // wire.proto says what changed

// Completion callback: null on success, else the error (kUnavailable for a closed or reset
// socket, kDataLoss for a bad frame or unparsable message).
using MessageHandler = std::function<void(const std::exception_ptr& error)>;

// Serializes `message` and writes one frame. `message` is copied; `socket` must outlive the
// operation.
void AsyncWriteMessage(boost::asio::ip::tcp::socket& socket,
                       const google::protobuf::MessageLite& message, MessageHandler handler);

// Reads one frame into `*message` (which must outlive the operation). `peer` names the other
// end in errors ("rank 2", "127.0.0.1:4242").
// The body length announced by an 8-byte frame header (magic, length). Throws Error(kDataLoss)
// naming `peer` for a bad magic or a length above kMaxMessageBytes.
uint32_t MessageFrameLength(const uint8_t* header, const std::string& peer);
// Parses a frame body into `message`; throws Error(kDataLoss) naming `peer` if it does not parse.
void ParseMessageBody(const std::string& body, google::protobuf::MessageLite* message,
                      const std::string& peer);

void AsyncReadMessage(boost::asio::ip::tcp::socket& socket, google::protobuf::MessageLite* message,
                      std::string peer, MessageHandler handler);

// Runs `io` until `*done` or the deadline; returns false on deadline. Restarts `io` if it ran out
// of work.
bool RunUntil(boost::asio::io_context& io, const bool* done, Deadline deadline);

// The local IP address this host uses to reach host:port (a UDP connect, which sends nothing):
// the address peers on that network can reach us at. Throws Error kInvalidArgument if `host`
// does not resolve, kUnavailable if there is no route.
std::string LocalIpToward(const std::string& host, uint16_t port);

// The message of the exception `error` holds (a MessageHandler's error), for logs.
std::string ExceptionText(const std::exception_ptr& error);

// "ip:port" of the socket's peer, or "unknown peer" if it is already gone.
std::string RemoteName(const boost::asio::ip::tcp::socket& socket);

// Resolves host (name or numeric, IPv4 preferred) to one endpoint. Throws Error
// kInvalidArgument naming the host and the resolver's message.
boost::asio::ip::tcp::endpoint ResolveEndpoint(const std::string& host, uint16_t port);

}  // namespace pipesgd::transport
