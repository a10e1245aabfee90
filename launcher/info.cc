#include "launcher/info.h"

#include <fmt/format.h>

#include "core/base/error.h"
#include "layers/model.h"
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
    out += fmt::format("network interfaces (IPv4, up): {}\n", list.empty() ? "none" : list);
  } catch (const Error& e) {
    out += fmt::format("network interfaces: {}\n", e.what());
  }
#ifdef PIPESGD_HAVE_CUDA
  out += "CUDA: toolkit " PIPESGD_CUDA_VERSION " at build time (used for GPUDirect RDMA "
         "registration only); the layers are CPU-only, no GPU compute\n";
#else
  out += "CUDA: not built (no CUDA toolkit at build time); the layers are CPU-only\n";
#endif
  out += fmt::format("BLAS: {}\n", layers::BlasDescription());
  return out;
}

}  // namespace pipesgd::launcher
