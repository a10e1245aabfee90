// Proof of the job token without sending it. A control connection (the rendezvous, SDPipe's group
// scheduler) starts with a four-message handshake, before any other message travels:
//
//   client -> server  AuthOpen       protocol version, service, claimed rank, client nonce Nc
//   server -> client  AuthChallenge  server nonce Ns, Ps = HMAC-SHA256(token, "server" | service | Nc | Ns)
//   client -> server  AuthProof      Pc = HMAC-SHA256(token, "client" | service | Ns | Nc | rank)
//   server -> client  AuthResult     accepted, or why not
//
// The client checks Ps before it sends Pc, and sends nothing of the job (no config, no address)
// until the server has accepted, so a foreign process listening on the port learns only that a
// pipesgd rank knocked. Both nonces are fresh (32 random bytes from libcrypto), the two proofs
// cover different labels, and proofs are compared in constant time (CRYPTO_memcmp): a recorded
// exchange cannot be replayed or reflected, and the token never travels. Without a token on
// either side (a job started by hand) both proofs are empty and the handshake only checks the
// protocol version; a server without a token accepts anyone, a client with one refuses a server
// that cannot prove it. Integrity of the later messages is not protected (no TLS): the threat
// is a stranger or another job on the port, not an attacker on the path.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "transport/asio.h"

#include "core/base/deadline.h"

namespace pipesgd::transport {

inline constexpr size_t kAuthNonceBytes = 32;

// `bytes` random bytes from the system's CSPRNG (RAND_bytes). Throws Error(kInternal) if it fails.
std::string RandomBytes(size_t bytes);

// HMAC-SHA256(token, role | service | a | b | detail) as 32 raw bytes, empty for an empty token.
std::string TokenProof(std::string_view token, std::string_view role, std::string_view service,
                       std::string_view a, std::string_view b, std::string_view detail = {});

// Equal in time that depends only on the lengths.
bool SameProof(std::string_view a, std::string_view b);

// Client side, blocking on `io` (which must own `socket`) until the server accepted or the
// deadline. `where` names the server in messages ("rank 0 at 10.0.0.1:29500 (MASTER_ADDR lab0)").
// Throws Error: kInvalidArgument when the server does not prove the token (naming `where` and
// that nothing of the job was sent) or refuses this process (with the server's reason);
// kDataLoss / kUnavailable for a peer that is not a pipesgd server or goes away;
// kDeadlineExceeded.
void AuthenticateToServer(boost::asio::io_context& io, boost::asio::ip::tcp::socket& socket,
                          const std::string& token, std::string_view service, int rank,
                          const std::string& where, Deadline deadline);

// Server side, asynchronous on the socket's executor. `self` names this server to the client
// ("rank 0 at 10.0.0.1:29500"), `peer` the client in messages. Calls `done` once: with an empty
// `refused` when the client proved the token (or none is needed) and may send its first
// request, with the reason when it was turned away (the client was told "<self> refused this
// process: <reason>", and our side of the socket is shut down),
// or with `error` set when the exchange itself failed (not a pipesgd peer, closed). `claimed_rank`
// is what AuthOpen said (for logs only: it is not authenticated before `refused` is empty).
struct AuthOutcome {
  std::exception_ptr error;
  std::string refused;
  int claimed_rank = -1;
};
// `socket` must stay alive until `done` runs (capture its owner in `done`).
void AsyncAuthenticateClient(boost::asio::ip::tcp::socket& socket,
                             const std::string& token, std::string_view service,
                             const std::string& self, const std::string& peer,
                             std::function<void(const AuthOutcome&)> done);

}  // namespace pipesgd::transport
