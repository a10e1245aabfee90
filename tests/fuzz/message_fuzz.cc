// libFuzzer target: a control-message frame from the network (8-byte header, then the body)
// decoded as each wire message the rendezvous (handshake and failure relay included) and the
// TCP transport read. Bad input must be
// rejected with pipesgd::Error (kDataLoss), never crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/base/error.h"
#include "transport/message_io.h"
#include "transport/wire.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  try {
    const uint32_t length = pipesgd::transport::MessageFrameLength(data, "fuzz peer");
    const std::string body(reinterpret_cast<const char*>(data) + 8,
                           std::min<size_t>(length, size - 8));
    pipesgd::wire::RendezvousHello hello;
    pipesgd::wire::RendezvousReply reply;
    pipesgd::wire::ConnectionHello connection;
    pipesgd::wire::AuthOpen open;
    pipesgd::wire::AuthChallenge challenge;
    pipesgd::wire::AuthProof proof;
    pipesgd::wire::AuthResult result;
    pipesgd::wire::RelayNotice notice;
    for (google::protobuf::MessageLite* m :
         {static_cast<google::protobuf::MessageLite*>(&hello),
          static_cast<google::protobuf::MessageLite*>(&reply),
          static_cast<google::protobuf::MessageLite*>(&connection),
          static_cast<google::protobuf::MessageLite*>(&open),
          static_cast<google::protobuf::MessageLite*>(&challenge),
          static_cast<google::protobuf::MessageLite*>(&proof),
          static_cast<google::protobuf::MessageLite*>(&result),
          static_cast<google::protobuf::MessageLite*>(&notice)}) {
      try {
        pipesgd::transport::ParseMessageBody(body, m, "fuzz peer");
      } catch (const pipesgd::Error&) {
      }
    }
  } catch (const pipesgd::Error&) {
  }
  return 0;
}
