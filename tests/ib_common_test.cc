// The ibverbs transport's device-free parts, which run on any machine: the connection info in
// the rendezvous address (exact bytes, bad input rejected by name), credit accounting, the
// RLIMIT_MEMLOCK check, device/port/GID selection against synthetic device lists, and what the
// transport and `auto` do on a host without RDMA devices.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <filesystem>

#include "core/base/error.h"
#include "transport/factory.h"
#include "transport/ibverbs/ib_common.h"
#ifdef PIPESGD_HAVE_IBVERBS
#include "transport/ibverbs/gpudirect.h"
#include "transport/ibverbs/ib_transport.h"
#endif

namespace pipesgd::transport::ibverbs {
namespace {

IbAddress Sample() {
  IbAddress a;
  a.rank = 3;
  a.lid = 0x1234;
  a.port = 1;
  a.mtu = 3;  // 1024
  a.link_layer = 2;
  a.gid_index = 3;
  for (int i = 0; i < 16; ++i) a.gid[i] = static_cast<uint8_t>(0xf0 + i);
  a.qps = {{2, 0, 0xabcdef, 0x123456}, {4, 1, 0x000001, 0xffffff}};
  return a;
}

std::string Hex(const std::string& bytes) {
  std::string s;
  for (unsigned char c : bytes) s += fmt::format("{:02x}", c);
  return s;
}

TEST(IbAddress, EncodesToTheDocumentedBytes) {
  EXPECT_EQ(Hex(EncodeIbAddress(Sample())),
            "50534749"           // magic "PSGI"
            "01020103"           // version 1, Ethernet, port 1, MTU code 3
            "03000000"           // rank 3
            "3412"               // lid
            "0300"               // gid index 3, reserved
            "f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff"  // gid
            "0200"               // 2 queue pairs
            "02000000" "0000" "efcdab00" "56341200"   // rank 2 stream 0 qpn psn
            "04000000" "0100" "01000000" "ffffff00"); // rank 4 stream 1
}

TEST(IbAddress, RoundTrips) {
  const IbAddress a = DecodeIbAddress(EncodeIbAddress(Sample()), "test");
  EXPECT_EQ(a.rank, 3);
  EXPECT_EQ(a.lid, 0x1234);
  EXPECT_EQ(a.port, 1);
  EXPECT_EQ(a.mtu, 3);
  EXPECT_EQ(a.link_layer, 2);
  EXPECT_EQ(a.gid_index, 3);
  EXPECT_EQ(a.gid, Sample().gid);
  ASSERT_EQ(a.qps.size(), 2u);
  ASSERT_NE(a.Find(4, 1), nullptr);
  EXPECT_EQ(a.Find(4, 1)->qpn, 1u);
  EXPECT_EQ(a.Find(4, 1)->psn, 0xffffffu);
  EXPECT_EQ(a.Find(2, 0)->qpn, 0xabcdefu);
  EXPECT_EQ(a.Find(2, 1), nullptr);
  IbAddress empty;
  empty.mtu = 5;
  empty.link_layer = 1;
  EXPECT_EQ(DecodeIbAddress(EncodeIbAddress(empty), "x").qps.size(), 0u);
}

void ExpectBad(std::string bytes, const std::string& fragment) {
  try {
    DecodeIbAddress(bytes, "the address rank 7 published");
    ADD_FAILURE() << "accepted: " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    const std::string what = e.what();
    EXPECT_NE(what.find("the address rank 7 published is not a valid ibverbs address"), std::string::npos) << what;
    EXPECT_NE(what.find(fragment), std::string::npos) << what;
  }
}

TEST(IbAddress, BadInputIsRejectedByName) {
  const std::string good = EncodeIbAddress(Sample());
  ExpectBad("", "shorter than the 34-byte header");
  ExpectBad(good.substr(0, 33), "shorter than the 34-byte header");
  std::string s = good;
  s[0] = 'X';
  ExpectBad(s, "magic 0x49475358, expected 0x49475350");
  s = good;
  s[4] = 2;
  ExpectBad(s, "version 2, this build speaks 1");
  s = good;
  s[5] = 0;
  ExpectBad(s, "link layer 0");
  s = good;
  s[6] = 0;
  ExpectBad(s, "port 0");
  s = good;
  s[7] = 6;
  ExpectBad(s, "MTU code 6");
  ExpectBad(good.substr(0, good.size() - 1), "2 queue pairs announced, which needs 62 bytes");
  ExpectBad(good + "x", "2 queue pairs announced, which needs 62 bytes");
  s = good;
  s[34 + 6 + 3] = 1;  // qpn of the first entry gets a 25th bit
  ExpectBad(s, "queue pair 0 has qpn 0x1abcdef");
  s = good;
  s[34 + 10 + 3] = 1;  // psn
  ExpectBad(s, "psn 0x1123456, wider than 24 bits");
  s = good;
  s.replace(34 + 14, 6, s.substr(34, 6));  // second entry = first's rank and stream
  ExpectBad(s, "two queue pairs for rank 2 stream 0");
  s = good;
  s[34 + 3] = static_cast<char>(0x80);  // negative rank
  ExpectBad(s, "is for rank -2147483646");
}

TEST(Credits, WindowBoundsOutstandingClearToSend) {
  CreditWindow w(3);
  EXPECT_EQ(w.limit(), 3u);
  EXPECT_EQ(w.outstanding(), 0u);
  EXPECT_EQ(w.Consume(0), "an RDMA write with immediate 0 arrived, but no clear-to-send is outstanding (0 answered so far)");
  EXPECT_EQ(w.Advertise(), 0u);
  EXPECT_EQ(w.Advertise(), 1u);
  EXPECT_EQ(w.Advertise(), 2u);
  EXPECT_FALSE(w.CanAdvertise());
  EXPECT_EQ(w.outstanding(), 3u);
  EXPECT_EQ(w.Consume(1), "an RDMA write with immediate 1 arrived where 0 was next (the oldest of 3 outstanding clear-to-send)");
  EXPECT_EQ(w.Consume(0), "");
  EXPECT_TRUE(w.CanAdvertise());
  EXPECT_EQ(w.Advertise(), 3u);
  EXPECT_EQ(w.Consume(1), "");
  EXPECT_EQ(w.Consume(2), "");
  EXPECT_EQ(w.Consume(3), "");
  EXPECT_EQ(w.outstanding(), 0u);
  EXPECT_EQ(w.Consume(4), "an RDMA write with immediate 4 arrived, but no clear-to-send is outstanding (4 answered so far)");
}

TEST(Credits, SequenceNumbersWrapAround) {
  CreditWindow w(2);
  // outstanding() is next - consumed in uint32 arithmetic, so wrap is harmless.
  for (int i = 0; i < 1000; ++i) {
    const uint32_t s = w.Advertise();
    EXPECT_EQ(w.Consume(s), "");
  }
  EXPECT_EQ(w.outstanding(), 0u);
}

TEST(Credits, SenderChecksClearToSendOrder) {
  CtsSequence s;
  EXPECT_EQ(s.Accept(0), "");
  EXPECT_EQ(s.Accept(1), "");
  EXPECT_EQ(s.Accept(3), "clear-to-send 3 arrived where 2 was next");
  EXPECT_EQ(s.Accept(2), "");
  EXPECT_EQ(s.expected(), 3u);
}

TEST(Memlock, TooSmallNamesTheLimitAndItsValue) {
  const MemlockLimit limit{false, 8388608};
  EXPECT_NO_THROW(CheckMemlock(8388608, limit, "x"));
  EXPECT_NO_THROW(CheckMemlock(1 << 30, MemlockLimit{true, 0}, "x"));
  try {
    CheckMemlock(64 << 20, limit, "a registered buffer");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string prefix =
        "RLIMIT_MEMLOCK (ulimit -l) is 8388608 bytes (8.0 MiB), but a registered buffer needs "
        "67108864 bytes (64.0 MiB) of memory pinned for RDMA: raise the limit (ulimit -l "
        "unlimited;";
    EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
  }
}

void CheckWithLowLimit(rlim_t max) {
  rlimit low{65536, max};
  setrlimit(RLIMIT_MEMLOCK, &low);
  try {
    CheckMemlock(1 << 20, ReadMemlockLimit(), "the test");
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(3);
  }
  std::exit(0);
}

TEST(Memlock, ReadsThisProcessLimit) {
  rlimit r{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &r), 0);
  const MemlockLimit limit = ReadMemlockLimit();
  if (r.rlim_cur == RLIM_INFINITY) {
    EXPECT_TRUE(limit.unlimited);
    EXPECT_EQ(DescribeMemlock(limit), "unlimited");
  } else {
    EXPECT_FALSE(limit.unlimited);
    EXPECT_EQ(limit.bytes, r.rlim_cur);
    // Lower it in a child and check the error names the real value.
    EXPECT_EXIT(CheckWithLowLimit(r.rlim_max), ::testing::ExitedWithCode(3),
                "RLIMIT_MEMLOCK \\(ulimit -l\\) is 65536 bytes \\(0.1 MiB\\)");
  }
}

std::vector<IbDeviceDesc> Devices() {
  return {{"mlx5_0", {{1, false, "DOWN", false, 0}, {2, true, "ACTIVE", false, 7}}},
          {"mlx5_1", {{1, true, "ACTIVE", true, 0}}}};
}

TEST(SelectIbPort, AutoPicksTheFirstActivePort) {
  IbSelection s = SelectIbPort(Devices(), "", 0);
  EXPECT_EQ(s.device, 0u);
  EXPECT_EQ(s.port, 2);
  EXPECT_EQ(s.reason, "mlx5_0 port 2 (the first device with an active port, first active port)");
}

TEST(SelectIbPort, NamedDeviceAndPort) {
  IbSelection s = SelectIbPort(Devices(), "mlx5_1", 0);
  EXPECT_EQ(s.device, 1u);
  EXPECT_EQ(s.port, 1);
  s = SelectIbPort(Devices(), "mlx5_0", 2);
  EXPECT_EQ(s.device, 0u);
  EXPECT_EQ(s.port, 2);
  EXPECT_EQ(s.reason, "mlx5_0 port 2 (the device asked for, port as asked)");
  s = SelectIbPort(Devices(), "", 1);  // auto device, port 1: mlx5_0:1 is down, mlx5_1:1 is not
  EXPECT_EQ(s.device, 1u);
  EXPECT_EQ(s.port, 1);
  EXPECT_EQ(s.reason, "mlx5_1 port 1 (the first device with an active port, port as asked)");
}

void ExpectSelectError(const std::vector<IbDeviceDesc>& devices, std::string_view dev, int port,
                       ErrorCode code, const std::string& message) {
  try {
    SelectIbPort(devices, dev, port);
    ADD_FAILURE() << "no error for " << dev << ":" << port;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code);
    EXPECT_EQ(std::string(e.what()), message);
  }
}

