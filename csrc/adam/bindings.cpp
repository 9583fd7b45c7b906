// Python helpers of CPUAdam that are not ops.
#include <vector>

#include "../module.h"

namespace shardopt {
namespace {

// Adds `by` to each optimizer step counter (torch keeps one float32 scalar
// tensor per parameter) and returns the new values. Doing this through the
// dispatcher costs several microseconds per tensor (torch._foreach_add_ on
// CPU scalars loops over add_), which is a visible share of a step over 200
// small tensors; here it is a pointer write each.
std::vector<double> advance_steps(const std::vector<at::Tensor>& steps, double by) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.device().is_cpu() && s.layout() == at::kStrided && s.scalar_type() == at::kFloat &&
                    s.numel() == 1,
                "advance_steps: steps[", i, "] must be a float32 CPU tensor with one element, got ",
                s.scalar_type(), " ", s.device(), " with ", s.numel(), " elements");
  }
  std::vector<double> out(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    float* p = steps[i].data_ptr<float>();
    *p = static_cast<float>(*p + by);
    steps[i].unsafeGetTensorImpl()->bump_version();
    out[i] = *p;
  }
  return out;
}

}  // namespace

void init_adam_bindings(pybind11::module& m) {
  m.def("advance_steps", &advance_steps, pybind11::arg("steps"), pybind11::arg("by"),
        "Adds `by` to each float32 scalar step tensor in place; returns the new values.");
}

}  // namespace shardopt
