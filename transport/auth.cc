#include "transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "core/base/error.h"
#include "transport/message_io.h"
#include "transport/wire.pb.h"

namespace pipesgd::transport {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

// One synchronous exchange step on `io`: writes `out` (if any), then reads `in`.
void Exchange(asio::io_context& io, tcp::socket& socket, const google::protobuf::MessageLite* out,
              google::protobuf::MessageLite* in, const std::string& where, Deadline deadline,
              int rank) {
  if (out) AsyncWriteMessage(socket, *out, [](std::exception_ptr) {});
  std::exception_ptr error;
  bool done = false;
  AsyncReadMessage(socket, in, where, [&](std::exception_ptr e) {
    error = e;
    done = true;
  });
  if (!RunUntil(io, &done, deadline)) {
    boost::system::error_code ignored;
    socket.close(ignored);
    io.poll();
    Throw(ErrorCode::kDeadlineExceeded,
          "rank {}: {} accepted the connection but did not complete the handshake in time",
          rank, where);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace

std::string RandomBytes(size_t bytes) {
  std::string out(bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(bytes)) != 1) {
    Throw(ErrorCode::kInternal, "RAND_bytes could not produce {} random bytes", bytes);
  }
  return out;
}

std::string TokenProof(std::string_view token, std::string_view role, std::string_view service,
                       std::string_view a, std::string_view b, std::string_view detail) {
  if (token.empty()) return {};
  // Length-prefixed fields: no two different field lists hash the same bytes.
  std::string message;
  for (std::string_view field : {role, service, a, b, detail}) {
    const uint32_t n = static_cast<uint32_t>(field.size());
    for (int i = 0; i < 4; ++i) message.push_back(static_cast<char>(n >> (8 * i)));
    message.append(field);
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int out_len = 0;
  if (!HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), out,
            &out_len)) {
    Throw(ErrorCode::kInternal, "HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<const char*>(out), out_len);
}

bool SameProof(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void AuthenticateToServer(asio::io_context& io, tcp::socket& socket, const std::string& token,
                          std::string_view service, int rank, const std::string& where,
                          Deadline deadline) {
  wire::AuthOpen open;
  open.set_protocol_version(kProtocolVersion);
  open.set_service(std::string(service));
  open.set_rank(rank);
  open.set_nonce(RandomBytes(kAuthNonceBytes));
  wire::AuthChallenge challenge;
  Exchange(io, socket, &open, &challenge, where, deadline, rank);
  if (challenge.nonce().size() != kAuthNonceBytes) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: the process listening at {} did not answer the handshake as pipesgd's rank "
          "0 does (its answer carries no 32-byte challenge): it is not a pipesgd rank 0 (another "
          "program on that port?); nothing of the job was sent to it",
          rank, where);
  }
  if (challenge.protocol_version() != kProtocolVersion) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: {} speaks protocol version {}, this rank speaks {} (a different pipesgd "
          "version?)",
          rank, where, challenge.protocol_version(), kProtocolVersion);
  }
  if (!token.empty()) {
    const std::string expected =
        TokenProof(token, "server", service, open.nonce(), challenge.nonce());
    if (!SameProof(challenge.proof(), expected)) {
      // This rank's own failure, not rank 0's: it cannot tell a stranger on the port from its
      // own wrong token.
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: the process listening at {} {}: it is not this job's rank 0 (another "
            "program or another job on that port, or this rank's PIPESGD_JOB_TOKEN is not the "
            "job's); nothing of the job was sent to it",
            rank, where,
            challenge.proof().empty() ? "runs without a job token, and this rank has one"
                                      : "did not prove that it knows this job's token");
    }
  }
  wire::AuthProof proof;
  proof.set_proof(TokenProof(token, "client", service, challenge.nonce(), open.nonce(),
                             std::to_string(rank)));
  wire::AuthResult result;
  Exchange(io, socket, &proof, &result, where, deadline, rank);
  if (!result.accepted()) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: {}", rank,
          result.error().empty() ? where + " refused this process" : result.error());
  }
}

