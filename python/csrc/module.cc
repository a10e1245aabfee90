// pipesgd._torch: the Python face of the c10d backend (python/pipesgd/torch/__init__.py
// registers it). Built against torch's own pybind11 type registry, so the ProcessGroup returned
// here is a torch.distributed ProcessGroup that DDP and every torch.distributed call accept.
#include <algorithm>
#include <cctype>
#include <tuple>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "pipesgd/pipesgd.h"
#include "transport/factory.h"
#include "transport/launch_env.h"
#include "python/csrc/process_group.h"

namespace py = pybind11;
using pipesgd::torch_backend::BackendOptions;
using pipesgd::torch_backend::HookWireStats;
using pipesgd::torch_backend::ProcessGroupPipesgd;

PYBIND11_MODULE(_torch, m) {
  m.doc() = "pipesgd's c10d backend (see pipesgd.torch)";
  // torch.distributed's classes must be registered before ours derives from them.
  py::module::import("torch.distributed");

  py::class_<HookWireStats>(m, "HookWireStats")
      .def_readonly("bytes_sent", &HookWireStats::bytes_sent)
      .def_readonly("payload_bytes", &HookWireStats::payload_bytes)
      .def_readonly("raw_payload_bytes", &HookWireStats::raw_payload_bytes)
      .def_readonly("compressed", &HookWireStats::compressed);

  py::class_<ProcessGroupPipesgd, ::c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupPipesgd>>(
      m, "ProcessGroupPipesgd")
      .def(py::init([](const c10::intrusive_ptr<::c10d::Store>& store, int rank, int size,
                       double timeout_s, std::vector<std::string> overrides) {
             BackendOptions o;
             o.timeout_s = timeout_s;
             o.overrides = std::move(overrides);
             return c10::make_intrusive<ProcessGroupPipesgd>(store, rank, size, o);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
           py::arg("overrides"), py::call_guard<py::gil_scoped_release>())
      .def("_allreduce_codec", &ProcessGroupPipesgd::AllReduceCodec, py::arg("bucket"),
           py::arg("key"), py::arg("codec"), py::arg("error_feedback"), py::arg("step") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("_allreduce_powersgd", &ProcessGroupPipesgd::AllReducePowerSgd, py::arg("bucket"),
           py::arg("key"), py::arg("matrices"), py::arg("rank"), py::arg("compress"),
           py::arg("step") = -1, py::call_guard<py::gil_scoped_release>())
      // [(name, step, begin_s, end_s)]: the collectives finished since the last call.
      .def("_take_spans",
           [](ProcessGroupPipesgd& pg) {
             std::vector<std::tuple<std::string, int64_t, double, double>> out;
             for (const pipesgd::torch_backend::CommSpan& s : pg.TakeSpans()) {
               std::string name = ::c10d::opTypeToString(s.type);  // "ALLREDUCE": lower case
               std::transform(name.begin(), name.end(), name.begin(),
                              [](unsigned char c) { return std::tolower(c); });
               out.emplace_back(std::move(name), s.step, s.begin_s, s.end_s);
             }
             return out;
           })
      .def("_hook_state", &ProcessGroupPipesgd::HookState, py::arg("key"),
           py::call_guard<py::gil_scoped_release>())
      .def("_restore_hook_state", &ProcessGroupPipesgd::RestoreHookState, py::arg("key"),
           py::arg("state"), py::call_guard<py::gil_scoped_release>())
      .def("_last_hook_stats", &ProcessGroupPipesgd::last_hook_stats)
      .def("describe", &ProcessGroupPipesgd::Describe);

  // ValueError for a bad argument or option, TimeoutError for a deadline, RuntimeError for the
  // rest (a dead peer, ranks that disagree): what a Python caller would catch. The message
  // names the ranks and values either way. Registered in pybind11's shared registry, so it
  // also applies to errors that torch's Work.wait() rethrows.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pipesgd::Error& e) {
      switch (e.code()) {
        case pipesgd::ErrorCode::kInvalidArgument: PyErr_SetString(PyExc_ValueError, e.what()); return;
        case pipesgd::ErrorCode::kDeadlineExceeded: PyErr_SetString(PyExc_TimeoutError, e.what()); return;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); return;
      }
    }
  });

  // What pipesgd's workers read from their launcher (transport/launch_env.h), as torch's env://
  // names it; empty under no launcher. MASTER_PORT is pipesgd's choice under Slurm and mpirun.
  m.def("_launch_env", [] {
    const pipesgd::transport::LaunchEnv env = pipesgd::transport::ReadLaunchEnv();
    py::dict d;
    if (env.launcher == pipesgd::transport::Launcher::kNone) return d;
    d["RANK"] = env.rank;
    d["WORLD_SIZE"] = env.world_size;
    d["LOCAL_RANK"] = env.local_rank;
    d["MASTER_ADDR"] = env.master_addr;
    d["MASTER_PORT"] = env.master_port;
    return d;
  });
  // The transports this build has ("tcp", and "ucx", "ibverbs" where their libraries were found).
  m.def("transports", [] {
    std::vector<std::string> out;
    for (auto k : {pipesgd::TransportKind::kTcp, pipesgd::TransportKind::kUcx,
                   pipesgd::TransportKind::kIbverbs}) {
      if (pipesgd::transport::TransportCompiled(k)) {
        out.emplace_back(pipesgd::transport::TransportKindName(k));
      }
    }
    return out;
  });
  m.def("version", [] { return std::string(pipesgd::Version()); });
}
