// The ibverbs transport: reliable-connected (RC) queue pairs to each peer, receiver-driven RDMA
// writes with immediate, credit-based flow control, and GPUDirect RDMA for CUDA memory.
//
// Tested on soft-RoCE (rdma_rxe in a QEMU guest: ctest -L rdma, scripts/rdma_vm), never on a
// real NIC, InfiniBand or GPUDirect; docs/transports.md says what remains to verify.
//
// Address (rendezvous bytes): an IbAddress (ib_common.h): lid, gid, port, MTU, and the qpn and
// psn of one queue pair per (peer, stream). The queue pairs are created with the transport, for
// the peers named in IbOptions (for the ring: the two neighbours), so their numbers can travel
// in the one address every rank publishes.
// Connect: INIT -> RTR (the peer's qpn, psn, lid or gid) -> RTS, then a hello control message
// each way (rank, world size, stream), within the deadline.
// Data, per connection: for each non-empty part of a posted receive the receiver sends a
// clear-to-send (CTS: sequence, address, rkey, length) as soon as it holds a credit (at most 32
// outstanding); the sender answers each CTS, in order, with one RDMA write with immediate of
// the matching send part (immediate = CTS sequence); the receiver's completion consumes the
// credit. Target and source are the caller's memory when it lies in a registered region (zero
// copy; the only way for CUDA memory), an 8 KiB staging slot for small unregistered parts (the
// ring's chunk headers), or a registration made for the one op (large unregistered host parts).
// Completion: one CQ with a completion channel; Wait polls it, then sleeps on the channel's fd.
// Liveness: Wait sends a zero-length RDMA write on a connection that has waited 0.5 s without a
// completion; a dead peer's missing acknowledgement fails it ~2 s later.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/ibverbs/ib_common.h"
#include "transport/transport.h"

namespace pipesgd::transport::ibverbs {

struct IbOptions {
  int rank = 0;
  int world_size = 1;
  std::vector<int> peers;  // the ranks Connect will be called with
  int streams = 1;         // connections per peer
  std::string device;      // "" = the first device with an active port
  int port = 0;            // 0 = the first active port
  int gid_index = -1;      // -1 = auto (SelectGidIndex)
  // Local ACK timeout exponent (4.096 us * 2^ack_timeout per try; 1-31) and retries (0-7; soft-
  // RoCE, rdma_rxe, treats 7 as "retry forever"), as NCCL_IB_TIMEOUT and NCCL_IB_RETRY_CNT.
  int ack_timeout = 18;
  int retry_count = 6;
};

// Opens the device, creates the queue pairs and staging buffers. Throws Error kUnavailable (no
// device or no active port), kInvalidArgument (a named device/port/GID that does not exist, or
// RLIMIT_MEMLOCK too small: named with its value), kInternal (a verbs call failed: named with
// errno).
std::unique_ptr<Transport> CreateIbTransport(const IbOptions& options);

// Every RDMA device and port this host has (ibv_get_device_list); empty if none. Never throws.
std::vector<IbDeviceDesc> ProbeIbDevices();

// What GPUDirect RDMA support this build and host have, in words, for `pipesgd info`.
std::string GpuDirectStatus();

}  // namespace pipesgd::transport::ibverbs
