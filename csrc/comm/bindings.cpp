// Python bindings of the bucket engine (shardopt._C.BucketEngine).
#include <torch/csrc/utils/pybind.h>

#include "../module.h"
#include "bucket_engine.h"
#include "copy_device.h"
#include "fake_copy_device.h"
#include "grad_hooks.h"
#include "host_copier.h"

namespace py = pybind11;

namespace shardopt {

void init_comm_bindings(pybind11::module& m) {
  // Note [Device copies behind an interface] in copy_device.h.
  py::class_<CopyDevice, std::shared_ptr<CopyDevice>>(m, "CopyDevice");
  py::class_<FakeCopyDevice, CopyDevice, std::shared_ptr<FakeCopyDevice>>(m, "FakeCopyDevice")
      .def(py::init<bool>(), py::arg("pinned"))
      .def("log", &FakeCopyDevice::log, "Every call, in order.")
      .def_property_readonly("queued", &FakeCopyDevice::queued);
  // The copier on its own, for tests of its decisions (the engine owns one).
  py::class_<HostCopier>(m, "HostCopier")
      .def(py::init<std::shared_ptr<CopyDevice>>(), py::arg("device"))
      .def("start_copy", &HostCopier::start_copy, py::arg("dst"), py::arg("src"), py::arg("slot"))
      .def("before_reuse", &HostCopier::before_reuse, py::arg("slot"))
      .def("finish_all", &HostCopier::finish_all);
  m.def("default_copy_device", &default_copy_device,
        "This build's CopyDevice for the bucket engine's host copies (None without CUDA).");

  py::class_<BucketPlan>(m, "BucketPlan")
      .def(py::init<>())
      .def_readwrite("bucket_start", &BucketPlan::bucket_start)
      .def_readwrite("bucket_numel", &BucketPlan::bucket_numel)
      .def_readwrite("bucket_params", &BucketPlan::bucket_params)
      .def_readwrite("param_offset", &BucketPlan::param_offset)
      .def_readwrite("param_numel", &BucketPlan::param_numel)
      .def_readwrite("launch_order", &BucketPlan::launch_order)
      .def_readwrite("gather_bucket", &BucketPlan::gather_bucket)
      .def_readwrite("gather_lo", &BucketPlan::gather_lo)
      .def_readwrite("gather_hi", &BucketPlan::gather_hi);

  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("keep_full_grads", &EngineOptions::keep_full_grads)
      .def_readwrite("num_staging", &EngineOptions::num_staging)
      .def_readwrite("overlap", &EngineOptions::overlap)
      .def_readwrite("impl", &EngineOptions::impl)
      .def_readwrite("grad_dtype", &EngineOptions::grad_dtype)
      .def_readwrite("reduce_dtype", &EngineOptions::reduce_dtype)
      .def_readwrite("device", &EngineOptions::device)
      .def_readwrite("wait_for_staging", &EngineOptions::wait_for_staging)
      .def_readwrite("copy_device", &EngineOptions::copy_device);

  using gil_release = py::call_guard<py::gil_scoped_release>;
  py::class_<BucketEngine, std::shared_ptr<BucketEngine>>(m, "BucketEngine")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, BucketPlan, EngineOptions, at::Tensor, at::Tensor>(),
           py::arg("process_group"), py::arg("plan"), py::arg("options"), py::arg("flat_grad"),
           py::arg("shard_grad"))
      .def("mark_ready", &BucketEngine::mark_ready, py::arg("param"), py::arg("grad"), gil_release())
      .def("note_used", &BucketEngine::note_used, py::arg("param"))
      .def("unready_params", &BucketEngine::unready_params)
      .def("flush", &BucketEngine::flush, gil_release())
      .def("backward_in_progress", &BucketEngine::backward_in_progress)
      .def("zero_grad", &BucketEngine::zero_grad, gil_release())
      .def("used", &BucketEngine::used)
      .def("has_grad", &BucketEngine::has_grad)
      .def("set_loss_scale", &BucketEngine::set_loss_scale, py::arg("scale"))
      .def("found_nonfinite", &BucketEngine::found_nonfinite)
      .def("set_replicate_group", &BucketEngine::set_replicate_group, py::arg("replicate"), py::arg("format"))
      .def("set_replica_hop", &BucketEngine::set_replica_hop, py::arg("enabled"))
      .def("set_node_groups", &BucketEngine::set_node_groups, py::arg("node"), py::arg("across"), py::arg("format"))
      .def("set_gather_dtype", &BucketEngine::set_gather_dtype, py::arg("dtype"))
      .def("reset_hop_residual", &BucketEngine::reset_hop_residual)
      .def_property_readonly("hop_residual_bytes", &BucketEngine::hop_residual_bytes)
      .def_property_readonly("hop_residual", &BucketEngine::hop_residual)
      .def("all_gather_params", &BucketEngine::all_gather_params, py::arg("flat"), gil_release())
      .def("start_all_gather_params", &BucketEngine::start_all_gather_params, py::arg("flat"), gil_release())
      .def("finish_all_gather", &BucketEngine::finish_all_gather, py::arg("bucket"), gil_release())
      .def("finish_all_gather_params", &BucketEngine::finish_all_gather_params, gil_release())
      .def_property_readonly("num_pending_gathers", &BucketEngine::num_pending_gathers)
      .def_property_readonly("num_reduce_scatters", &BucketEngine::num_reduce_scatters)
      .def_property_readonly("num_all_gathers", &BucketEngine::num_all_gathers)
      .def_property_readonly("num_staging_buffers", &BucketEngine::num_staging_buffers)
      .def_property_readonly("staging_bytes", &BucketEngine::staging_bytes)
      .def_property_readonly("copy_seconds", &BucketEngine::copy_seconds);

