#include "layers/onednn.h"

#include <dlfcn.h>

#include <fmt/format.h>

namespace pipesgd::layers::onednn {

int Threads() {
  if (DNNL_CPU_RUNTIME != DNNL_RUNTIME_OMP) return 0;
  // The Debian build runs on OpenMP: its threads are those of the OpenMP runtime libdnnl
  // brought in (libgomp). Asked of that runtime rather than compiled against omp.h, which
  // would tie this library to the compiler's OpenMP (clang's is another one).
  using MaxThreads = int (*)();
  const auto max_threads =
      reinterpret_cast<MaxThreads>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  return max_threads != nullptr ? max_threads() : 0;
}

bool SetThreads(int threads) {
  if (DNNL_CPU_RUNTIME != DNNL_RUNTIME_OMP || threads < 1) return false;
  using SetNumThreads = void (*)(int);
  const auto set_threads =
      reinterpret_cast<SetNumThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set_threads == nullptr) return false;
  set_threads(threads);
  return true;
}

std::string Description() {
  const dnnl_version_t* v = dnnl_version();
  if (DNNL_CPU_RUNTIME != DNNL_RUNTIME_OMP) {
    return fmt::format("oneDNN {}.{}.{}, a CPU runtime other than OpenMP", v->major, v->minor,
                       v->patch);
  }
  const int threads = Threads();
  return fmt::format("oneDNN {}.{}.{}, OpenMP, {} thread(s)", v->major, v->minor, v->patch,
                     threads > 0 ? fmt::to_string(threads) : "?");
}

const dnnl::engine& Engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

Layout::Layout(const dnnl::memory::desc& plain, const dnnl::memory::desc& kernel)
    : plain_(plain), kernel_(kernel) {
  if (plain_ != kernel_) {
    to_kernel_.emplace(dnnl::reorder::primitive_desc(Engine(), plain_, Engine(), kernel_));
    to_plain_.emplace(dnnl::reorder::primitive_desc(Engine(), kernel_, Engine(), plain_));
  }
}

dnnl::memory Layout::Read(dnnl::stream& stream, const void* plain, void* scratch) const {
  // oneDNN takes handles as void*; a source it only reads.
  dnnl::memory source(plain_, Engine(), const_cast<void*>(plain));
  if (!converts()) return source;
  dnnl::memory copy(kernel_, Engine(), scratch);
  to_kernel_->execute(stream, source, copy);
  return copy;
}

dnnl::memory Layout::Output(void* plain, void* scratch) const {
  return converts() ? dnnl::memory(kernel_, Engine(), scratch)
                    : dnnl::memory(plain_, Engine(), plain);
}

void Layout::Store(dnnl::stream& stream, const dnnl::memory& output, void* plain) const {
  if (!converts()) return;
  dnnl::memory source = output;  // a handle; execute takes non-const ones
  dnnl::memory target(plain_, Engine(), plain);
  to_plain_->execute(stream, source, target);
}

}  // namespace pipesgd::layers::onednn
