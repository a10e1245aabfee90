// Training throughput of one worker on the CPU: samples per second of the training step
// (forward, backward and the SGD update) of the model of a job config, with no data loading and
// no network, so that it compares like for like with bench/torch_train_throughput.py.
//
//   pipesgd_train_bench configs/fashion_mnist_cnn.pbtxt --batch 64 --steps 200 --repeats 3
//
// Threads: OpenBLAS's (OPENBLAS_NUM_THREADS); the layers themselves are single-threaded.
// Prints one JSON object per line: model, batch, threads, steps, and samples/s of each repeat
// and their median.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <google/protobuf/util/json_util.h>

#include "core/base/error.h"
#include "launcher/config.h"
#include "launcher/model_builder.h"
#include "layers/model.h"
#include "layers/rng.h"
#include "layers/sgd.h"

int main(int argc, char** argv) {
  using namespace pipesgd;
  CLI::App app{"training-step throughput of a job config's model on one CPU worker"};
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
  bool print_job = false;
  app.add_flag("--print-job", print_job,
               "print the effective job (defaults filled) as JSON and exit, for the PyTorch "
               "side to build the same model");
  CLI11_PARSE(app, argc, argv);

  try {
    const config::Job job = launcher::LoadJobConfig(config_path, sets);
    if (print_job) {
      std::string text;
      google::protobuf::util::JsonPrintOptions options;
      options.always_print_primitive_fields = true;
      options.preserve_proto_field_names = true;
      (void)google::protobuf::util::MessageToJsonString(job, &text, options);
      std::printf("%s\n", text.c_str());
      return 0;
    }
    layers::Model model(launcher::BuildLayers(job.model()), batch);
    const auto& train = job.train();
    std::vector<float> params(model.num_params()), grads(model.num_params());
    model.Init(params, train.seed());
    layers::Sgd sgd({train.learning_rate(), train.momentum(), train.weight_decay()},
                    params.size());
    // Standardised-looking inputs and uniform labels; the step's cost does not depend on them.
    layers::Rng rng(7);
    std::vector<float> x(batch * model.in_features());
    for (float& v : x) v = rng.Uniform(-1.0f, 2.0f);
    std::vector<uint8_t> labels(batch);
    for (auto& l : labels) l = static_cast<uint8_t>(rng.Below(model.num_classes()));

    int64_t step = 0;
    auto run = [&](int n) {
      for (int i = 0; i < n; i++, step++) {
        const layers::BatchKey key{.seed = train.seed(), .step = static_cast<uint64_t>(step),
                                   .first_row = 0};
        model.ForwardBackward(params, x.data(), labels.data(), batch, grads, key);
        sgd.Step(params, grads);
      }
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
                            "\"params\": {}, \"batch\": {}, \"blas\": \"{}\", \"steps\": {}, "
                            "\"samples_per_s\": [{:.1f}], \"median_samples_per_s\": {:.1f}}}",
                            config_path, model.Describe(), model.num_params(), batch,
                            layers::BlasDescription(), steps, fmt::join(rates, ", "),
                            sorted[sorted.size() / 2])
                    .c_str());
  } catch (const Error& e) {
    std::fprintf(stderr, "pipesgd_train_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