  // Note [Gradient hooks in C++] in grad_hooks.h.
  py::enum_<GradRoute>(m, "GradRoute")
      .value("KEEP_IN_FLAT_BUFFER", GradRoute::kKeepInFlatBuffer)
      .value("RELEASE", GradRoute::kRelease)
      .value("BEFORE_ACCUMULATION", GradRoute::kBeforeAccumulation);
  py::class_<GradHooks>(m, "GradHooks")
      .def(py::init<std::vector<at::Tensor>, std::shared_ptr<BucketEngine>, std::vector<at::Tensor>, GradRoute,
                    py::object>(),
           py::arg("params"), py::arg("engine"), py::arg("views"), py::arg("route"), py::arg("begin"))
      .def("count_buckets", &GradHooks::count_buckets, py::arg("param_buckets"), py::arg("bucket_done"),
           "BEFORE_ACCUMULATION: each parameter's buckets, and the call when a bucket has every gradient.")
      .def("arm", &GradHooks::arm, py::arg("pending"), "A backward round begins: parameters to wait for, per bucket.")
      .def("disarm", &GradHooks::disarm, "The backward round closed.")
      .def("ensure", &GradHooks::ensure, "BEFORE_ACCUMULATION: puts back tensor hooks a Python register_hook cleared; how many.")
      .def("remove", &GradHooks::remove, "Takes every hook off the parameters (idempotent).")
      .def_property_readonly("num_hooks", &GradHooks::num_hooks);
  m.def("set_grads", &set_grads, py::arg("params"), py::arg("grads"),
        "p.grad = g for each pair (None: no gradient); shapes, dtypes and devices must match.");
  m.attr("PASS_REDUCE") = static_cast<int64_t>(PassMode::kReduce);
  m.attr("PASS_NOTE_USED") = static_cast<int64_t>(PassMode::kNoteUsed);
  m.attr("PASS_IGNORE") = static_cast<int64_t>(PassMode::kIgnore);
}

}  // namespace shardopt
