// What the oneDNN layers share: one CPU engine for the process, and the step between the layers'
// plain row-major buffers (NCHW activations, OIHW weights) and the blocked layouts oneDNN's fast
// kernels choose. Internal to layers/; built only where oneDNN was found (PIPESGD_HAVE_ONEDNN).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include <oneapi/dnnl/dnnl.hpp>

namespace pipesgd::layers::onednn {

// "oneDNN 2.6.3, OpenMP, 2 thread(s)": the library's version, its CPU runtime and the
// threads a primitive run from this thread would use.
std::string Description();
// Those threads (omp_get_max_threads); 0 where the runtime is not OpenMP or cannot be asked.
int Threads();
// Sets them for primitives run from the calling thread (omp_set_num_threads: OpenMP keeps the
// count per thread); false where the runtime is not OpenMP or cannot be asked.
bool SetThreads(int threads);

// The process's CPU engine, created on first use (an engine may be shared by threads).
const dnnl::engine& Engine();

// oneDNN's kernels run fastest on buffers that start on a cache line; every buffer carved out
// of a layer's workspace starts on one.
constexpr size_t AlignUp(size_t n) { return (n + 63) / 64 * 64; }

// A layer's plans (its primitives and their layouts) by batch size, each made on first use:
// making one costs milliseconds, running it microseconds. Safe to use from several threads.
template <typename Plan>
class PlanCache {
 public:
  template <typename Make>
  const Plan& Get(size_t batch, Make make) const {
    std::lock_guard lock(mu_);
    auto it = plans_.find(batch);
    if (it == plans_.end()) it = plans_.emplace(batch, make(batch)).first;
    return *it->second;
  }

 private:
  mutable std::mutex mu_;
  mutable std::map<size_t, std::unique_ptr<Plan>> plans_;
};

// A layer's workspace may start anywhere; its buffers start at the first cache line in it. A
// layer asks for kAlignSlack bytes more than it uses.
constexpr size_t kAlignSlack = 63;
inline std::byte* Aligned(std::span<std::byte> workspace) {
  const auto address = reinterpret_cast<uintptr_t>(workspace.data());
  return workspace.data() + (AlignUp(address) - address);
}

// One tensor that a primitive reads or writes in the layout it chose (`kernel`) while the
// layer's caller holds it in the plain one (`plain`). Where the two are equal nothing is copied;
// otherwise the copy goes through scratch_bytes() of workspace.
class Layout {
 public:
  Layout() = default;
  Layout(const dnnl::memory::desc& plain, const dnnl::memory::desc& kernel);

  const dnnl::memory::desc& kernel() const { return kernel_; }
  bool converts() const { return to_kernel_.has_value(); }
  size_t scratch_bytes() const { return converts() ? AlignUp(kernel_.get_size()) : 0; }

  // An input: memory in the kernel's layout holding the data at `plain` (a reorder into
  // `scratch` where the layouts differ).
  dnnl::memory Read(dnnl::stream& stream, const void* plain, void* scratch) const;
  // An output: the memory the primitive writes (`plain` itself, or `scratch`), then Store puts
  // it into `plain`.
  dnnl::memory Output(void* plain, void* scratch) const;
  void Store(dnnl::stream& stream, const dnnl::memory& output, void* plain) const;

 private:
  dnnl::memory::desc plain_, kernel_;
  std::optional<dnnl::reorder> to_kernel_, to_plain_;
};

}  // namespace pipesgd::layers::onednn
