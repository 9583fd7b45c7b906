// CPUAdam's step as one pybind call (`_C.cpu_adam_step`).
//
// Note [CPUAdam's step entry]
// Over 200 small tensors, gathering params, grads and state in Python and
// passing four lists through torch.ops (each list converted to IValues) cost
// about 1.3 ms per step, more than the kernel's memory traffic at 1M
// parameters. This entry takes each group's params list as it is plus the
// optimizer's state dict, and reads each param's grad and state tensors
// itself (one dict lookup per param, ~0.1 us). Nothing is cached between
// steps, so whatever changed since the last step is seen: backward's new grad
// tensors (zero_grad(set_to_none=True) makes new ones every iteration), a
// param whose .data was replaced, state loaded or edited by the user.
//
// Every tensor is checked before anything changes; a refused step leaves
// params, state and step counters as they were, and CPUAdam turns the error
// into a ValueError/TypeError naming the parameter. Only then are the step
// counters advanced (torch's `step += 1` on its float32 scalar) and the
// kernel run over all groups in one parallel pass (Note [One parallel pass
// over all tensors]) with the GIL released. The kernel itself is the op's
// (run_adam_jobs in cpu_adam.cpp).
#include <deque>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "../module.h"
#include "adam_driver.h"

namespace py = pybind11;

namespace shardopt {
namespace {

// An interned key of torch's Adam state (looked up per param per step),
// created once and kept for the life of the process.
PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;
}

struct Where {
  size_t group;
  size_t index;
  const at::Tensor* param;
};

[[noreturn]] void refuse(const Where& w, const char* what, const char* problem) {
  TORCH_CHECK(false, "CPUAdam: param_groups[", w.group, "]['params'][", w.index, "] (shape ", w.param->sizes(),
              "): ", what, " ", problem);
}

// The tensor `o` (a Python object) or a refusal naming it.
const at::Tensor& tensor_of(PyObject* o, const Where& w, const char* what) {
  if (o == nullptr || !THPVariable_Check(o)) refuse(w, what, "is missing or not a tensor");
  return THPVariable_Unpack(o);
}

void check_fp32(const at::Tensor& t, const Where& w, const char* what) {
  if (const char* problem = adam_fp32_problem(t)) refuse(w, what, problem);
  if (!t.sizes().equals(w.param->sizes())) refuse(w, what, "has a different shape than the param");
}

// A group's hyper-parameters for one step count, folded once per distinct count.
struct StepHyper {
  double step;
  size_t hyper;  // index into the call's hypers
};

py::list cpu_adam_step(py::dict state, py::list groups) {
  static PyObject* const kStep = interned("step");
  static PyObject* const kExpAvg = interned("exp_avg");
  static PyObject* const kExpAvgSq = interned("exp_avg_sq");

  py::list needs_state;
  std::vector<AdamHyper> hypers;
  struct Pending {
    const at::Tensor* param;
    const at::Tensor* grad;  // the param's grad or its contiguous copy in `owned`
    const at::Tensor* exp_avg;
    const at::Tensor* exp_avg_sq;
    const at::Tensor* step;
    float new_step;  // torch's `step += 1` on the float32 counter
    const at::Tensor* lowp;  // nullptr: no copy
    size_t hyper;
  };
  std::vector<Pending> pending;
  std::deque<at::Tensor> owned;  // contiguous copies of strided grads (stable addresses)

  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const py::tuple g = groups[gi].cast<py::tuple>();
    TORCH_CHECK(g.size() == 9, "cpu_adam_step: group tuples have 9 fields, got ", g.size());
    PyObject* params = g[0].ptr();
    PyObject* lowps = g[1].ptr();
    TORCH_CHECK(PyList_Check(params), "cpu_adam_step: param_groups[", gi, "]['params'] must be a list");
    const Py_ssize_t n = PyList_GET_SIZE(params);
    TORCH_CHECK(lowps == Py_None || (PyList_Check(lowps) && PyList_GET_SIZE(lowps) == n),
                "cpu_adam_step: the low-precision copies of group ", gi, " must be None or one per param");
    const double lr = g[2].cast<double>(), beta1 = g[3].cast<double>(), beta2 = g[4].cast<double>();
    const double eps = g[5].cast<double>(), weight_decay = g[6].cast<double>();
    const bool adamw = g[7].cast<bool>(), bias_correction = g[8].cast<bool>();
    std::vector<StepHyper> group_hypers;  // usually one: every param of a group has the same count

    for (Py_ssize_t pi = 0; pi < n; ++pi) {
      PyObject* po = PyList_GET_ITEM(params, pi);
      TORCH_CHECK(THPVariable_Check(po), "CPUAdam: param_groups[", gi, "]['params'][", pi, "] is not a tensor");
      const at::Tensor& param = THPVariable_Unpack(po);
      const Where w{gi, static_cast<size_t>(pi), &param};
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;  // as torch: a param without a grad is not stepped at all
      check_fp32(param, w, "the param");
      TORCH_CHECK(grad.layout() == at::kStrided, "CPUAdam: param_groups[", gi, "]['params'][", pi,
                  "] has a sparse gradient (", grad.layout(), ")");
      // A strided grad is fine to read once made contiguous (a transposed view, say).
      const at::Tensor* dense = &grad;
      if (!grad.is_contiguous()) dense = &owned.emplace_back(grad.contiguous());
      check_fp32(*dense, w, "its gradient");
      const at::Tensor* lowp = nullptr;
      if (lowps != Py_None) {
        PyObject* lo = PyList_GET_ITEM(lowps, pi);
        if (lo != Py_None) {
          lowp = &tensor_of(lo, w, "its low-precision copy");
          if (const char* problem = adam_lowp_problem(*lowp)) refuse(w, "its low-precision copy", problem);
          if (lowp->numel() != param.numel()) {
            refuse(w, "its low-precision copy", "has a different number of elements than the param");
          }
        }
      }

      PyObject* st = PyDict_GetItemWithError(state.ptr(), po);
      if (st == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (st != nullptr && !PyDict_Check(st)) refuse(w, "its optimizer state", "is not a dict");
      if (st == nullptr || PyDict_GET_SIZE(st) == 0) {
        needs_state.append(py::make_tuple(gi, pi));
        continue;
      }
      auto item = [&](PyObject* key) {
        PyObject* o = PyDict_GetItemWithError(st, key);
        if (o == nullptr && PyErr_Occurred()) throw py::error_already_set();
        return o;
      };
      const at::Tensor& step = tensor_of(item(kStep), w, "its state 'step'");
      if (!(step.layout() == at::kStrided && step.device().is_cpu() && step.scalar_type() == at::kFloat &&
            step.numel() == 1)) {
        refuse(w, "its state 'step'", "must be a float32 CPU tensor with one element");
      }
      const at::Tensor& exp_avg = tensor_of(item(kExpAvg), w, "its state 'exp_avg'");
      const at::Tensor& exp_avg_sq = tensor_of(item(kExpAvgSq), w, "its state 'exp_avg_sq'");
      check_fp32(exp_avg, w, "its state 'exp_avg'");
      check_fp32(exp_avg_sq, w, "its state 'exp_avg_sq'");

      const float next = static_cast<float>(*static_cast<const float*>(step.const_data_ptr()) + 1.0);
      size_t h = 0;
      while (h < group_hypers.size() && group_hypers[h].step != next) ++h;
      if (h == group_hypers.size()) {
        hypers.push_back(fold_adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw, next, bias_correction));
        group_hypers.push_back({next, hypers.size() - 1});
      }
      pending.push_back({&param, dense, &exp_avg, &exp_avg_sq, &step, next, lowp, group_hypers[h].hyper});
    }
  }
  if (needs_state.size() > 0) return needs_state;  // nothing changed; CPUAdam creates the state and calls again