void AsyncAuthenticateClient(tcp::socket& socket, const std::string& token,
                             std::string_view service, const std::string& self,
                             const std::string& peer,
                             std::function<void(const AuthOutcome&)> done) {
  struct State {
    tcp::socket* socket;
    std::string token, service, self, peer;
    wire::AuthOpen open;
    wire::AuthChallenge challenge;
    wire::AuthProof proof;
    std::function<void(const AuthOutcome&)> done;
  };
  auto s = std::make_shared<State>();
  s->socket = &socket;
  s->token = token;
  s->service = std::string(service);
  s->self = self;
  s->peer = peer;
  s->done = std::move(done);
  auto fail = [](const std::shared_ptr<State>& st, std::exception_ptr e) {
    AuthOutcome outcome;
    outcome.error = std::move(e);
    // Only an AuthOpen that was read claims a rank (an empty nonce: nothing was).
    outcome.claimed_rank = st->open.nonce().empty() ? -1 : st->open.rank();
    st->done(outcome);
  };
  // Sends the verdict; a refusal also shuts our side so the client reads it and then EOF.
  auto finish = [](const std::shared_ptr<State>& st, std::string refused) {
    wire::AuthResult result;
    result.set_accepted(refused.empty());
    if (!refused.empty()) {
      const bool token_problem = refused.find("job token") != std::string::npos;
      result.set_error(fmt::format(
          "{} refused this process: {}{}", st->self, refused,
          token_problem ? " (PIPESGD_JOB_TOKEN must be that of the job; `pipesgd run` sets it)"
                        : ""));
    }
    AsyncWriteMessage(*st->socket, result, [st, refused](std::exception_ptr e) {
      AuthOutcome outcome;
      outcome.claimed_rank = st->open.rank();
      outcome.refused = refused;
      if (e && refused.empty()) outcome.error = e;
      if (!refused.empty()) {
        boost::system::error_code ignored;
        st->socket->shutdown(tcp::socket::shutdown_send, ignored);
      }
      st->done(outcome);
    });
  };
  AsyncReadMessage(socket, &s->open, peer, [s, fail, finish](std::exception_ptr e) {
    if (e) return fail(s, e);
    s->challenge.set_protocol_version(kProtocolVersion);
    if (s->open.protocol_version() != kProtocolVersion) {
      // Answer in our version's terms; the client reports the mismatch by name.
      return finish(s, fmt::format("it speaks protocol version {}, the {} speaks {} (a "
                                   "different pipesgd version?)",
                                   s->open.protocol_version(), s->service, kProtocolVersion));
    }
    if (s->open.service() != s->service) {
      return finish(s, fmt::format("it asked for the {}, this port serves the {}",
                                   s->open.service(), s->service));
    }
    s->challenge.set_nonce(RandomBytes(kAuthNonceBytes));
    s->challenge.set_proof(
        TokenProof(s->token, "server", s->service, s->open.nonce(), s->challenge.nonce()));
    AsyncWriteMessage(*s->socket, s->challenge, [](std::exception_ptr) {});
    AsyncReadMessage(*s->socket, &s->proof, s->peer, [s, fail, finish](std::exception_ptr e2) {
      if (e2 && !s->token.empty()) {
        // The usual reason: our proof did not match its token, and it stopped there.
        return fail(s, std::make_exception_ptr(Error(
                           ErrorCode::kUnavailable,
                           fmt::format("it left the handshake after the {}'s proof of the job "
                                       "token: it holds another job's token, or none",
                                       s->service))));
      }
      if (e2) return fail(s, e2);
      if (s->token.empty()) return finish(s, "");
      const std::string expected =
          TokenProof(s->token, "client", s->service, s->challenge.nonce(), s->open.nonce(),
                     std::to_string(s->open.rank()));
      if (SameProof(s->proof.proof(), expected)) return finish(s, "");
      finish(s, s->proof.proof().empty() ? "it presented no job token"
                                         : "it presented a wrong job token");
    });
  });
}

}  // namespace pipesgd::transport
