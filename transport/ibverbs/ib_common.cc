#include "transport/ibverbs/ib_common.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <set>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::transport::ibverbs {
namespace {

constexpr uint32_t kMagic = 0x49475350;  // "PSGI"
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 4 + 4 + 4 + 2 + 2 + 16 + 2;  // 34
constexpr size_t kEntryBytes = 4 + 2 + 4 + 4;                 // 14
constexpr size_t kMaxEntries = 1 << 16;
constexpr uint32_t k24Bits = (1u << 24) - 1;

template <typename T>
void Put(std::string* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out->push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
  }
}

template <typename T>
T Get(const unsigned char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

std::string Mib(uint64_t bytes) {
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

const QpInfo* IbAddress::Find(int32_t peer, uint16_t stream) const {
  for (const QpInfo& q : qps) {
    if (q.peer == peer && q.stream == stream) return &q;
  }
  return nullptr;
}

std::string EncodeIbAddress(const IbAddress& a) {
  PSGD_CHECK_LE(a.qps.size(), kMaxEntries - 1);
  std::string out;
  out.reserve(kHeaderBytes + a.qps.size() * kEntryBytes);
  Put<uint32_t>(&out, kMagic);
  Put<uint8_t>(&out, kVersion);
  Put<uint8_t>(&out, a.link_layer);
  Put<uint8_t>(&out, a.port);
  Put<uint8_t>(&out, a.mtu);
  Put<int32_t>(&out, a.rank);
  Put<uint16_t>(&out, a.lid);
  Put<uint8_t>(&out, a.gid_index);
  Put<uint8_t>(&out, 0);
  out.append(reinterpret_cast<const char*>(a.gid.data()), a.gid.size());
  Put<uint16_t>(&out, static_cast<uint16_t>(a.qps.size()));
  for (const QpInfo& q : a.qps) {
    PSGD_CHECK_LE(q.qpn, k24Bits);
    PSGD_CHECK_LE(q.psn, k24Bits);
    Put<int32_t>(&out, q.peer);
    Put<uint16_t>(&out, q.stream);
    Put<uint32_t>(&out, q.qpn);
    Put<uint32_t>(&out, q.psn);
  }
  return out;
}

IbAddress DecodeIbAddress(std::string_view bytes, std::string_view from) {
  auto bad = [&](const std::string& what) {
    Throw(ErrorCode::kDataLoss, "{} is not a valid ibverbs address ({} bytes): {}", from,
          bytes.size(), what);
  };
  if (bytes.size() < kHeaderBytes) {
    bad(fmt::format("shorter than the {}-byte header", kHeaderBytes));
  }
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  if (Get<uint32_t>(p) != kMagic) {
    bad(fmt::format("magic {:#010x}, expected {:#010x} (\"PSGI\"); is every rank using "
                    "comm.transport = IBVERBS?",
                    Get<uint32_t>(p), kMagic));
  }
  IbAddress a;
  if (p[4] != kVersion) bad(fmt::format("version {}, this build speaks {}", p[4], kVersion));
  a.link_layer = p[5];
  a.port = p[6];
  a.mtu = p[7];
  if (a.link_layer != 1 && a.link_layer != 2) {
    bad(fmt::format("link layer {} (1 InfiniBand or 2 Ethernet expected)", a.link_layer));
  }
  if (a.port == 0) bad("port 0 (ports count from 1)");
  if (a.mtu < 1 || a.mtu > 5) bad(fmt::format("MTU code {} (1..5, 256 to 4096 bytes)", a.mtu));
  a.rank = Get<int32_t>(p + 8);
  a.lid = Get<uint16_t>(p + 12);
  a.gid_index = p[14];
  std::memcpy(a.gid.data(), p + 16, 16);
  const size_t count = Get<uint16_t>(p + 32);
  if (bytes.size() != kHeaderBytes + count * kEntryBytes) {
    bad(fmt::format("{} queue pairs announced, which needs {} bytes", count,
                    kHeaderBytes + count * kEntryBytes));
  }
  std::set<std::pair<int32_t, uint16_t>> seen;
  for (size_t i = 0; i < count; ++i) {
    const unsigned char* e = p + kHeaderBytes + i * kEntryBytes;
    QpInfo q{Get<int32_t>(e), Get<uint16_t>(e + 4), Get<uint32_t>(e + 6), Get<uint32_t>(e + 10)};
    if (q.qpn > k24Bits || q.psn > k24Bits) {
      bad(fmt::format("queue pair {} has qpn {:#x} psn {:#x}, wider than 24 bits", i, q.qpn, q.psn));
    }
    if (q.peer < 0) bad(fmt::format("queue pair {} is for rank {}", i, q.peer));
    if (!seen.insert({q.peer, q.stream}).second) {
      bad(fmt::format("two queue pairs for rank {} stream {}", q.peer, q.stream));
    }
    a.qps.push_back(q);
  }
  return a;
}

// ---------------------------------------------------------------------------------------------

CreditWindow::CreditWindow(uint32_t limit) : limit_(limit) { PSGD_CHECK_GE(limit, 1u); }

uint32_t CreditWindow::Advertise() {
  PSGD_CHECK(CanAdvertise());
  return next_++;
}

std::string CreditWindow::Consume(uint32_t seq) {
  if (outstanding() == 0) {
    return fmt::format("an RDMA write with immediate {} arrived, but no clear-to-send is "
                       "outstanding ({} answered so far)",
                       seq, consumed_);
  }
  if (seq != consumed_) {
    return fmt::format("an RDMA write with immediate {} arrived where {} was next (the oldest of "
                       "{} outstanding clear-to-send)",
                       seq, consumed_, outstanding());
  }
  ++consumed_;
  return "";
}

std::string CtsSequence::Accept(uint32_t seq) {
  if (seq != next_) {
    return fmt::format("clear-to-send {} arrived where {} was next", seq, next_);
  }
  ++next_;
  return "";
}

// ---------------------------------------------------------------------------------------------

MemlockLimit ReadMemlockLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return {true, 0};
  }
  return {false, static_cast<uint64_t>(limit.rlim_cur)};
}