TEST(SelectIbPort, ErrorsNameWhatThereIs) {
  const std::string list = "mlx5_0 port 1 DOWN (InfiniBand, lid 0); mlx5_0 port 2 ACTIVE (InfiniBand, lid 7); "
                           "mlx5_1 port 1 ACTIVE (Ethernet/RoCE)";
  ExpectSelectError({}, "", 0, ErrorCode::kUnavailable,
                    "no RDMA device found (ibv_get_device_list returned none: no InfiniBand/RoCE NIC, "
                    "or its rdma-core provider or kernel driver is missing)");
  ExpectSelectError(Devices(), "mlx5_9", 0, ErrorCode::kInvalidArgument,
                    "no RDMA device named 'mlx5_9' (devices: " + list + ")");
  ExpectSelectError(Devices(), "mlx5_0", 1, ErrorCode::kInvalidArgument,
                    "RDMA device mlx5_0 port 1 is DOWN, not ACTIVE (devices: " + list + ")");
  ExpectSelectError(Devices(), "mlx5_1", 3, ErrorCode::kInvalidArgument,
                    "RDMA device mlx5_1 has no port 3 (devices: " + list + ")");
  std::vector<IbDeviceDesc> down = {{"rxe0", {{1, false, "DOWN", true, 0}}}};
  ExpectSelectError(down, "", 0, ErrorCode::kUnavailable,
                    "no RDMA port is ACTIVE (devices: rxe0 port 1 DOWN (Ethernet/RoCE))");
  ExpectSelectError(Devices(), "", 3, ErrorCode::kUnavailable,
                    "no RDMA device has an ACTIVE port 3 (devices: " + list + ")");
  ExpectSelectError(down, "rxe0", 0, ErrorCode::kInvalidArgument,
                    "RDMA device rxe0 has no ACTIVE port (devices: rxe0 port 1 DOWN (Ethernet/RoCE))");
}

