#include "transport/ibverbs/gpudirect.h"

#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "core/base/error.h"

#ifdef PIPESGD_HAVE_CUDA
#include <cuda.h>
#endif

namespace pipesgd::transport::ibverbs {

#ifdef PIPESGD_HAVE_CUDA
namespace {

// The few driver entry points we need, resolved from libcuda.so.1 at run time.
struct CudaDriver {
  bool loaded = false;
  std::string error;  // why not loaded
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDriverGetVersion) driver_version = nullptr;
  decltype(&::cuDeviceGetCount) device_count = nullptr;
  decltype(&::cuPointerGetAttribute) pointer_attribute = nullptr;
  decltype(&::cuMemGetAddressRange) address_range = nullptr;
  decltype(&::cuMemGetHandleForAddressRange) range_handle = nullptr;  // CUDA >= 11.7
};

const CudaDriver& Driver() {
  static CudaDriver driver;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      driver.error = fmt::format("libcuda.so.1 not found ({}): no NVIDIA driver on this host",
                                 dlerror());
      return;
    }
    auto sym = [&](auto& fn, const char* name, const char* alt = nullptr) {
      void* p = dlsym(lib, name);
      if (!p && alt) p = dlsym(lib, alt);
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    sym(driver.init, "cuInit");
    sym(driver.driver_version, "cuDriverGetVersion");
    sym(driver.device_count, "cuDeviceGetCount");
    sym(driver.pointer_attribute, "cuPointerGetAttribute");
    sym(driver.address_range, "cuMemGetAddressRange_v2", "cuMemGetAddressRange");
    sym(driver.range_handle, "cuMemGetHandleForAddressRange");
    if (!driver.init || !driver.pointer_attribute || !driver.address_range) {
      driver.error = "libcuda.so.1 lacks cuInit/cuPointerGetAttribute/cuMemGetAddressRange";
      return;
    }
    if (CUresult r = driver.init(0); r != CUDA_SUCCESS) {
      driver.error = fmt::format("cuInit failed with CUDA error {} (no usable GPU?)", static_cast<int>(r));
      return;
    }
    driver.loaded = true;
  });
  return driver;
}

bool PeerMemLoaded() {
  std::error_code ec;
  return std::filesystem::exists("/sys/module/nvidia_peermem", ec) ||
         std::filesystem::exists("/sys/module/nv_peer_mem", ec);
}

}  // namespace

ibv_mr* RegisterCudaMemory(ibv_pd* pd, void* data, size_t bytes, int access, std::string* how) {
  const CudaDriver& cuda = Driver();
  if (!cuda.loaded) {
    Throw(ErrorCode::kUnavailable, "cannot register {} bytes of CUDA memory for RDMA: {}", bytes,
          cuda.error);
  }
  const auto ptr = reinterpret_cast<CUdeviceptr>(data);
  unsigned int type = 0;
  if (cuda.pointer_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) != CUDA_SUCCESS ||
      type != CU_MEMORYTYPE_DEVICE) {
    Throw(ErrorCode::kInvalidArgument, "{} is not CUDA device memory (cuPointerGetAttribute)", data);
  }
  std::string dmabuf_error = "cuMemGetHandleForAddressRange is not in this driver (CUDA < 11.7)";
  if (cuda.range_handle) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (cuda.address_range(&base, &size, ptr) != CUDA_SUCCESS) {
      dmabuf_error = "cuMemGetAddressRange failed";
    } else {
      // The dma-buf covers the whole allocation, page aligned; the MR is the slice asked for.
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      const CUdeviceptr aligned = base & ~static_cast<CUdeviceptr>(page - 1);
      const size_t length = (base + size - aligned + page - 1) / page * page;
      int fd = -1;
      const CUresult r = cuda.range_handle(&fd, aligned, length,
                                           CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
      if (r != CUDA_SUCCESS) {
        dmabuf_error = fmt::format("cuMemGetHandleForAddressRange failed with CUDA error {} (needs "
                                   "the open GPU kernel module and Linux >= 5.12)",
                                   static_cast<int>(r));
      } else {
        ibv_mr* mr = ibv_reg_dmabuf_mr(pd, ptr - aligned, bytes, ptr, fd, access);
        const int err = errno;
        close(fd);
        if (mr) {
          *how = "dma-buf";
          return mr;
        }
        dmabuf_error = fmt::format("ibv_reg_dmabuf_mr failed: {}", std::strerror(err));
      }
    }
  }
  ibv_mr* mr = ibv_reg_mr(pd, data, bytes, access);
  if (mr) {
    *how = "peer memory (nvidia_peermem)";
    return mr;
  }
  const int err = errno;
  Throw(ErrorCode::kUnavailable,
        "cannot register {} bytes of CUDA memory at {} for RDMA: dma-buf: {}; peer memory: "
        "ibv_reg_mr failed: {} (nvidia_peermem is {})",
        bytes, data, dmabuf_error, std::strerror(err), PeerMemLoaded() ? "loaded" : "not loaded");
}

bool GpuDirectUsable(std::string* why) {
  const CudaDriver& cuda = Driver();
  if (!cuda.loaded) {
    *why = cuda.error;
    return false;
  }
  int count = 0;
  if (!cuda.device_count || cuda.device_count(&count) != CUDA_SUCCESS || count == 0) {
    *why = "the CUDA driver reports no GPU";
    return false;
  }
  return true;
}

std::string GpuDirectStatus() {
  std::string s = "built (CUDA " PIPESGD_CUDA_VERSION
                  " headers; dma-buf via ibv_reg_dmabuf_mr, falling back to nvidia_peermem); ";
  const CudaDriver& cuda = Driver();
  if (!cuda.loaded) return s + "not usable here: " + cuda.error;
  int version = 0, count = 0;
  if (cuda.driver_version) cuda.driver_version(&version);
  if (cuda.device_count) cuda.device_count(&count);
  return s + fmt::format("CUDA driver {}.{}, {} GPU(s), dma-buf export {}, nvidia_peermem {}",
                         version / 1000, version % 1000 / 10, count,
                         cuda.range_handle ? "available" : "missing",
                         PeerMemLoaded() ? "loaded" : "not loaded");
}

#else  // !PIPESGD_HAVE_CUDA

ibv_mr* RegisterCudaMemory(ibv_pd*, void* data, size_t bytes, int, std::string*) {
  Throw(ErrorCode::kInvalidArgument,
        "cannot register {} bytes of CUDA memory at {}: this pipesgd was built without CUDA "
        "(the CUDA toolkit was not found at build time), so it has no GPUDirect RDMA",
        bytes, data);
}

bool GpuDirectUsable(std::string* why) {
  *why = "this pipesgd was built without CUDA (the CUDA toolkit was not found at build time)";
  return false;
}

std::string GpuDirectStatus() {
  return "not built (the CUDA toolkit was not found at build time)";
}

#endif

}  // namespace pipesgd::transport::ibverbs
