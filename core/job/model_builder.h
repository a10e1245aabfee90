// The model of a job config as layers::Layer objects, shared by the worker and the training
// benchmark (bench/train_throughput.cc).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "configs/pipesgd.pb.h"
#include "core/base/cpu_quota.h"
#include "layers/device_model.h"
#include "layers/layer.h"

namespace pipesgd::job {

// model.input_channels x input_height x input_width.
layers::Shape InputShape(const config::Model& spec);

// model.kernels for the CPU layers, with AUTO resolved for this build.
layers::CpuKernels CpuKernels(const config::Model& spec);
#ifdef PIPESGD_HAVE_CUDA_BACKEND
// model.kernels for the CUDA layers, with AUTO resolved for this build and machine.
layers::GpuKernels GpuKernels(const config::Model& spec);
#endif

// Whether the model has conv2d or max_pool2d layers (what model.kernels applies to).
bool HasSpatialLayers(const config::Model& spec);
// The library that computes the model's convolutions here, model.kernels resolved: "onednn",
// "openblas", "cudnn", "cublas", or "none" for a model without conv2d or max_pool2d; written to
// summary.json and the training benchmark's output.
std::string KernelsInUse(const config::Model& spec);

// A library's thread pool in this process, as the log names it.
struct ThreadPool {
  const char* what;      // "oneDNN's convolutions"
  const char* kind;      // "OpenMP threads"
  const char* env_name;  // the variable that sets the count: "OMP_NUM_THREADS"
  const char* env;       // its value, null where unset
  int threads;           // the count the library reports; 0 where it cannot say
};

// The count a rank's library should run instead of its own, or nullopt: where the variable
// gives no count (unset, empty, 0 or text, which the libraries ignore; a count is the user's
// choice) and the library's count exceeds the CPU quota, the quota rounded up. OpenMP and
// OpenBLAS size their pools by the CPUs the process may run on, which a quota (a container's
// CPU limit, cgroup v1 cfs or v2 cpu.max) does not shrink: the lab's 0.5-CPU nodes ran the CNN
// 2.7x slower per step with 2 oneDNN threads than with 1. `pipesgd run` sets both variables to
// 1 (torchrun sets OMP_NUM_THREADS).
std::optional<int> ThreadsForQuota(const ThreadPool& pool, const std::optional<CpuQuota>& quota);
// The log line for that change.
std::string ThreadsForQuotaMessage(const ThreadPool& pool, int threads, const CpuQuota& quota);

// oneDNN's and OpenBLAS's pools in this process, with the variable that sets each (OpenBLAS's:
// the first of OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS, OMP_NUM_THREADS that gives a count).
ThreadPool OneDnnThreadPool();
ThreadPool BlasThreadPool();
// For `pipesgd info`: a process's CPU quota and the thread counts a worker started there would
// run (FitThreadsToCpuQuota's), or that there is no quota.
std::string ThreadFittingDescription(const std::optional<CpuQuota>& quota,
                                     const ThreadPool& onednn, const ThreadPool& blas);

// Where OMP_NUM_THREADS (for OpenBLAS: OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS, OMP_NUM_THREADS)
// gives no count and oneDNN's (OpenBLAS's) threads exceed this process's CPU quota, runs
// ThreadsForQuota's count instead, and logs it once per process. OpenMP keeps its count per
// thread: BuildLayers calls this on its own thread, and a thread that runs the model's oneDNN
// primitives besides must call it too.
void FitThreadsToCpuQuota(const config::Model& spec);

// The config's layers as the layers describe them, in order.
std::vector<layers::LayerSpec> LayerSpecs(const config::Model& spec);

// The layers of the config in order, each built for the shape its predecessor outputs (no
// activation memory yet; layers::Model allocates that). The config loader has checked that the
// shapes chain; the layer factories check again and throw Error(kInvalidArgument).
std::vector<std::unique_ptr<layers::Layer>> BuildLayers(const config::Model& spec);

#ifdef PIPESGD_HAVE_CUDA_BACKEND
// The same stack as BuildLayers on `gpu`, for model.device = CUDA: the same shapes and the same
// parameter layout, activations for max_batch samples.
std::unique_ptr<layers::DeviceModel> BuildGpuModel(layers::Gpu& gpu, const config::Model& spec,
                                                   size_t max_batch);
#endif

}  // namespace pipesgd::job
