// GPUDirect RDMA: registering CUDA device memory with an RDMA protection domain so the NIC reads
// and writes GPU memory directly. Two ways, tried in order (as NCCL does):
//   1. dma-buf: cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) exports the
//      allocation as a dma-buf fd, ibv_reg_dmabuf_mr registers it (Linux >= 5.12, CUDA >= 11.7,
//      an open GPU kernel module);
//   2. peer memory: plain ibv_reg_mr on the device pointer, which works when the nvidia_peermem
//      kernel module is loaded.
// Compiled only when CMake finds the CUDA toolkit (PIPESGD_HAVE_CUDA); libcuda.so.1 is opened
// at run time, so the binary also runs where there is no GPU driver. NOT EXERCISED: the machine
// this was written on has neither a GPU nor an RDMA device.
#pragma once

#include <cstddef>
#include <string>

struct ibv_pd;
struct ibv_mr;

namespace pipesgd::transport::ibverbs {

// Registers [data, data + bytes) of CUDA device memory with `pd`. `how` is set to "dma-buf" or
// "peer memory (nvidia_peermem)". Throws Error kInvalidArgument if this build has no CUDA
// support or `data` is not CUDA device memory, kUnavailable if neither way works (naming both
// causes).
ibv_mr* RegisterCudaMemory(ibv_pd* pd, void* data, size_t bytes, int access, std::string* how);

// Whether RegisterCudaMemory can work on this host: a CUDA build, libcuda.so.1 loaded and at
// least one GPU. Otherwise false, with `why` saying what is missing. Never throws.
bool GpuDirectUsable(std::string* why);

// For `pipesgd info`: built or not, libcuda found or not, driver version, nvidia_peermem loaded.
std::string GpuDirectStatus();

}  // namespace pipesgd::transport::ibverbs
