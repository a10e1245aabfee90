// Training throughput of one worker: samples per second of the training step (forward,
// backward and the SGD update) of the model of a job config, with no data loading and no network,
// so that it compares like for like with bench/torch_train_throughput.py.
//
//   pipesgd_train_bench configs/fashion_mnist_cnn.pbtxt --batch 64 --steps 200 --repeats 3
//   pipesgd_train_bench configs/fashion_mnist_cnn.pbtxt --batch 64 --device cuda --gpu 0
//
// --device sets model.device; with --device cuda, --set model.kernels=CUBLAS picks the GPU
// convolutions on im2col + cuBLAS (AUTO: cuDNN where it loads).
// CPU threads: OpenBLAS's (OPENBLAS_NUM_THREADS) for the linear layers and the openblas
// convolutions, OpenMP's (OMP_NUM_THREADS) for the oneDNN ones (model.kernels).
// On the GPU (builds with the CUDA backend) the inputs are uploaded once; each step waits for its
// loss as the trainer does, and the timer stops after the stream is drained.
// Prints one JSON object per line: model, batch, threads, steps, and samples/s of each repeat
// and their median.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>

#include "core/base/error.h"
#include "core/job/config.h"
#include "core/job/model_builder.h"
#include "layers/model.h"
#include "core/base/rng.h"
#include "layers/sgd.h"
#ifdef PIPESGD_HAVE_CUDA_BACKEND
#include "core/base/cuda/device.h"
#include "layers/device_model.h"
#endif