GidDesc Gid(int index, std::initializer_list<uint8_t> tail, bool v2) {
  GidDesc g;
  g.index = index;
  size_t i = 16 - tail.size();
  for (uint8_t b : tail) g.gid[i++] = b;
  g.roce_v2 = v2;
  return g;
}

TEST(SelectGidIndex, AutoAndExplicit) {
  // RoCE: 0 link-local v1, 1 link-local v2, 2 IPv4-mapped v1, 3 IPv4-mapped v2.
  GidDesc link_local_v1 = Gid(0, {1}, false);
  link_local_v1.gid[0] = 0xfe;
  link_local_v1.gid[1] = 0x80;
  GidDesc link_local_v2 = link_local_v1;
  link_local_v2.index = 1;
  link_local_v2.roce_v2 = true;
  GidDesc mapped_v1 = Gid(2, {0xff, 0xff, 10, 0, 0, 2}, false);
  GidDesc mapped_v2 = Gid(3, {0xff, 0xff, 10, 0, 0, 2}, true);
  std::vector<GidDesc> roce = {link_local_v1, link_local_v2, mapped_v1, mapped_v2};
  EXPECT_EQ(SelectGidIndex(roce, -1, true), 3);
  EXPECT_EQ(SelectGidIndex({link_local_v1, link_local_v2}, -1, true), 1);
  EXPECT_EQ(SelectGidIndex({link_local_v1}, -1, true), 0);
  EXPECT_EQ(SelectGidIndex(roce, 2, true), 2);
  EXPECT_EQ(SelectGidIndex(roce, -1, false), 0);  // InfiniBand: index 0
  try {
    SelectGidIndex(roce, 9, true);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "GID index 9 does not exist on this port (4 entries)");
  }
  try {
    SelectGidIndex({Gid(0, {}, true)}, 0, true);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "GID index 0 is empty (all zero) on this port");
  }
  try {
    SelectGidIndex({Gid(0, {}, true)}, -1, true);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  }
}