  // The kernel runs without the GIL, so another Python thread could drop the
  // last reference to a tensor meanwhile (e.g. `p.grad = None`). Holding each
  // buffer's storage keeps its memory valid. (Copying the at::Tensors would
  // too, but a copy of a tensor that Python owns re-acquires the GIL to pin
  // its PyObject: ~1 us a tensor, a fifth of this call.)
  std::vector<c10::Storage> keep;
  keep.reserve(pending.size() * 5);
  std::vector<AdamJob> jobs(pending.size());
  const at::Tensor no_lowp;
  for (size_t j = 0; j < pending.size(); ++j) {
    const Pending& t = pending[j];
    jobs[j] = make_adam_job(*t.param, *t.grad, *t.exp_avg, *t.exp_avg_sq, t.lowp ? *t.lowp : no_lowp,
                            &hypers[t.hyper]);
    for (const at::Tensor* x : {t.param, t.grad, t.exp_avg, t.exp_avg_sq}) keep.push_back(x->storage());
    if (t.lowp) keep.push_back(t.lowp->storage());
    *static_cast<float*>(t.step->mutable_data_ptr()) = t.new_step;
    // In-place updates, reported to autograd's saved-tensor checks as torch's
    // own optimizers do (inference tensors have no version counter).
    for (const at::Tensor* x : {t.step, t.param, t.exp_avg, t.exp_avg_sq}) {
      if (!x->is_inference()) x->unsafeGetTensorImpl()->bump_version();
    }
  }
  {
    py::gil_scoped_release no_gil;
    run_adam_jobs(jobs);
  }
  return needs_state;
}

}  // namespace

void init_adam_bindings(pybind11::module& m) {
  m.def("cpu_adam_step", &cpu_adam_step, py::arg("state"), py::arg("groups"),
        "CPUAdam.step over all groups (Note [CPUAdam's step entry]). groups: one tuple per group, (params "
        "list, None or one low-precision copy or None per param, lr, beta1, beta2, eps, weight_decay, adamw, "
        "bias_correction). Returns the (group, index) of stepped params with no state yet; if there are "
        "any, nothing was changed.");
}

}  // namespace shardopt
