// shardopt::adam_step: fused multi-tensor Adam/AdamW on CPU.
//
// Validates the tensor lists, folds the hyper-parameters into fp32 constants
// (bias corrections in double, as torch's fused Adam does), and runs the ISA
// kernel picked by active_isa() over all tensors in one parallel pass
// (Note [One parallel pass over all tensors] in multi_tensor.h). The ZeRO
// offload path calls the same op on its flat fp32 chunks, one call per group.
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "../cpu_features.h"
#include "adam_dispatch.h"
#include "adam_kernel.h"
#include "multi_tensor.h"

namespace shardopt {
namespace {

void check_fp32_like(const at::Tensor& t, const char* list, size_t i, const at::Tensor& param) {
  TORCH_CHECK(t.defined(), "adam_step: ", list, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "adam_step: ", list, "[", i, "] must be dense, got layout ",
              t.layout());
  TORCH_CHECK(t.device().is_cpu(), "adam_step: ", list, "[", i, "] must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adam_step: ", list, "[", i, "] must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "adam_step: ", list, "[", i, "] must be contiguous");
  TORCH_CHECK(t.numel() == param.numel(), "adam_step: ", list, "[", i, "] has ", t.numel(),
              " elements but params[", i, "] has ", param.numel());
}

AdamHyper fold_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                     double step, bool bias_correction) {
  TORCH_CHECK(lr >= 0.0, "adam_step: lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "adam_step: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "adam_step: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "adam_step: eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "adam_step: weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(step >= 1.0, "adam_step: step must be >= 1 (the count including this step), got ", step);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
  AdamHyper h;
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.step_size = static_cast<float>(lr / bc1);
  h.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  h.eps = static_cast<float>(eps);
  h.adamw = adamw ? 1 : 0;
  h.l2 = adamw ? 0.0f : static_cast<float>(weight_decay);
  h.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  return h;
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList lowp_out, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool adamw, double step, bool bias_correction) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "adam_step: params, grads, exp_avgs and exp_avg_sqs must have the same length, got ", n, ", ",
              grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  TORCH_CHECK(lowp_out.empty() || lowp_out.size() == n,
              "adam_step: lowp_out must be empty or have one tensor per param, got ", lowp_out.size(),
              " for ", n, " params");
  const AdamHyper hyper = fold_hyper(lr, beta1, beta2, eps, weight_decay, adamw, step, bias_correction);

  std::vector<AdamTensor> tensors(n);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    check_fp32_like(params[i], "params", i, params[i]);
    check_fp32_like(grads[i], "grads", i, params[i]);
    check_fp32_like(exp_avgs[i], "exp_avgs", i, params[i]);
    check_fp32_like(exp_avg_sqs[i], "exp_avg_sqs", i, params[i]);
    AdamTensor& t = tensors[i];
    t.param = params[i].data_ptr<float>();
    t.grad = grads[i].const_data_ptr<float>();
    t.exp_avg = exp_avgs[i].data_ptr<float>();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    t.lowp = nullptr;
    t.lowp_kind = kAdamLowpNone;
    if (!lowp_out.empty()) {
      const at::Tensor& o = lowp_out[i];
      TORCH_CHECK(o.device().is_cpu() && o.layout() == at::kStrided && o.is_contiguous(),
                  "adam_step: lowp_out[", i, "] must be a contiguous CPU tensor");
      TORCH_CHECK(o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf,
                  "adam_step: lowp_out[", i, "] must be bfloat16 or float16, got ", o.scalar_type());
      TORCH_CHECK(o.numel() == params[i].numel(), "adam_step: lowp_out[", i, "] has ", o.numel(),
                  " elements but params[", i, "] has ", params[i].numel());
      t.lowp = static_cast<uint16_t*>(o.data_ptr());
      t.lowp_kind = o.scalar_type() == at::kBFloat16 ? kAdamLowpBf16 : kAdamLowpFp16;
    }
    numels[i] = params[i].numel();
  }

  const AdamKernelFn kernel = adam_kernel_for(active_isa());
  parallel_over_tensors(numels, kDefaultGrain, [&](size_t i, int64_t begin, int64_t end) {
    kernel(&hyper, &tensors[i], begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(shardopt, CPU, m) {
  m.impl("adam_step", &adam_step_cpu);
}

}  // namespace shardopt