#ifdef PIPESGD_HAVE_IBVERBS
// On this host (no RDMA device) the ibverbs transport says so, and auto does not pick it.
TEST(IbverbsHere, NoDeviceMeansAClearErrorAndAutoSkipsIt) {
  const auto devices = ProbeIbDevices();
  if (!devices.empty()) GTEST_SKIP() << "this host has RDMA devices: " << DescribeIbDevices(devices);
  try {
    IbOptions options;
    options.world_size = 2;
    options.peers = {1};
    CreateIbTransport(options);
    ADD_FAILURE() << "created an ibverbs transport without a device";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_NE(std::string(e.what()).find("no RDMA device found"), std::string::npos) << e.what();
  }
  const AutoChoice choice = ChooseAutoTransport();
  EXPECT_NE(choice.kind, TransportKind::kIbverbs);
  EXPECT_EQ(choice.reason.rfind("no RDMA device (ibv_get_device_list found none); ", 0), 0u)
      << choice.reason;
}

// Out-of-range ACK timeout or retry count: named with its value, before any device work (the
// queue pair would take them modulo 32 and 8), on any host.
TEST(IbverbsHere, AckTimeoutAndRetryCountOutOfRangeAreNamed) {
  IbOptions options;
  options.world_size = 2;
  options.peers = {1};
  options.ack_timeout = 32;
  try {
    CreateIbTransport(options);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_STREQ(e.what(),
                 "rank 0: ibverbs ACK timeout 32 is out of range: expected an exponent in [1, 31] "
                 "(4.096 us * 2^timeout per try; comm.ib_timeout)");
  }
  options.ack_timeout = 18;
  options.retry_count = 8;
  try {
    CreateIbTransport(options);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_STREQ(e.what(),
                 "rank 0: ibverbs retry count 8 is out of range: expected [0, 7] (comm.ib_retry_count)");
  }
}
#endif

// Regression: AUTO chose UCX without RDMA, half as fast as TCP over the same loopback.
TEST(AutoChoice, TcpWithoutAnActiveRdmaPortAndTheReasonSaysWhy) {
  const AutoChoice choice = ChooseAutoTransport();
  if (choice.kind != TransportKind::kIbverbs) {
    EXPECT_EQ(choice.kind, TransportKind::kTcp);
    EXPECT_NE(choice.reason.find("; tcp: faster than UCX over TCP, and unlike UCX's shared memory it detects"),
              std::string::npos)
        << choice.reason;
  }
}

TEST(TransportNames, ParseAnyCase) {
  EXPECT_EQ(ParseTransportKind("tcp"), TransportKind::kTcp);
  EXPECT_EQ(ParseTransportKind("UCX"), TransportKind::kUcx);
  EXPECT_EQ(ParseTransportKind("IbVerbs"), TransportKind::kIbverbs);
  EXPECT_EQ(ParseTransportKind("auto"), std::nullopt);
  EXPECT_EQ(ParseTransportKind("rdma"), std::nullopt);
  EXPECT_EQ(TransportKindName(TransportKind::kIbverbs), "ibverbs");
  EXPECT_TRUE(TransportCompiled(TransportKind::kTcp));
}

#ifdef PIPESGD_HAVE_IBVERBS
// Where no GPU driver is loaded, GPUDirect is not offered, whatever the build (a CUDA build used to
// claim CUDA memory support on any host, and RegisterMemory(kCuda) then failed as unavailable).
TEST(GpuDirect, NotUsableWithoutAGpuDriverAndSaysWhy) {
  if (std::filesystem::exists("/dev/nvidiactl")) GTEST_SKIP() << "this host has an NVIDIA driver";
  std::string why;
  EXPECT_FALSE(GpuDirectUsable(&why));
#ifdef PIPESGD_HAVE_CUDA
  EXPECT_NE(why.find("libcuda.so.1"), std::string::npos) << why;
#else
  EXPECT_NE(why.find("built without CUDA"), std::string::npos) << why;
#endif
}
#endif

}  // namespace
}  // namespace pipesgd::transport::ibverbs
