// transport/tcp/congestion.h on loopback sockets: the algorithm is restarted, not changed, and
// the connection carries on.
#include "transport/tcp/congestion.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace pipesgd {
namespace {

// A connected pair on 127.0.0.1, closed at the end.
struct Pair {
  int client = -1, server = -1;
  Pair() {
    const int listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(listener, 1), 0);
    EXPECT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    client = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    server = accept(listener, nullptr, nullptr);
    close(listener);
  }
  ~Pair() {
    close(client);
    close(server);
  }
};

std::string Algorithm(int fd) {
  char buf[16] = {};  // TCP_CA_NAME_MAX (linux/tcp.h)
  socklen_t len = sizeof(buf);
  EXPECT_EQ(getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, buf, &len), 0);
  return std::string(buf, strnlen(buf, len));
}

// BBR's bandwidth estimate (bytes/s), from TCP_CC_INFO.
uint64_t BbrBandwidth(int fd) {
  tcp_cc_info info{};
  socklen_t len = sizeof(info);
  EXPECT_EQ(getsockopt(fd, IPPROTO_TCP, TCP_CC_INFO, &info, &len), 0);
  return (static_cast<uint64_t>(info.bbr.bbr_bw_hi) << 32) | info.bbr.bbr_bw_lo;
}

// Sends `bytes` from client to server and checks every byte that arrives.
void Transfer(Pair& p, size_t bytes, uint8_t seed) {
  std::vector<uint8_t> out(bytes), in(bytes);
  std::iota(out.begin(), out.end(), seed);
  std::thread reader([&] {
    size_t got = 0;
    while (got < bytes) {
      const ssize_t n = read(p.server, in.data() + got, bytes - got);
      ASSERT_GT(n, 0);
      got += static_cast<size_t>(n);
    }
  });
  size_t sent = 0;
  while (sent < bytes) {
    const ssize_t n = write(p.client, out.data() + sent, bytes - sent);
    ASSERT_GT(n, 0);
    sent += static_cast<size_t>(n);
  }
  reader.join();
  EXPECT_EQ(in, out);
}

std::string Proc(const char* path) {
  std::string all, word;
  std::ifstream f(path);
  while (f >> word) all += (all.empty() ? "" : " ") + word;
  return all;
}

// BBR keeps a bandwidth estimate: after a restart it is gone (bbr_init resets its filters and
// its ProbeRTT clock) and the socket still runs bbr and still carries bytes.
TEST(TcpCongestion, RestartClearsBbrsStateAndKeepsBbr) {
  Pair p;
  const char bbr[] = "bbr";
  if (setsockopt(p.client, IPPROTO_TCP, TCP_CONGESTION, bbr, 3) != 0) {
    GTEST_SKIP() << "this kernel does not let this process use bbr: " << std::strerror(errno);
  }
  Transfer(p, 8 << 20, 1);
  ASSERT_GT(BbrBandwidth(p.client), 0u);
  std::string why;
  const std::string restarted = transport::RestartCongestionControl(p.client, &why);
  const std::string allowed = Proc("/proc/sys/net/ipv4/tcp_allowed_congestion_control");
  if (Proc("/proc/sys/net/ipv4/tcp_congestion_control") != "bbr" &&
      (" " + allowed + " ").find(" bbr ") == std::string::npos) {
    // Set above with CAP_NET_ADMIN, but not a way back for every process: left alone, and said.
    EXPECT_EQ(restarted, "");
    EXPECT_NE(why.find("algorithm 'bbr' is neither the default"), std::string::npos) << why;
    EXPECT_EQ(Algorithm(p.client), "bbr");
    return;
  }
  EXPECT_EQ(restarted, "bbr") << why;
  EXPECT_EQ(Algorithm(p.client), "bbr");
  EXPECT_EQ(BbrBandwidth(p.client), 0u);
  Transfer(p, 1 << 20, 7);
  EXPECT_GT(BbrBandwidth(p.client), 0u);
}

// The default algorithm, whichever it is, comes back as it was.
TEST(TcpCongestion, TheDefaultAlgorithmComesBack) {
  Pair p;
  const std::string before = Algorithm(p.client);
  Transfer(p, 1 << 20, 3);
  std::string why;
  const std::string restarted = transport::RestartCongestionControl(p.client, &why);
  EXPECT_EQ(restarted, before == "reno" ? "" : before) << why;
  EXPECT_EQ(Algorithm(p.client), before);
  Transfer(p, 1 << 20, 5);
}

// Not a TCP socket: nothing done, and why.
TEST(TcpCongestion, NotATcpSocketIsLeftAlone) {
  const int udp = socket(AF_INET, SOCK_DGRAM, 0);
  std::string why;
  EXPECT_EQ(transport::RestartCongestionControl(udp, &why), "");
  EXPECT_NE(why.find("getsockopt(TCP_CONGESTION)"), std::string::npos) << why;
  close(udp);
  EXPECT_EQ(transport::RestartCongestionControl(-1, &why), "");
  EXPECT_NE(why.find("Bad file descriptor"), std::string::npos) << why;
}

}  // namespace
}  // namespace pipesgd
