#include "core/job/model_builder.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/base/log.h"
#include "layers/model.h"

namespace pipesgd::job {

layers::Shape InputShape(const config::Model& spec) {
  return {static_cast<size_t>(spec.input_channels()), static_cast<size_t>(spec.input_height()),
          static_cast<size_t>(spec.input_width())};
}

layers::CpuKernels CpuKernels(const config::Model& spec) {
  switch (spec.kernels()) {
    case config::Model::ONEDNN:
      return layers::CpuKernels::kOneDnn;
    case config::Model::OPENBLAS:
      return layers::CpuKernels::kOpenBlas;
    default:  // AUTO; the config loader rejects the GPU names with device CPU
      return layers::DefaultCpuKernels();
  }
}

#ifdef PIPESGD_HAVE_CUDA_BACKEND
layers::GpuKernels GpuKernels(const config::Model& spec) {
  switch (spec.kernels()) {
    case config::Model::CUDNN:
      return layers::GpuKernels::kCudnn;
    case config::Model::CUBLAS:
      return layers::GpuKernels::kCublas;
    default:  // AUTO; the config loader rejects the CPU names with device CUDA
      return layers::DefaultGpuKernels();
  }
}
#endif

bool HasSpatialLayers(const config::Model& spec) {
  return std::any_of(spec.layers().begin(), spec.layers().end(), [](const config::Layer& l) {
    return l.has_conv2d() || l.has_max_pool2d();
  });
}

std::string KernelsInUse(const config::Model& spec) {
  if (!HasSpatialLayers(spec)) return "none";
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  if (spec.device() == config::Model::CUDA) return layers::ToString(GpuKernels(spec));
#endif
  return layers::ToString(CpuKernels(spec));
}

namespace {

// Once per process: the pipeline mode builds its layers more than once.
std::once_flag cpu_kernels_logged;

}  // namespace

namespace {

// Whether the libraries take the variable's value as a count: a positive integer first (OpenMP
// also takes a list, "4,2"). Empty, 0 or text, they fall back to their own count.
bool IsThreadCount(const char* value) {
  if (value == nullptr) return false;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  return end != value && n > 0;
}

}  // namespace

std::optional<int> ThreadsForQuota(const ThreadPool& pool, const std::optional<CpuQuota>& quota) {
  // A quota is > 0 CPU, so one thread (or an unknown count, 0) always fits.
  if (IsThreadCount(pool.env) || !quota) return std::nullopt;
  const double fit = std::ceil(quota->cpus);
  if (static_cast<double>(pool.threads) <= fit) return std::nullopt;
  return static_cast<int>(fit);
}

namespace {
// "0.50": two decimals, more where that would read 0 (a quota of 1 ms per second: "0.001").
std::string Cpus(double cpus) {
  return cpus >= 0.005 ? fmt::format("{:.2f}", cpus) : fmt::format("{:.2g}", cpus);
}
}  // namespace

std::string ThreadsForQuotaMessage(const ThreadPool& pool, int threads, const CpuQuota& quota) {
  return fmt::format(
      "{} and {} would run {} {} in this process, over its CPU quota of {} CPU ({}), where "
      "they wait for each other's time slices: they run {} (set {} to choose; `pipesgd run` "
      "sets 1 where it is unset)",
      pool.env == nullptr ? fmt::format("{} is unset", pool.env_name)
                          : fmt::format("{}='{}' is not a thread count", pool.env_name, pool.env),
      pool.what, pool.threads, pool.kind, Cpus(quota.cpus), quota.file, threads, pool.env_name);
}

namespace {

// Once per process, as the kernels' line.
std::once_flag onednn_threads_logged, blas_threads_fitted;

// The quota does not change while the process runs; read once.
const std::optional<CpuQuota>& Quota() {
  static const std::optional<CpuQuota> quota = ProcessCpuQuota();
  return quota;
}

}  // namespace

ThreadPool OneDnnThreadPool() {
  return {"oneDNN's convolutions", "OpenMP threads", "OMP_NUM_THREADS",
          std::getenv("OMP_NUM_THREADS"), layers::OneDnnThreads()};
}

ThreadPool BlasThreadPool() {
  // OpenBLAS reads the first of these that gives a count: that one is the user's choice.
  const char* env = std::getenv("OPENBLAS_NUM_THREADS");
  for (const char* name : {"GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* value = std::getenv(name); !IsThreadCount(env) && IsThreadCount(value)) {
      env = value;
    }
  }
  return {"OpenBLAS's matrix products", "threads", "OPENBLAS_NUM_THREADS", env,
          layers::BlasThreads()};
}

std::string ThreadFittingDescription(const std::optional<CpuQuota>& quota,
                                     const ThreadPool& onednn, const ThreadPool& blas) {
  if (!quota) return "no CPU quota on this process: the libraries' own thread counts hold";
  const auto line = [&](const ThreadPool& pool) {
    if (pool.threads == 0) return fmt::format("{}: {} not known", pool.what, pool.kind);
    if (const auto threads = ThreadsForQuota(pool, quota)) {
      return fmt::format("{}: {} {}, fitted ({}; the library counts {})", pool.what, pool.kind,
                         *threads,
                         pool.env == nullptr ? fmt::format("{} is unset", pool.env_name)
                                             : fmt::format("{}='{}' is no count", pool.env_name,
                                                           pool.env),
                         pool.threads);
    }
    return fmt::format("{}: {} {} ({})", pool.what, pool.kind, pool.threads,
                       IsThreadCount(pool.env) ? fmt::format("{}={}", pool.env_name, pool.env)
                                               : std::string("within the quota"));
  };
  return fmt::format("CPU quota {} CPU ({}); a worker started here runs {}; {}", Cpus(quota->cpus),
                     quota->file, line(onednn), line(blas));
}

void FitThreadsToCpuQuota(const config::Model& spec) {
  if (spec.device() != config::Model::CPU) return;
  if (HasSpatialLayers(spec) && CpuKernels(spec) == layers::CpuKernels::kOneDnn) {
    const ThreadPool pool = OneDnnThreadPool();
    if (const auto threads = ThreadsForQuota(pool, Quota());
        threads && layers::SetOneDnnThreads(*threads)) {
      std::call_once(onednn_threads_logged, [&] {
        PSGD_LOG_INFO("{}", ThreadsForQuotaMessage(pool, *threads, *Quota()));
      });
    }
  }
  std::call_once(blas_threads_fitted, [] {
    const ThreadPool pool = BlasThreadPool();
    if (const auto threads = ThreadsForQuota(pool, Quota());
        threads && layers::SetBlasThreads(*threads)) {
      PSGD_LOG_INFO("{}", ThreadsForQuotaMessage(pool, *threads, *Quota()));
    }
  });
}

std::vector<layers::LayerSpec> LayerSpecs(const config::Model& spec) {
  using Kind = layers::LayerSpec::Kind;
  // The config loader has checked every size is positive.
  const auto Size = [](int64_t v) { return static_cast<size_t>(v); };
  std::vector<layers::LayerSpec> specs;
  for (const auto& layer : spec.layers()) {
    layers::LayerSpec l;
    if (layer.has_linear()) {
      l = {.kind = Kind::kLinear, .out_features = Size(layer.linear().out_features())};
    } else if (layer.has_relu()) {
      l = {.kind = Kind::kRelu};
    } else if (layer.has_conv2d()) {
      const auto& c = layer.conv2d();
      l = {.kind = Kind::kConv2d, .out_channels = Size(c.out_channels()),
           .kernel = Size(c.kernel_size()), .stride = Size(c.stride()), .padding = Size(c.padding())};
    } else if (layer.has_max_pool2d()) {
      const auto& m = layer.max_pool2d();
      l = {.kind = Kind::kMaxPool2d, .kernel = Size(m.kernel_size()),
           .stride = Size(m.stride() == 0 ? m.kernel_size() : m.stride())};
    } else if (layer.has_dropout()) {
      l = {.kind = Kind::kDropout, .p = layer.dropout().p()};
    } else if (layer.has_flatten()) {
      l = {.kind = Kind::kFlatten};
    } else {
      continue;  // no kind: the config loader rejects it
    }
    specs.push_back(l);
  }
  return specs;
}

std::vector<std::unique_ptr<layers::Layer>> BuildLayers(const config::Model& spec) {
  const layers::CpuKernels kernels = CpuKernels(spec);
  std::vector<std::unique_ptr<layers::Layer>> stack;
  layers::Shape shape = InputShape(spec);
  for (const layers::LayerSpec& layer : LayerSpecs(spec)) {
    stack.push_back(layers::MakeLayer(layer, shape, kernels));
    shape = stack.back()->out_shape();
  }
  // Before the kernels' line, so that it shows the threads the layers will run.
  FitThreadsToCpuQuota(spec);
  if (HasSpatialLayers(spec) && spec.device() == config::Model::CPU) {
    std::call_once(cpu_kernels_logged, [&] {
      PSGD_LOG_INFO("model.kernels = {}: convolutions and pooling on {}",
                    config::Model::Kernels_Name(spec.kernels()),
                    kernels == layers::DefaultCpuKernels() ? layers::CpuKernelsDescription()
                                                           : layers::ToString(kernels));
    });
  }
  return stack;
}

#ifdef PIPESGD_HAVE_CUDA_BACKEND
std::unique_ptr<layers::DeviceModel> BuildGpuModel(layers::Gpu& gpu, const config::Model& spec,
                                                   size_t max_batch) {
  const layers::GpuKernels kernels = GpuKernels(spec);
  if (HasSpatialLayers(spec)) {
    std::string why_not;
    const bool cudnn = layers::CudnnUsable(&why_not);
    PSGD_LOG_INFO("model.kernels = {}: GPU convolutions on {}{}",
                  config::Model::Kernels_Name(spec.kernels()), layers::ToString(kernels),
                  kernels == layers::GpuKernels::kCublas && !cudnn ? " (no cuDNN: " + why_not + ")"
                                                                   : "");
  }
  const std::vector<layers::LayerSpec> specs = LayerSpecs(spec);
  return gpu.MakeModel(specs, InputShape(spec), max_batch, kernels);
}
#endif

}  // namespace pipesgd::job