int main(int argc, char** argv) {
  using namespace pipesgd;
  CLI::App app{"training-step throughput of a job config's model on one worker"};
  std::string config_path;
  size_t batch = 64;
  int steps = 200, warmup = 20, repeats = 3;
  std::vector<std::string> sets;
  app.add_option("config", config_path, "job config (.pbtxt)")->required();
  app.add_option("--batch", batch, "samples per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps per repeat")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--repeats", repeats, "timed repeats (the median is reported)")
      ->check(CLI::PositiveNumber);
  app.add_option("--set", sets, "config override PATH=VALUE (repeatable)");
  std::string device_name = "cpu";
  int gpu = 0;
  app.add_option("--device", device_name, "cpu, or cuda (builds with the CUDA backend)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--gpu", gpu, "GPU index for --device cuda")->check(CLI::NonNegativeNumber);
  bool print_job = false;
  app.add_flag("--print-job", print_job,
               "print the effective job (defaults filled) as JSON and exit, for the PyTorch "
               "side to build the same model");
  CLI11_PARSE(app, argc, argv);

  // stdout is the JSON lines; the model builder's info lines would break them (the kernels
  // they name are in the JSON).
  spdlog::set_level(spdlog::level::warn);
  // --device is model.device (applied last, so the config check sees the device that runs).
  sets.push_back(device_name == "cuda" ? "model.device=CUDA" : "model.device=CPU");
  try {
    const config::Job job = job::LoadJobConfig(config_path, sets);
    if (print_job) {
      std::string text;
      google::protobuf::util::JsonPrintOptions options;
      options.always_print_primitive_fields = true;
      options.preserve_proto_field_names = true;
      (void)google::protobuf::util::MessageToJsonString(job, &text, options);
      std::printf("%s\n", text.c_str());
      return 0;
    }
    layers::Model model(job::BuildLayers(job.model()), batch);
    const auto& train = job.train();
    std::vector<float> params(model.num_params()), grads(model.num_params());
    model.Init(params, train.seed());
    const layers::SgdOptions sgd_options{train.learning_rate(), train.momentum(),
                                         train.weight_decay()};
    layers::Sgd sgd(sgd_options, params.size());
    // Standardised-looking inputs and uniform labels; the step's cost does not depend on them.
    pipesgd::Rng rng(7);
    std::vector<float> x(batch * model.in_features());
    for (float& v : x) v = rng.Uniform(-1.0f, 2.0f);
    std::vector<uint8_t> labels(batch);
    for (auto& l : labels) l = static_cast<uint8_t>(rng.Below(model.num_classes()));

    std::function<void(const layers::BatchKey&)> train_step = [&](const layers::BatchKey& key) {
      model.ForwardBackward(params, x.data(), labels.data(), batch, grads, key);
      sgd.Step(params, grads);
    };
    std::function<void()> drain = [] {};
    std::string where = layers::BlasDescription();
    const std::string kernels = job::KernelsInUse(job.model());
#ifdef PIPESGD_HAVE_CUDA_BACKEND
    std::unique_ptr<layers::Gpu> gpu_device;
    std::unique_ptr<layers::DeviceModel> gpu_model;
    std::unique_ptr<layers::DeviceSgd> gpu_sgd;
    cuda::DeviceBuffer<float> d_params, d_grads, d_x;
    cuda::DeviceBuffer<uint8_t> d_labels;
    if (device_name == "cuda") {
      gpu_device = layers::OpenGpu(gpu);
      const int device = gpu;  // for PSGD_CUDA
      gpu_model = job::BuildGpuModel(*gpu_device, job.model(), batch);
      gpu_sgd = gpu_device->MakeSgd(sgd_options, params.size());
      d_params = cuda::DeviceBuffer<float>(params.size(), gpu);
      d_grads = cuda::DeviceBuffer<float>(params.size(), gpu);
      d_x = cuda::DeviceBuffer<float>(x.size(), gpu);
      d_labels = cuda::DeviceBuffer<uint8_t>(labels.size(), gpu);
      PSGD_CUDA(cudaMemcpy(d_params.data(), params.data(), d_params.bytes(),
                           cudaMemcpyHostToDevice));
      // A copy from pageable memory may still be in flight when cudaMemcpy returns, and
      // the context's stream does not wait for the legacy default stream.
      PSGD_CUDA(cudaDeviceSynchronize());
      PSGD_CUDA(cudaMemcpy(d_x.data(), x.data(), d_x.bytes(), cudaMemcpyHostToDevice));
      PSGD_CUDA(cudaDeviceSynchronize());
      PSGD_CUDA(cudaMemcpy(d_labels.data(), labels.data(), d_labels.bytes(),
                           cudaMemcpyHostToDevice));
      PSGD_CUDA(cudaDeviceSynchronize());
      train_step = [&](const layers::BatchKey& key) {
        gpu_model->ForwardBackward(d_params.data(), d_x.data(), d_labels.data(), batch,
                                   d_grads.data(), key);
        gpu_sgd->Step(d_params.data(), d_grads.data(), d_params.size());
      };
      drain = [&] { gpu_device->context().Synchronize("the benchmark's last step"); };
      where = gpu_device->context().description();
    }
#else
    if (device_name == "cuda") {
      Throw(ErrorCode::kUnavailable,
            "--device cuda: this build has no CUDA backend (configure with -DPIPESGD_CUDA=ON)");
    }
#endif

    int64_t step = 0;
    auto run = [&](int n) {
      for (int i = 0; i < n; i++, step++) {
        const layers::BatchKey key{.seed = train.seed(), .step = static_cast<uint64_t>(step),
                                   .first_row = 0};
        train_step(key);
      }
      drain();
    };
    run(warmup);
    std::vector<double> rates;
    for (int r = 0; r < repeats; r++) {
      const auto start = std::chrono::steady_clock::now();
      run(steps);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rates.push_back(static_cast<double>(steps) * static_cast<double>(batch) / s);
    }
    std::vector<double> sorted = rates;
    std::sort(sorted.begin(), sorted.end());
    std::printf("%s\n",
                fmt::format("{{\"impl\": \"pipesgd\", \"config\": \"{}\", \"model\": \"{}\", "
                            "\"params\": {}, \"batch\": {}, \"device\": \"{}\", \"blas\": \"{}\", "
                            "\"kernels\": \"{}\", \"steps\": {}, "
                            "\"samples_per_s\": [{:.1f}], \"median_samples_per_s\": {:.1f}}}",
                            config_path, model.Describe(), model.num_params(), batch, device_name,
                            where, kernels, steps, fmt::join(rates, ", "),
                            sorted[sorted.size() / 2])
                    .c_str());
  } catch (const Error& e) {
    std::fprintf(stderr, "pipesgd_train_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