bool HasIpcLockCapability() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_IPC_LOCK / 32].effective >> (CAP_IPC_LOCK % 32)) & 1u;
}

std::string DescribeMemlock(const MemlockLimit& limit) {
  if (limit.unlimited) return "unlimited";
  return fmt::format("{} bytes ({})", limit.bytes, Mib(limit.bytes));
}

void CheckMemlock(uint64_t pinned_after, const MemlockLimit& limit, std::string_view what) {
  if (limit.unlimited || pinned_after <= limit.bytes) return;
  Throw(ErrorCode::kInvalidArgument,
        "RLIMIT_MEMLOCK (ulimit -l) is {}, but {} needs {} bytes ({}) of memory pinned for RDMA: "
        "raise the limit (ulimit -l unlimited; LimitMEMLOCK=infinity for a systemd service; "
        "'* - memlock unlimited' in /etc/security/limits.conf; docker run --ulimit memlock=-1)",
        DescribeMemlock(limit), what, pinned_after, Mib(pinned_after));
}

// ---------------------------------------------------------------------------------------------

std::string DescribeIbDevices(const std::vector<IbDeviceDesc>& devices) {
  std::string s;
  for (const auto& d : devices) {
    for (const auto& p : d.ports) {
      if (!s.empty()) s += "; ";
      s += fmt::format("{} port {} {} ({}{})", d.name, p.port, p.state,
                       p.ethernet ? "Ethernet/RoCE" : "InfiniBand",
                       p.ethernet ? "" : fmt::format(", lid {}", p.lid));
    }
    if (d.ports.empty()) s += (s.empty() ? "" : "; ") + d.name + " (no ports)";
  }
  return s.empty() ? "none" : s;
}

