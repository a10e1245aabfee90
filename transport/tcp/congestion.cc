#include "transport/tcp/congestion.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace pipesgd::transport {
namespace {

std::string ReadProc(const char* path) {
  std::ifstream in(path);
  std::string all, word;
  while (in >> word) all += (all.empty() ? "" : " ") + word;
  return all;
}

bool ListHas(const std::string& list, const std::string& name) {
  std::istringstream words(list);
  std::string w;
  while (words >> w) {
    if (w == name) return true;
  }
  return false;
}

bool SetAlgorithm(int fd, const std::string& name) {
  return setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(),
                    static_cast<socklen_t>(name.size())) == 0;
}

}  // namespace

std::string RestartCongestionControl(int fd, std::string* why) {
  const auto fail = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return std::string();
  };
  char buf[16] = {};  // TCP_CA_NAME_MAX (linux/tcp.h)
  socklen_t len = sizeof(buf);
  if (getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, buf, &len) != 0) {
    return fail(std::string("getsockopt(TCP_CONGESTION): ") + std::strerror(errno));
  }
  const std::string current(buf, strnlen(buf, len));
  if (current.empty() || current == "reno") {
    return fail("algorithm '" + current + "': no state to restart");
  }
  const std::string allowed = ReadProc("/proc/sys/net/ipv4/tcp_allowed_congestion_control");
  const std::string fallback = ReadProc("/proc/sys/net/ipv4/tcp_congestion_control");
  if (current != fallback && !ListHas(allowed, current)) {
    return fail("algorithm '" + current + "' is neither the default ('" + fallback +
                "') nor allowed ('" + allowed + "'): left as it is");
  }
  if (!SetAlgorithm(fd, "reno")) {
    return fail(std::string("setsockopt(TCP_CONGESTION, reno): ") + std::strerror(errno));
  }
  if (!SetAlgorithm(fd, current)) {
    const std::string err = std::strerror(errno);
    // The way back was checked above; should it still fail, reno is what the socket runs.
    return fail("setsockopt(TCP_CONGESTION, " + current + "): " + err + ": the socket runs reno");
  }
  return current;
}

}  // namespace pipesgd::transport
