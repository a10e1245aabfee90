// The parts of the ibverbs transport that need no RDMA device, kept apart so they are unit
// tested on any machine (tests/ib_common_test.cc): the connection info that travels in the
// rendezvous address, receive-credit accounting, the RLIMIT_MEMLOCK check, and the choice of
// device, port and GID index. transport/ibverbs/ib_transport.cc uses them.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pipesgd::transport::ibverbs {

// ---- Connection info ------------------------------------------------------------------------

// One RC queue pair this rank created for (peer, stream): what the peer needs to connect its
// own queue pair to it.
struct QpInfo {
  int32_t peer = 0;     // the rank this queue pair is for
  uint16_t stream = 0;  // which of the parallel connections to that rank
  uint32_t qpn = 0;     // queue pair number (24 bits)
  uint32_t psn = 0;     // initial packet sequence number (24 bits)
};

// A rank's published ibverbs address: its port's identity and one QpInfo per (peer, stream).
struct IbAddress {
  int32_t rank = 0;
  uint16_t lid = 0;          // InfiniBand local identifier (0 on RoCE)
  uint8_t port = 1;          // HCA port number
  uint8_t mtu = 0;           // active MTU as enum ibv_mtu: 1 = 256 B ... 5 = 4096 B
  uint8_t link_layer = 0;    // 1 InfiniBand, 2 Ethernet (RoCE)
  uint8_t gid_index = 0;     // local GID table index the address's gid came from
  std::array<uint8_t, 16> gid{};
  std::vector<QpInfo> qps;

  // The entry for (peer, stream), or null.
  const QpInfo* Find(int32_t peer, uint16_t stream) const;
};

// Little-endian binary: "PSGI" u8 version=1 u8 link_layer u8 port u8 mtu i32 rank u16 lid
// u8 gid_index u8 reserved u8 gid[16] u16 count, then count x {i32 peer u16 stream u32 qpn
// u32 psn}. docs/wire_protocol.md.
std::string EncodeIbAddress(const IbAddress& address);
// Throws Error kDataLoss naming `from` (e.g. "the address rank 3 published") and what is wrong:
// short or oversized input, bad magic or version, an MTU or link layer out of range, a qpn or
// psn wider than 24 bits, a count that disagrees with the length, a duplicate (peer, stream).
IbAddress DecodeIbAddress(std::string_view bytes, std::string_view from);

// ---- Credits --------------------------------------------------------------------------------

// Receive-side flow control of one connection. The receiver advertises a target buffer to the
// sender with a clear-to-send (CTS) control message per receive part; the sender answers each
// CTS, in order, with one RDMA write with immediate whose immediate is the CTS's sequence
// number. At most limit() CTS may be outstanding, which bounds the receive work requests and
// staging slots the sender can consume.
class CreditWindow {
 public:
  explicit CreditWindow(uint32_t limit);

  uint32_t limit() const { return limit_; }
  uint32_t outstanding() const { return next_ - consumed_; }
  bool CanAdvertise() const { return outstanding() < limit_; }
  // Takes a credit for a new CTS and returns its sequence number. REQUIRES: CanAdvertise().
  uint32_t Advertise();
  // A write with immediate `seq` arrived. Returns "" if it consumes the oldest outstanding CTS,
  // else what is wrong (nothing outstanding, or out of order) for a kDataLoss error.
  std::string Consume(uint32_t seq);

 private:
  uint32_t limit_;
  uint32_t next_ = 0;      // sequence number of the next CTS
  uint32_t consumed_ = 0;  // CTS answered so far
};

// The sending side's view: CTS must arrive in sequence order, each at most once.
class CtsSequence {
 public:
  // Returns "" if `seq` is the next expected CTS, else what is wrong.
  std::string Accept(uint32_t seq);
  uint32_t expected() const { return next_; }

 private:
  uint32_t next_ = 0;
};

// ---- RLIMIT_MEMLOCK -------------------------------------------------------------------------

struct MemlockLimit {
  bool unlimited = false;
  uint64_t bytes = 0;  // the soft limit, when not unlimited
};

// getrlimit(RLIMIT_MEMLOCK).
MemlockLimit ReadMemlockLimit();
// True if this process may pin memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK in its effective set).
bool HasIpcLockCapability();
// Throws Error kInvalidArgument if pinning `pinned_after` bytes in all (for `what`) exceeds
// `limit`, naming RLIMIT_MEMLOCK, its value and how to raise it.
void CheckMemlock(uint64_t pinned_after, const MemlockLimit& limit, std::string_view what);
// "8388608 bytes (8 MiB)" or "unlimited".
std::string DescribeMemlock(const MemlockLimit& limit);

// ---- Device, port and GID selection ---------------------------------------------------------

struct IbPortDesc {
  int port = 1;
  bool active = false;
  std::string state;   // "ACTIVE", "DOWN", ...
  bool ethernet = false;  // RoCE
  uint16_t lid = 0;
};

struct IbDeviceDesc {
  std::string name;  // "mlx5_0"
  std::vector<IbPortDesc> ports;
};

struct IbSelection {
  size_t device = 0;  // index into the list
  int port = 0;
  std::string reason;
};

// `want_device` "" = the first device with an active port; `want_port` 0 = its first active
// port. Throws Error kUnavailable if there is no device at all or none with an active port,
// kInvalidArgument if the named device or port does not exist or is not active (listing what
// there is).
IbSelection SelectIbPort(const std::vector<IbDeviceDesc>& devices, std::string_view want_device,
                         int want_port);

// "mlx5_0 port 1 ACTIVE (InfiniBand, lid 3); mlx5_1 port 1 DOWN (Ethernet)", or "none".
std::string DescribeIbDevices(const std::vector<IbDeviceDesc>& devices);

struct GidDesc {
  int index = 0;
  std::array<uint8_t, 16> gid{};
  bool roce_v2 = false;
};

// `requested` >= 0 must exist and be non-zero (else kInvalidArgument). -1 = auto: on
// InfiniBand index 0; on RoCE the first RoCE v2 GID that maps an IPv4 address, else the first
// RoCE v2 GID, else the first non-zero one. Throws kUnavailable if there is none.
int SelectGidIndex(const std::vector<GidDesc>& gids, int requested, bool ethernet);

}  // namespace pipesgd::transport::ibverbs
