#include "launcher/info.h"

#include <cstdlib>

#include <fmt/format.h>

#include "core/base/cpu_quota.h"
#include "core/base/error.h"
#include "core/job/model_builder.h"
#include "layers/layer.h"
#include "layers/model.h"
#ifdef PIPESGD_HAVE_CUDA_BACKEND
#include "layers/cuda/cuda_model.h"
#include "layers/cuda/device.h"
#endif
#include "transport/factory.h"
#include "transport/ifname.h"

namespace pipesgd::launcher {

std::string InfoReport() {
  std::string out = "pipesgd " PIPESGD_VERSION "\n";
  out += "transports:\n";
  for (const std::string& line : transport::DescribeTransportSupport()) out += "  " + line + "\n";
  const transport::AutoChoice choice = transport::ChooseAutoTransport();
  out += fmt::format("comm.transport = AUTO picks: {} ({})\n",
                     transport::TransportKindName(choice.kind), choice.reason);
  try {
    std::string list;
    for (const auto& i : transport::ListNetInterfaces()) {
      list += fmt::format("{}{} {}/{}", list.empty() ? "" : ", ", i.name, i.ip, i.prefix_len);
    }
    out += fmt::format("network interfaces (up, IPv4 then IPv6): {}\n", list.empty() ? "none" : list);
  } catch (const Error& e) {
    out += fmt::format("network interfaces: {}\n", e.what());
  }
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  // The GPU backend is compiled in; whether it can run depends on this machine's devices.
  out += fmt::format(
      "CUDA: backend built (model.device = CUDA: cuBLAS + CUDA kernels, device gradient slots); "
      "{}\n",
      cuda::CudaDescription());
  out += fmt::format("GPU convolutions (model.kernels = AUTO): {}\n",
                     cuda::GpuKernelsDescription());
#else
  out += "CUDA: backend not built (no CUDA toolkit at build time, or -DPIPESGD_CUDA=OFF); "
         "model.device = CPU only\n";
#endif
  out += fmt::format("BLAS: {}\n", layers::BlasDescription());
  out += fmt::format("CPU convolutions and pooling (model.kernels = AUTO): {}{}\n",
                     layers::CpuKernelsDescription(),
                     layers::HaveOneDnn() && std::getenv("OMP_NUM_THREADS") == nullptr
                         ? "; threads of this process: `pipesgd run` gives each rank 1 "
                           "unless OMP_NUM_THREADS is set"
                         : "");
  out += fmt::format("threads: {}\n",
                     job::ThreadFittingDescription(ProcessCpuQuota(), job::OneDnnThreadPool(),
                                                   job::BlasThreadPool()));
  return out;
}

}  // namespace pipesgd::launcher
