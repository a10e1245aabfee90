#include "transport/message_io.h"

#include <array>
#include <cstring>
#include <thread>

namespace pipesgd::transport {
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

std::exception_ptr SocketError(const std::string& peer, const char* verb,
                               const boost::system::error_code& ec) {
  if (ec == asio::error::eof) {
    return std::make_exception_ptr(
        Error(ErrorCode::kUnavailable, fmt::format("{} closed the connection while we were {}", peer, verb)));
  }
  return std::make_exception_ptr(Error(
      ErrorCode::kUnavailable, fmt::format("{} failed with {}: {}", verb, peer, ec.message())));
}

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

void AsyncWriteMessage(tcp::socket& socket, const google::protobuf::MessageLite& message,
                       MessageHandler handler) {
  auto frame = std::make_shared<std::string>();
  std::string body = message.SerializeAsString();
  frame->resize(8 + body.size());
  PutU32(reinterpret_cast<uint8_t*>(frame->data()), kMessageMagic);
  PutU32(reinterpret_cast<uint8_t*>(frame->data()) + 4, static_cast<uint32_t>(body.size()));
  std::memcpy(frame->data() + 8, body.data(), body.size());
  asio::async_write(socket, asio::buffer(*frame),
                    [frame, handler = std::move(handler)](const boost::system::error_code& ec,
                                                          size_t) {
                      handler(ec ? SocketError("peer", "sending a control message", ec) : nullptr);
                    });
}

uint32_t MessageFrameLength(const uint8_t* header, const std::string& peer) {
  const uint32_t magic = GetU32(header);
  const uint32_t length = GetU32(header + 4);
  if (magic != kMessageMagic) {
    Throw(ErrorCode::kDataLoss,
          "{} sent a frame with magic {:#010x}, expected {:#010x} (\"PSGM\"): not a pipesgd "
          "peer, or a different protocol",
          peer, magic, kMessageMagic);
  }
  if (length > kMaxMessageBytes) {
    Throw(ErrorCode::kDataLoss,
          "{} sent a control message of {} bytes, more than the limit of {} bytes", peer, length,
          kMaxMessageBytes);
  }
  return length;
}

void ParseMessageBody(const std::string& body, google::protobuf::MessageLite* message,
                      const std::string& peer) {
  if (!message->ParseFromString(body)) {
    Throw(ErrorCode::kDataLoss,
          "{} sent a control message that does not parse as {} ({} bytes)", peer,
          message->GetTypeName(), body.size());
  }
}

void AsyncReadMessage(tcp::socket& socket, google::protobuf::MessageLite* message,
                      std::string peer, MessageHandler handler) {
  struct State {
    std::array<uint8_t, 8> header;
    std::string body;
  };
  auto state = std::make_shared<State>();
  asio::async_read(
      socket, asio::buffer(state->header),
      [&socket, message, state, peer = std::move(peer), handler = std::move(handler)](
          const boost::system::error_code& ec, size_t) mutable {
        if (ec) return handler(SocketError(peer, "reading a control message", ec));
        uint32_t length = 0;
        try {
          length = MessageFrameLength(state->header.data(), peer);
        } catch (const Error&) {
          return handler(std::current_exception());
        }
        state->body.resize(length);
        asio::async_read(socket, asio::buffer(state->body),
                         [message, state, peer, handler = std::move(handler)](
                             const boost::system::error_code& ec2, size_t) {
                           if (ec2) return handler(SocketError(peer, "reading a control message", ec2));
                           try {
                             ParseMessageBody(state->body, message, peer);
                           } catch (const Error&) {
                             return handler(std::current_exception());
                           }
                           handler(nullptr);
                         });
      });
}

bool RunUntil(asio::io_context& io, const bool* done, Deadline deadline) {
  while (!*done) {
    if (deadline.expired()) return false;
    if (io.stopped()) io.restart();
    // Slices bound the wait even if the deadline is far away, and keep time_point arithmetic
    // inside asio away from overflow.
    size_t ran = io.run_one_until(
        std::min(deadline.when(), Deadline::Clock::now() + std::chrono::milliseconds(50)));
    // Out of work but not done (e.g. waiting for a retry decided outside asio): don't spin.
    if (ran == 0 && io.stopped()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::string ExceptionText(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

std::string RemoteName(const tcp::socket& socket) {
  boost::system::error_code ec;
  auto remote = socket.remote_endpoint(ec);
  if (ec) return "unknown peer";
  return fmt::format("{}:{}", remote.address().to_string(), remote.port());
}

tcp::endpoint ResolveEndpoint(const std::string& host, uint16_t port) {
  asio::io_context io;
  tcp::resolver resolver(io);
  boost::system::error_code ec;
  auto results = resolver.resolve(host, std::to_string(port), ec);
  if (ec || results.empty()) {
    Throw(ErrorCode::kInvalidArgument, "cannot resolve host '{}': {}", host,
          ec ? ec.message() : "no addresses");
  }
  for (const auto& r : results) {
    if (r.endpoint().address().is_v4()) return r.endpoint();
  }
  return results.begin()->endpoint();
}

std::string LocalIpToward(const std::string& host, uint16_t port) {
  tcp::endpoint target = ResolveEndpoint(host, port);
  asio::io_context io;
  asio::ip::udp::socket probe(io);
  boost::system::error_code ec;
  asio::ip::udp::endpoint udp_target(target.address(), target.port());
  probe.open(udp_target.protocol(), ec);
  if (!ec) probe.connect(udp_target, ec);
  if (ec) {
    Throw(ErrorCode::kUnavailable, "no route from this host to {} ({}:{}): {}", host,
          target.address().to_string(), port, ec.message());
  }
  return probe.local_endpoint().address().to_string();
}

}  // namespace pipesgd::transport
