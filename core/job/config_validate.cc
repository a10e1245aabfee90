// The ranges written next to each field in configs/pipesgd.proto, and the rules across fields:
// core/job/config_detail.h. Over 600 lines because it is one table of rules and the one class
// that walks a job against it; each Check* method is one field or one rule across fields.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/reflection.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/job/config_detail.h"
#include "core/job/mode_info.h"
#include "layers/layer.h"
#include "transport/ifname.h"

namespace pipesgd::job::config_detail {
namespace {

// Whether model.kernels = CUDNN can run in this build (whether libcudnn loads is the worker's
// question, on its machine).
constexpr bool CudnnBuilt() {
#ifdef PIPESGD_HAVE_CUDNN
  return true;
#else
  return false;
#endif
}

// Whether model.device = CUDA can run in this build.
constexpr bool CudaBackendBuilt() {
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  return true;
#else
  return false;
#endif
}

struct IntRange {
  int64_t lo;
  std::optional<int64_t> hi;  // inclusive
  int64_t multiple_of = 1;
  const char* zero_means = nullptr;  // when set, 0 is also accepted and means this
};
struct RealRange {
  double lo;
  bool lo_inclusive;
  std::optional<double> hi_exclusive;  // the value must also be finite
  std::optional<double> hi_inclusive = std::nullopt;  // instead of hi_exclusive
};
struct NonEmpty {};
using Rule = std::variant<IntRange, RealRange, NonEmpty>;

template <typename M>
const FieldDescriptor* Field(int number) {
  const FieldDescriptor* field = M::descriptor()->FindFieldByNumber(number);
  PSGD_CHECK(field != nullptr);
  return field;
}

// Keyed by descriptor via the generated field numbers, so that renaming a field in the schema
// breaks this table at compile time instead of silently dropping its check.
const std::unordered_map<const FieldDescriptor*, Rule>& Rules() {
  using config::Comm;
  using config::Conv2d;
  using config::Data;
  using config::Dropout;
  using config::Linear;
  using config::MaxPool2d;
  using config::Model;
  using config::Train;
  static const std::unordered_map<const FieldDescriptor*, Rule> rules{
      {Field<Linear>(Linear::kOutFeaturesFieldNumber), IntRange{1, std::nullopt}},
      {Field<config::Model>(config::Model::kGpuIndexFieldNumber), IntRange{-1, 1023}},
      {Field<Conv2d>(Conv2d::kOutChannelsFieldNumber), IntRange{1, std::nullopt}},
      {Field<Conv2d>(Conv2d::kKernelSizeFieldNumber), IntRange{1, std::nullopt}},
      {Field<Conv2d>(Conv2d::kStrideFieldNumber), IntRange{1, std::nullopt}},
      {Field<Conv2d>(Conv2d::kPaddingFieldNumber), IntRange{0, std::nullopt}},
      {Field<MaxPool2d>(MaxPool2d::kKernelSizeFieldNumber), IntRange{1, std::nullopt}},
      {Field<MaxPool2d>(MaxPool2d::kStrideFieldNumber), IntRange{0, std::nullopt}},
      {Field<Dropout>(Dropout::kPFieldNumber), RealRange{0, true, 1.0}},
      {Field<Model>(Model::kInputChannelsFieldNumber), IntRange{1, std::nullopt}},
      {Field<Model>(Model::kInputHeightFieldNumber), IntRange{1, std::nullopt}},
      {Field<Model>(Model::kInputWidthFieldNumber), IntRange{1, std::nullopt}},
      {Field<Data>(Data::kTrainImagesFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTrainLabelsFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTestImagesFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTestLabelsFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTrainLimitFieldNumber), IntRange{0, std::nullopt}},
      {Field<Data>(Data::kTestLimitFieldNumber), IntRange{0, std::nullopt}},
      {Field<Data>(Data::kInputMeanFieldNumber), RealRange{-1000, true, 1000.0}},
      {Field<Data>(Data::kInputStdFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Train>(Train::kBatchSizeFieldNumber), IntRange{1, std::nullopt}},
      {Field<Train>(Train::kLearningRateFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Train>(Train::kMomentumFieldNumber), RealRange{0, true, 1.0}},
      {Field<Train>(Train::kWeightDecayFieldNumber), RealRange{0, true, std::nullopt}},
      {Field<Train>(Train::kEpochsFieldNumber), IntRange{1, std::nullopt}},
      {Field<Train>(Train::kPipelineWidthFieldNumber), IntRange{1, 16, 1, "auto"}},
      {Field<Train>(Train::kMaxStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Train>(Train::kProgressPerEpochFieldNumber), IntRange{0, 1000}},
      {Field<Train>(Train::kSyncWarmupStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Train>(Train::kEvalEveryStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Train>(Train::kTargetAccuracyFieldNumber), RealRange{0, true, std::nullopt, 1.0}},
      {Field<Train>(Train::kLocalStepsFieldNumber), IntRange{1, 100000}},
      {Field<Train>(Train::kOuterLearningRateFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Train>(Train::kOuterMomentumFieldNumber), RealRange{0, true, 1.0}},
      {Field<Train>(Train::kOuterOverlapFieldNumber), IntRange{0, 1}},
      {Field<Comm>(Comm::kChunkBytesFieldNumber), IntRange{1024, int64_t{1} << 30, 4, "auto"}},
      {Field<Comm>(Comm::kStartTimeoutSFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Comm>(Comm::kTimeoutSFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Comm>(Comm::kStreamsFieldNumber), IntRange{1, 16, 1, "auto"}},
      {Field<Comm>(Comm::kWarmupStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Comm>(Comm::kMinBytesFieldNumber), IntRange{0, std::nullopt}},
      {Field<Comm>(Comm::kPowersgdRankFieldNumber), IntRange{0, 64}},
      {Field<Comm>(Comm::kIbPortFieldNumber), IntRange{0, 255}},
      {Field<Comm>(Comm::kGidIndexFieldNumber), IntRange{-1, 255}},
      {Field<Comm>(Comm::kIbTimeoutFieldNumber), IntRange{1, 31}},
      {Field<Comm>(Comm::kIbRetryCountFieldNumber), IntRange{0, 7}},
      {Field<config::Checkpoint>(config::Checkpoint::kEveryStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<config::Checkpoint>(config::Checkpoint::kEveryEpochsFieldNumber), IntRange{0, std::nullopt}},
      {Field<config::Checkpoint>(config::Checkpoint::kKeepFieldNumber), IntRange{1, 1000}},
      {Field<config::Sdpipe>(config::Sdpipe::kPeriodFieldNumber), IntRange{1, 1000000}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowMinSFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowMaxSFieldNumber), RealRange{0, false, 3600.0}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowInitSFieldNumber), RealRange{0, false, 3600.0}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowGrowFieldNumber), RealRange{1, true, std::nullopt}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowShrinkFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<config::Sdpipe>(config::Sdpipe::kMinGroupFieldNumber), IntRange{1, std::nullopt}},
      {Field<config::Pipeline>(config::Pipeline::kStagesFieldNumber), IntRange{1, 64}},
      {Field<config::Pipeline>(config::Pipeline::kBoundariesFieldNumber), IntRange{1, std::nullopt}},
      {Field<config::Pipeline>(config::Pipeline::kMicroBatchesFieldNumber), IntRange{1, 1024}},
      {Field<config::Straggler>(config::Straggler::kRanksFieldNumber), IntRange{0, std::nullopt}},
      {Field<config::Straggler>(config::Straggler::kSleepSFieldNumber), RealRange{0, true, 60.0}},
      {Field<config::Straggler>(config::Straggler::kProbabilityFieldNumber), RealRange{0, true, std::nullopt}},
      // seed: any uint64; transport: the parser admits only declared enum values.
  };
  return rules;
}

std::string Describe(const IntRange& rule) {
  if (rule.multiple_of != 1) {
    return fmt::format("expected {}a multiple of {} in [{}, {}]",
                       rule.zero_means ? fmt::format("0 ({}) or ", rule.zero_means) : "",
                       rule.multiple_of, rule.lo,
                       rule.hi.value_or(std::numeric_limits<int64_t>::max()));
  }
  if (rule.hi) {
    return fmt::format("expected {}an integer in [{}, {}]",
                       rule.zero_means ? fmt::format("0 ({}) or ", rule.zero_means) : "", rule.lo,
                       *rule.hi);
  }
  return fmt::format("expected an integer >= {}", rule.lo);
}

std::string Describe(const RealRange& rule) {
  if (rule.hi_inclusive) {
    return fmt::format("expected a number in {}{}, {}]", rule.lo_inclusive ? '[' : '(', rule.lo,
                       *rule.hi_inclusive);
  }
  if (rule.hi_exclusive) {
    return fmt::format("expected a number in {}{}, {})", rule.lo_inclusive ? '[' : '(', rule.lo,
                       *rule.hi_exclusive);
  }
  return fmt::format("expected a finite number {} {}", rule.lo_inclusive ? ">=" : ">", rule.lo);
}

class Validator {
 public:
  Validator(const std::string& file, const TextFormat::ParseInfoTree* tree,
            const std::vector<AppliedOverride>& overrides, const std::set<std::string>& filled)
      : file_(file), tree_(tree), overrides_(overrides), filled_(filled) {}

  void Run(const config::Job& job) {
    std::vector<Step> steps;
    Visit(job, &steps);
    CheckPipeline(job);
    CheckCompensation(job);
    CheckPowerSgd(job);
    CheckAutoWidth(job);
    CheckOuterLoop(job);
    CheckModeSupports(job);
    if (!errors_.empty()) {
      Throw(ErrorCode::kInvalidArgument, "{}", fmt::join(errors_, "\n"));
    }
  }

 private:
  void Visit(const Message& message, std::vector<Step>* steps) {
    const Descriptor* type = message.GetDescriptor();
    if (type == config::Model::descriptor()) {
      CheckModel(static_cast<const config::Model&>(message), steps);
    } else if (type == config::Layer::descriptor()) {
      CheckLayer(static_cast<const config::Layer&>(message), steps);
    } else if (type == config::Comm::descriptor()) {
      CheckComm(static_cast<const config::Comm&>(message), steps);
    } else if (type == config::Sdpipe::descriptor()) {
      CheckSdpipe(static_cast<const config::Sdpipe&>(message), steps);
    } else if (type == config::Straggler::descriptor()) {
      const auto& st = static_cast<const config::Straggler&>(message);
      if (st.probability() > 1) {
        steps->push_back({Field<config::Straggler>(config::Straggler::kProbabilityFieldNumber), -1});
        Report(*steps, fmt::format("{} = {}: expected a probability in [0, 1]",
                                   PathString(*steps), st.probability()));
        steps->pop_back();
      }
    }

    const Reflection* reflection = message.GetReflection();
    for (int i = 0; i < type->field_count(); ++i) {
      const FieldDescriptor* field = type->field(i);
      if (field->is_repeated()) {
        for (int j = 0; j < reflection->FieldSize(message, field); ++j) {
          steps->push_back({field, j});
          if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
            Visit(reflection->GetRepeatedMessage(message, field, j), steps);
          } else {
            CheckScalar(message, field, j, *steps);
          }
          steps->pop_back();
        }
        continue;
      }
      if (field->real_containing_oneof() != nullptr && !reflection->HasField(message, field)) {
        continue;
      }
      steps->push_back({field, -1});
      if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        Visit(reflection->GetMessage(message, field), steps);
      } else {
        CheckScalar(message, field, -1, *steps);
      }
      steps->pop_back();
    }
  }

  // model.kernels: a library of the model's device that this build has.
  void CheckKernels(const config::Model& model, std::vector<Step>* steps) {
    const config::Model::Kernels k = model.kernels();
    if (k == config::Model::AUTO) return;
    const bool cpu_library = k == config::Model::ONEDNN || k == config::Model::OPENBLAS;
    const bool on_cpu = model.device() == config::Model::CPU;
    std::string problem;
    if (cpu_library != on_cpu) {
      problem = fmt::format("a {} library, but model.device is {}; expected {} or AUTO",
                            cpu_library ? "CPU" : "GPU", config::Model::Device_Name(model.device()),
                            on_cpu ? "ONEDNN, OPENBLAS" : "CUDNN, CUBLAS");
    } else if (k == config::Model::ONEDNN && !layers::HaveOneDnn()) {
      problem = "this pipesgd was built without oneDNN (no libdnnl-dev at build time, or "
                "-DPIPESGD_WITH_ONEDNN=OFF); use AUTO or OPENBLAS, or rebuild with libdnnl-dev";
    } else if (k == config::Model::CUDNN && !CudnnBuilt()) {
      problem = "this pipesgd was built without cuDNN (no cudnn.h in the CUDA toolkit at build "
                "time); use AUTO or CUBLAS";
    }
    if (problem.empty()) return;
    steps->push_back({Field<config::Model>(config::Model::kKernelsFieldNumber), -1});
    Report(*steps, fmt::format("{} = {}: {}", PathString(*steps), config::Model::Kernels_Name(k),
                               problem));
    steps->pop_back();
  }

  void CheckModel(const config::Model& model, std::vector<Step>* steps) {
    if (model.layers_size() == 0) {
      steps->push_back({Field<config::Model>(config::Model::kLayersFieldNumber), -1});
      // A repeated field has no location of its own; the model block is the nearest.
      Report(*steps, fmt::format("{} = []: expected at least one layer, the last one linear",
                                 PathString(*steps)));
      steps->pop_back();
      return;
    }
    if (model.device() == config::Model::CUDA && !CudaBackendBuilt()) {
      steps->push_back({Field<config::Model>(config::Model::kDeviceFieldNumber), -1});
      Report(*steps, fmt::format("{} = CUDA: this pipesgd was built without the CUDA backend (no "
                                 "CUDA toolkit at build time, or -DPIPESGD_CUDA=OFF); use CPU or "
                                 "rebuild with the CUDA toolkit (docs/gpu.md)",
                                 PathString(*steps)));
      steps->pop_back();
    }
    CheckKernels(model, steps);
    if (model.gpu_index() != -1 && model.device() != config::Model::CUDA) {
      steps->push_back({Field<config::Model>(config::Model::kGpuIndexFieldNumber), -1});
      Report(*steps, fmt::format("{} = {}: applies only to model.device: CUDA (device is {})",
                                 PathString(*steps), model.gpu_index(),
                                 config::Model::Device_Name(model.device())));
      steps->pop_back();
    }
    const int last = model.layers_size() - 1;
    const config::Layer& layer = model.layers(last);
    if (layer.kind_case() != config::Layer::KIND_NOT_SET && !layer.has_linear()) {
      steps->push_back({Field<config::Model>(config::Model::kLayersFieldNumber), last});
      Report(*steps, fmt::format("{} = {{ {} }}: expected the last layer to be linear (its "
                                 "out_features is the number of classes)",
                                 PathString(*steps), layer.ShortDebugString()));
      steps->pop_back();
    }
    CheckShapes(model, steps);
  }

  // Follows the activation shape (channels x height x width) through the layers, as
  // layers::Model will, and reports the first layer that cannot take its input. Stops quietly at
  // a layer whose own values are out of range (CheckScalar reports those).
  void CheckShapes(const config::Model& model, std::vector<Step>* steps) {
    struct Shape {
      int64_t c, h, w;
    };
    auto text = [](const Shape& s) { return fmt::format("{}x{}x{}", s.c, s.h, s.w); };
    // The layers' own shape arithmetic (layers/layer.h), on values this check has bounded.
    auto to_layers = [](const Shape& s) {
      return layers::Shape{static_cast<size_t>(s.c), static_cast<size_t>(s.h),
                           static_cast<size_t>(s.w)};
    };
    auto from_layers = [](const layers::Shape& s) {
      return Shape{static_cast<int64_t>(s.channels), static_cast<int64_t>(s.height),
                   static_cast<int64_t>(s.width)};
    };
    if (model.input_channels() < 1 || model.input_height() < 1 || model.input_width() < 1) return;
    Shape shape{model.input_channels(), model.input_height(), model.input_width()};
    // Per-sample activations stay within int32 (BLAS dimensions, argmax indices); that also
    // keeps every product below from overflowing.
    constexpr int64_t kMaxFloats = INT32_MAX;
    auto too_big = [&](const Shape& s) {
      return s.c > kMaxFloats || s.h > kMaxFloats || s.w > kMaxFloats ||
             s.c * s.h > kMaxFloats || s.c * s.h * s.w > kMaxFloats;
    };
    if (too_big(shape)) {
      steps->push_back({Field<config::Model>(config::Model::kInputChannelsFieldNumber), -1});
      Report(*steps, fmt::format("model input {} is {} floats per sample: expected at most {}",
                                 text(shape), static_cast<double>(shape.c) * shape.h * shape.w,
                                 kMaxFloats));
      steps->pop_back();
      return;
    }
    const FieldDescriptor* layers_field = Field<config::Model>(config::Model::kLayersFieldNumber);
    for (int i = 0; i < model.layers_size(); i++) {
      const config::Layer& layer = model.layers(i);
      const std::string from =
          i == 0 ? fmt::format("the model input {}", text(shape))
                 : fmt::format("{} from model.layers[{}]", text(shape), i - 1);
      // Reports `what` at field `number` of the layer's `kind` message.
      auto report = [&](int kind, const FieldDescriptor* field, const std::string& what) {
        steps->push_back({layers_field, i});
        steps->push_back({Field<config::Layer>(kind), -1});
        steps->push_back({field, -1});
        Report(*steps, fmt::format("{} = {}", PathString(*steps), what));
        steps->pop_back();
        steps->pop_back();
        steps->pop_back();
      };
      Shape next = shape;
      switch (layer.kind_case()) {
        case config::Layer::kLinear: {
          if (layer.linear().out_features() < 1) return;
          next = {layer.linear().out_features(), 1, 1};
          break;
        }
        case config::Layer::kConv2D: {
          const config::Conv2d& conv = layer.conv2d();
          if (conv.out_channels() < 1 || conv.kernel_size() < 1 || conv.stride() < 1 ||
              conv.padding() < 0) {
            return;
          }
          const int64_t k = conv.kernel_size(), p = conv.padding();
          if (k > shape.h + 2 * p || k > shape.w + 2 * p) {
            report(config::Layer::kConv2DFieldNumber,
                   Field<config::Conv2d>(config::Conv2d::kKernelSizeFieldNumber),
                   fmt::format("{}: expected at most {}, the padded height and width of its "
                               "input ({} with padding {} on each side)",
                               k, std::min(shape.h, shape.w) + 2 * p, from, p));
            return;
          }
          next = from_layers(layers::Conv2dOutShape(to_layers(shape),
                                                   static_cast<size_t>(conv.out_channels()),
                                                   static_cast<size_t>(k),
                                                   static_cast<size_t>(conv.stride()),
                                                   static_cast<size_t>(p)));
          break;
        }
        case config::Layer::kMaxPool2D: {
          const config::MaxPool2d& pool = layer.max_pool2d();
          if (pool.kernel_size() < 1 || pool.stride() < 0) return;
          const int64_t k = pool.kernel_size();
          const int64_t stride = pool.stride() == 0 ? k : pool.stride();
          if (k > shape.h || k > shape.w) {
            report(config::Layer::kMaxPool2DFieldNumber,
                   Field<config::MaxPool2d>(config::MaxPool2d::kKernelSizeFieldNumber),
                   fmt::format("{}: expected at most {}, the height and width of its input ({})",
                               k, std::min(shape.h, shape.w), from));
            return;
          }
          next = from_layers(layers::MaxPool2dOutShape(to_layers(shape), static_cast<size_t>(k),
                                                      static_cast<size_t>(stride)));
          break;
        }
        case config::Layer::kFlatten:
          next = {shape.c * shape.h * shape.w, 1, 1};
          break;
        case config::Layer::kRelu:
        case config::Layer::kDropout:
          break;
        default:
          return;  // no kind: CheckLayer reports it
      }
      if (too_big(next)) {
        steps->push_back({layers_field, i});
        Report(*steps, fmt::format("{} = {{ {} }} outputs {}, {} floats per sample: expected at "
                                   "most {}",
                                   PathString(*steps), layer.ShortDebugString(), text(next),
                                   static_cast<double>(next.c) * next.h * next.w, kMaxFloats));
        steps->pop_back();
        return;
      }
      shape = next;
    }
  }

  // A rounding option that the chosen codec does not use is a mistake, not a no-op.
  void CheckComm(const config::Comm& comm, std::vector<Step>* steps) {
    auto check = [&](int number, bool set, std::initializer_list<config::Comm::Compression> needs) {
      if (!set || std::find(needs.begin(), needs.end(), comm.compression()) != needs.end()) return;
      std::vector<std::string> names;
      for (auto n : needs) names.push_back(config::Comm::Compression_Name(n));
      steps->push_back({Field<config::Comm>(number), -1});
      Report(*steps, fmt::format("{} = true: applies only to compression: {} (compression is {})",
                                 PathString(*steps), fmt::join(names, " or "),
                                 config::Comm::Compression_Name(comm.compression())));
      steps->pop_back();
    };
    check(config::Comm::kRoundToNearestEvenFieldNumber, comm.round_to_nearest_even(),
          {config::Comm::trunc16});
    check(config::Comm::kStochasticRoundingFieldNumber, comm.stochastic_rounding(),
          {config::Comm::q8, config::Comm::q4});
    if (!comm.network_interface().empty()) {
      steps->push_back({Field<config::Comm>(config::Comm::kNetworkInterfaceFieldNumber), -1});
      try {
        transport::ParseIfnameFilter(comm.network_interface(), PathString(*steps));
      } catch (const Error& e) {
        Report(*steps, e.what());
      }
      steps->pop_back();
    }
  }

  // The pipeline's fields against the model, the batch and the mode (each alone is checked by
  // its rule). The world size is checked when the job starts (it must be a multiple of stages).
  void CheckCompensation(const config::Job& job) {
    const config::Train& train = job.train();
    if (train.staleness_compensation() == config::NONE || train.pipeline_width() < 2 ||
        job.model().device() != config::Model::CUDA) {
      return;
    }
    std::vector<Step> steps{{Field<config::Job>(config::Job::kTrainFieldNumber), -1},
                            {Field<config::Train>(config::Train::kStalenessCompensationFieldNumber), -1}};
    Report(steps, fmt::format("{} = {}: not implemented with model.device = CUDA (the weight "
                              "prediction runs on host parameters); use NONE",
                              PathString(steps),
                              config::StalenessCompensation_Name(train.staleness_compensation())));
  }

  // The auto width times trial steps on scratch copies of the parameters and the optimizer
  // state, which only the CPU RING trainer without a stateful reducer has.
  void CheckAutoWidth(const config::Job& job) {
    if (job.train().pipeline_width() != 0 || job.train().mode() != config::RING ||
        job.train().local_steps() > 1) {
      return;  // the outer loop does not use pipeline_width
    }
    std::vector<Step> steps{{Field<config::Job>(config::Job::kTrainFieldNumber), -1},
                            {Field<config::Train>(config::Train::kPipelineWidthFieldNumber), -1}};
    const std::string path = PathString(steps);
    if (job.model().device() == config::Model::CUDA) {
      Report(steps, fmt::format("{} = 0 (auto): not implemented with model.device = CUDA (the "
                                "trial steps would train the device parameters); set 1 or 2",
                                path));
    }
    if (job.comm().powersgd_rank() > 0) {
      Report(steps, fmt::format("{} = 0 (auto): not implemented with comm.powersgd_rank = {} "
                                "(the trial steps would move PowerSGD's state); set 1 or 2",
                                path, job.comm().powersgd_rank()));
    }
  }

  // The outer loop (train.local_steps > 1) runs on the RING mode's ring, with set values: the
  // auto chunk size and streams are measured with the RING trainer's steps.
  void CheckOuterLoop(const config::Job& job) {
    const int64_t h = job.train().local_steps();
    if (h <= 1) return;
    std::vector<Step> steps{{Field<config::Job>(config::Job::kTrainFieldNumber), -1},
                            {Field<config::Train>(config::Train::kLocalStepsFieldNumber), -1}};
    const std::string path = PathString(steps);
    if (job.train().mode() != config::RING) {
      Report(steps, fmt::format("{} = {}: the outer loop runs with train.mode = RING (it is {}); "
                                "set train.local_steps = 1 or train.mode = RING",
                                path, h, config::TrainMode_Name(job.train().mode())));
    }
    if (job.comm().chunk_bytes() == 0 || job.comm().streams() == 0) {
      Report(steps, fmt::format("{} = {}: comm.{} = auto is not implemented with the outer loop; "
                                "set a value",
                                path, h, job.comm().chunk_bytes() == 0 ? "chunk_bytes" : "streams"));
    }
  }

  // What the job asks of its mode against what the mode declares (mode_info.h): the GPU,
  // checkpoints, a codec, PowerSGD. Issue 45: the PS and SDPIPE modes built their models on the
  // CPU whatever model.device said and trained there without a word.
  void CheckModeSupports(const config::Job& job) {
    const ModeInfo* mode = nullptr;
    for (const ModeInfo* m : RegisteredModes()) {
      if (m->selects(job)) mode = m;
    }
    if (mode == nullptr) return;  // a mode the build lacks: ModeOf names it at the start
    auto refuse = [&](std::vector<Step> steps, const std::string& value,
                      bool ModeSupport::*feature, const char* fix) {
      if (mode->support.*feature) return;
      std::vector<std::string> able;
      for (const ModeInfo* m : RegisteredModes()) {
        if (m->support.*feature) able.push_back(m->name);
      }
      Report(steps, fmt::format("{} = {}: not supported by {} (only by {}); {}",
                                PathString(steps), value, mode->name,
                                able.empty() ? std::string("no mode") : fmt::format("{}", fmt::join(able, ", ")),
                                fix));
    };
    const auto job_field = [](int number) { return Step{Field<config::Job>(number), -1}; };
    if (job.model().device() == config::Model::CUDA) {
      refuse({job_field(config::Job::kModelFieldNumber),
              {Field<config::Model>(config::Model::kDeviceFieldNumber), -1}},
             "CUDA", &ModeSupport::cuda, "use CPU");
    }
    if (!job.checkpoint().dir().empty()) {
      refuse({job_field(config::Job::kCheckpointFieldNumber),
              {Field<config::Checkpoint>(config::Checkpoint::kDirFieldNumber), -1}},
             fmt::format("'{}'", job.checkpoint().dir()), &ModeSupport::checkpoints,
             "leave checkpoint.dir empty");
    }
    if (job.comm().compression() != config::Comm::none) {
      refuse({job_field(config::Job::kCommFieldNumber),
              {Field<config::Comm>(config::Comm::kCompressionFieldNumber), -1}},
             config::Comm::Compression_Name(job.comm().compression()), &ModeSupport::compression,
             "set comm.compression = none");
    }
    if (job.comm().powersgd_rank() > 0) {
      refuse({job_field(config::Job::kCommFieldNumber),
              {Field<config::Comm>(config::Comm::kPowersgdRankFieldNumber), -1}},
             std::to_string(job.comm().powersgd_rank()), &ModeSupport::powersgd,
             "set comm.powersgd_rank = 0");
    }
  }

  // PowerSGD replaces the ring's codec and needs what only the RING trainer on the CPU has.
  void CheckPowerSgd(const config::Job& job) {
    const int rank = job.comm().powersgd_rank();
    if (rank <= 0) return;
    std::vector<Step> steps{{Field<config::Job>(config::Job::kCommFieldNumber), -1},
                            {Field<config::Comm>(config::Comm::kPowersgdRankFieldNumber), -1}};
    const std::string path = PathString(steps);
    auto refuse = [&](const std::string& why) {
      Report(steps, fmt::format("{} = {}: {}", path, rank, why));
    };
    if (job.comm().compression() != config::Comm::none) {
      refuse(fmt::format("PowerSGD replaces the codec; set comm.compression = none (it is {})",
                         config::Comm::Compression_Name(job.comm().compression())));
    }
    if (job.model().device() == config::Model::CUDA) {
      refuse("not implemented with model.device = CUDA");
    }
    if (!job.checkpoint().dir().empty()) {
      refuse("not implemented with checkpoints (checkpoint.dir is set): the residual and the "
             "warm-start factors are not saved");
    }
  }

  void CheckPipeline(const config::Job& job) {
    if (!job.has_pipeline()) return;
    const config::Pipeline& pl = job.pipeline();
    std::vector<Step> steps{{Field<config::Job>(config::Job::kPipelineFieldNumber), -1}};
    auto report = [&](int number, int index, std::string what) {
      steps.push_back({Field<config::Pipeline>(number), index});
      Report(steps, fmt::format("{} {}", PathString(steps), what));
      steps.pop_back();
    };
    const int layers = job.model().layers_size();
    if (pl.stages() > 1 && job.train().mode() != config::SDPIPE) {
      report(config::Pipeline::kStagesFieldNumber, -1,
             fmt::format("= {}: pipeline stages need train.mode: SDPIPE (train.mode is {})",
                         pl.stages(), config::TrainMode_Name(job.train().mode())));
    }
    if (pl.stages() > layers && layers > 0) {
      report(config::Pipeline::kStagesFieldNumber, -1,
             fmt::format("= {}: expected at most the model's {} layers (each stage needs one)",
                         pl.stages(), layers));
    }
    if (pl.boundaries_size() > 0 && pl.boundaries_size() != pl.stages() - 1) {
      report(config::Pipeline::kBoundariesFieldNumber, -1,
             fmt::format("has {} values: expected stages - 1 = {} (or none: balanced by "
                         "parameter count)",
                         pl.boundaries_size(), pl.stages() - 1));
    } else {
      for (int i = 0; i < pl.boundaries_size(); ++i) {
        const int b = pl.boundaries(i);
        const int lo = i == 0 ? 1 : pl.boundaries(i - 1) + 1;
        if (b < lo || b >= layers) {
          report(config::Pipeline::kBoundariesFieldNumber, i,
                 fmt::format("= {}: expected a layer index in [{}, {}) (strictly ascending; the "
                             "model has {} layers)",
                             b, lo, layers, layers));
        }
      }
    }
    if (pl.micro_batches() >= 1 && job.train().batch_size() % pl.micro_batches() != 0) {
      report(config::Pipeline::kMicroBatchesFieldNumber, -1,
             fmt::format("= {}: train.batch_size = {} must be a multiple of it",
                         pl.micro_batches(), job.train().batch_size()));
    }
  }

  // The window's bounds must hold together (each alone is checked by its rule).
  void CheckSdpipe(const config::Sdpipe& sd, std::vector<Step>* steps) {
    auto report = [&](int number, std::string what) {
      steps->push_back({Field<config::Sdpipe>(number), -1});
      Report(*steps, fmt::format("{} {}", PathString(*steps), what));
      steps->pop_back();
    };
    if (sd.window_shrink() > 1) {
      report(config::Sdpipe::kWindowShrinkFieldNumber,
             fmt::format("= {}: expected a factor in (0, 1]", sd.window_shrink()));
    }
    if (sd.window_max_s() < sd.window_min_s()) {
      report(config::Sdpipe::kWindowMaxSFieldNumber,
             fmt::format("= {}: expected >= sdpipe.window_min_s = {}", sd.window_max_s(),
                         sd.window_min_s()));
    } else if (sd.window_init_s() < sd.window_min_s() || sd.window_init_s() > sd.window_max_s()) {
      report(config::Sdpipe::kWindowInitSFieldNumber,
             fmt::format("= {}: expected seconds in [window_min_s, window_max_s] = [{}, {}]",
                         sd.window_init_s(), sd.window_min_s(), sd.window_max_s()));
    }
  }

  void CheckLayer(const config::Layer& layer, std::vector<Step>* steps) {
    if (layer.kind_case() != config::Layer::KIND_NOT_SET) return;
    const pb::OneofDescriptor* kind = config::Layer::descriptor()->FindOneofByName("kind");
    std::string kinds;
    for (int i = 0; kind != nullptr && i < kind->field_count(); ++i) {
      const char* sep = i == 0 ? "" : i + 1 == kind->field_count() ? " or " : ", ";
      kinds += fmt::format("{}{}", sep, kind->field(i)->name());
    }
    Report(*steps, fmt::format("{} = {{}}: expected a layer kind ({})", PathString(*steps), kinds));
  }

  void CheckScalar(const Message& message, const FieldDescriptor* field, int index,
                   const std::vector<Step>& steps) {
    auto rule = Rules().find(field);
    if (rule == Rules().end()) return;
    const Reflection* r = message.GetReflection();
    std::string value;
    bool ok = true;
    std::string expected;
    if (const auto* range = std::get_if<IntRange>(&rule->second)) {
      int64_t v = 0;
      switch (field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
          v = index < 0 ? r->GetInt32(message, field) : r->GetRepeatedInt32(message, field, index);
          break;
        case FieldDescriptor::CPPTYPE_INT64:
          v = index < 0 ? r->GetInt64(message, field) : r->GetRepeatedInt64(message, field, index);
          break;
        default:
          PSGD_CHECK(!"integer rule on a non-integer field");
      }
      value = fmt::format("{}", v);
      ok = (v == 0 && range->zero_means != nullptr) ||
           (v >= range->lo && (!range->hi || v <= *range->hi) && v % range->multiple_of == 0);
      expected = Describe(*range);
    } else if (const auto* real_range = std::get_if<RealRange>(&rule->second)) {
      double v = 0;
      switch (field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_FLOAT: {
          float f = index < 0 ? r->GetFloat(message, field) : r->GetRepeatedFloat(message, field, index);
          value = fmt::format("{}", f);  // shortest float text: 0.05, not 0.0500000007
          v = f;
          break;
        }
        case FieldDescriptor::CPPTYPE_DOUBLE:
          v = index < 0 ? r->GetDouble(message, field) : r->GetRepeatedDouble(message, field, index);
          value = fmt::format("{}", v);
          break;
        default:
          PSGD_CHECK(!"real rule on a non-real field");
      }
      ok = std::isfinite(v) && (real_range->lo_inclusive ? v >= real_range->lo : v > real_range->lo) &&
           (!real_range->hi_exclusive || v < *real_range->hi_exclusive) &&
           (!real_range->hi_inclusive || v <= *real_range->hi_inclusive);
      expected = Describe(*real_range);
    } else {
      std::string scratch;
      const std::string& v = index < 0 ? r->GetStringReference(message, field, &scratch)
                                       : r->GetRepeatedStringReference(message, field, index, &scratch);
      value = fmt::format("\"{}\"", pb::CEscape(v));
      ok = !v.empty();
      expected = "expected a non-empty path";
    }
    if (ok) return;
    const std::string path = PathString(steps);
    if (filled_.count(path) != 0) {
      Report(steps, fmt::format("{} is not set: {}", path, expected));
    } else {
      Report(steps, fmt::format("{} = {}: {}", path, value, expected));
    }
  }

  // Prefixes `what` with where the value came from: the last override that set it or a
  // message around it, else its line in the file (or that of the nearest enclosing block, for
  // a value filled from a default), else just the file.
  void Report(const std::vector<Step>& steps, const std::string& what) {
    const std::string path = PathString(steps);
    for (auto it = overrides_.rbegin(); it != overrides_.rend(); ++it) {
      if (PathsOverlap(it->path, path)) {
        errors_.push_back(fmt::format("{}: {}", it->text, what));
        return;
      }
    }
    TextFormat::ParseLocation found;
    const TextFormat::ParseInfoTree* tree = tree_;
    for (const Step& step : steps) {
      // An unindexed repeated field (model.layers when empty) has no location of its own.
      if (tree == nullptr || (step.field->is_repeated() && step.index < 0)) break;
      TextFormat::ParseLocation here = tree->GetLocation(step.field, step.index);
      if (here.line >= 0) found = here;
      tree = step.field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE
                 ? tree->GetTreeForNested(step.field, step.index)
                 : nullptr;
    }
    if (found.line < 0) {
      errors_.push_back(fmt::format("{}: {}", file_, what));
    } else {
      errors_.push_back(
          fmt::format("{}:{}:{}: {}", file_, found.line + 1, found.column + 1, what));
    }
  }

  const std::string& file_;
  const TextFormat::ParseInfoTree* tree_;
  const std::vector<AppliedOverride>& overrides_;
  const std::set<std::string>& filled_;
  std::vector<std::string> errors_;
};

}  // namespace

void Validate(const config::Job& job, const std::string& file,
              const TextFormat::ParseInfoTree* tree,
              const std::vector<AppliedOverride>& overrides, const std::set<std::string>& filled) {
  Validator(file, tree, overrides, filled).Run(job);
}

}  // namespace pipesgd::job::config_detail