IbSelection SelectIbPort(const std::vector<IbDeviceDesc>& devices, std::string_view want_device,
                         int want_port) {
  if (devices.empty()) {
    Throw(ErrorCode::kUnavailable,
          "no RDMA device found (ibv_get_device_list returned none: no InfiniBand/RoCE NIC, or "
          "its rdma-core provider or kernel driver is missing)");
  }
  // strict: the device was named, so a missing or inactive port is an error, not a reason to
  // look at the next device.
  auto pick_port = [&](size_t d, const char* how, bool strict) -> IbSelection {
    const IbDeviceDesc& dev = devices[d];
    for (const IbPortDesc& p : dev.ports) {
      if (want_port != 0 && p.port != want_port) continue;
      if (p.active) {
        return {d, p.port,
                fmt::format("{} port {} ({}{})", dev.name, p.port, how,
                            want_port ? ", port as asked" : ", first active port")};
      }
      if (want_port != 0 && strict) {
        Throw(ErrorCode::kInvalidArgument, "RDMA device {} port {} is {}, not ACTIVE (devices: {})",
              dev.name, p.port, p.state, DescribeIbDevices(devices));
      }
    }
    if (want_port != 0 && strict) {
      Throw(ErrorCode::kInvalidArgument, "RDMA device {} has no port {} (devices: {})", dev.name,
            want_port, DescribeIbDevices(devices));
    }
    return {d, 0, ""};
  };
  if (!want_device.empty()) {
    for (size_t d = 0; d < devices.size(); ++d) {
      if (devices[d].name != want_device) continue;
      IbSelection s = pick_port(d, "the device asked for", true);
      if (s.port == 0) {
        Throw(ErrorCode::kInvalidArgument, "RDMA device {} has no ACTIVE port (devices: {})",
              want_device, DescribeIbDevices(devices));
      }
      return s;
    }
    Throw(ErrorCode::kInvalidArgument, "no RDMA device named '{}' (devices: {})", want_device,
          DescribeIbDevices(devices));
  }
  for (size_t d = 0; d < devices.size(); ++d) {
    IbSelection s = pick_port(d, "the first device with an active port", false);
    if (s.port != 0) return s;
  }
  if (want_port != 0) {
    Throw(ErrorCode::kUnavailable, "no RDMA device has an ACTIVE port {} (devices: {})", want_port,
          DescribeIbDevices(devices));
  }
  Throw(ErrorCode::kUnavailable, "no RDMA port is ACTIVE (devices: {})", DescribeIbDevices(devices));
}

int SelectGidIndex(const std::vector<GidDesc>& gids, int requested, bool ethernet) {
  auto zero = [](const GidDesc& g) {
    for (uint8_t b : g.gid) {
      if (b != 0) return false;
    }
    return true;
  };
  if (requested >= 0) {
    for (const GidDesc& g : gids) {
      if (g.index != requested) continue;
      if (zero(g)) {
        Throw(ErrorCode::kInvalidArgument, "GID index {} is empty (all zero) on this port",
              requested);
      }
      return requested;
    }
    Throw(ErrorCode::kInvalidArgument, "GID index {} does not exist on this port ({} entries)",
          requested, gids.size());
  }
  if (!ethernet) {
    for (const GidDesc& g : gids) {
      if (g.index == 0) return 0;
    }
  }
  auto ipv4_mapped = [](const GidDesc& g) {
    static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return std::memcmp(g.gid.data(), kPrefix, 12) == 0;
  };
  for (const GidDesc& g : gids) {
    if (g.roce_v2 && !zero(g) && ipv4_mapped(g)) return g.index;
  }
  for (const GidDesc& g : gids) {
    if (g.roce_v2 && !zero(g)) return g.index;
  }
  for (const GidDesc& g : gids) {
    if (!zero(g)) return g.index;
  }
  Throw(ErrorCode::kUnavailable, "this port has no usable GID ({} entries, all empty)",
        gids.size());
}

}  // namespace pipesgd::transport::ibverbs
