// shardopt::adam_step: fused multi-tensor Adam/AdamW on CPU, and the driver
// both Adam entries share (adam_driver.h).
//
// The op validates its tensor lists, folds the hyper-parameters into fp32
// constants (bias corrections in double, as torch's fused Adam does), and runs
// the ISA kernel picked by active_isa() over all tensors in one parallel pass
// (Note [One parallel pass over all tensors] in multi_tensor.h). The ZeRO
// offload path calls it on its flat fp32 chunks, one call per group.
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "../cpu_features.h"
#include "adam_dispatch.h"
#include "adam_driver.h"
#include "multi_tensor.h"

namespace shardopt {

AdamHyper fold_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                          double step, bool bias_correction) {
  TORCH_CHECK(lr >= 0.0, "adam_step: lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "adam_step: beta1 must be in [0, 1), got ", beta1);
  // beta2 = 1 keeps exp_avg_sq as it is (v * 1 + g * g * 0): OneBitAdam's frozen variance
  // (Note [1-bit Adam under ZeRO] in shardopt/onebit.py). Its bias correction would be 0: only without one.
  TORCH_CHECK(beta2 >= 0.0 && (beta2 < 1.0 || (beta2 == 1.0 && !bias_correction)),
              "adam_step: beta2 must be in [0, 1) (or exactly 1, a frozen variance, with bias_correction=False), "
              "got ", beta2);
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

const char* adam_fp32_problem(const at::Tensor& t) {
  if (t.layout() != at::kStrided) return "must be dense (strided layout)";
  if (!t.device().is_cpu()) return "must be on the CPU";
  if (t.scalar_type() != at::kFloat) return "must be float32";
  if (!t.is_contiguous()) return "must be contiguous";
  return nullptr;
}

const char* adam_lowp_problem(const at::Tensor& t) {
  if (t.layout() != at::kStrided || !t.device().is_cpu() || !t.is_contiguous()) {
    return "must be a contiguous CPU tensor";
  }
  if (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kHalf) return "must be bfloat16 or float16";
  return nullptr;
}

AdamJob make_adam_job(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const at::Tensor& lowp, const AdamHyper* hyper) {
  // Untyped pointers: the dtypes were checked already, and the typed
  // accessors re-check them (a visible cost over hundreds of tensors).
  AdamJob job;
  job.tensor.param = static_cast<float*>(param.mutable_data_ptr());
  job.tensor.grad = static_cast<const float*>(grad.const_data_ptr());
  job.tensor.exp_avg = static_cast<float*>(exp_avg.mutable_data_ptr());
  job.tensor.exp_avg_sq = static_cast<float*>(exp_avg_sq.mutable_data_ptr());
  job.tensor.lowp = nullptr;
  job.tensor.lowp_kind = kAdamLowpNone;
  if (lowp.defined()) {
    job.tensor.lowp = static_cast<uint16_t*>(lowp.mutable_data_ptr());
    job.tensor.lowp_kind = lowp.scalar_type() == at::kBFloat16 ? kAdamLowpBf16 : kAdamLowpFp16;
  }
  job.numel = param.numel();
  job.hyper = hyper;
  return job;
}

void run_adam_jobs(const std::vector<AdamJob>& jobs) {
  std::vector<int64_t> numels(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) numels[i] = jobs[i].numel;
  const AdamKernelFn kernel = adam_kernel_for(active_isa());
  parallel_over_tensors(numels, kDefaultGrain, [&](size_t i, int64_t begin, int64_t end) {
    kernel(jobs[i].hyper, &jobs[i].tensor, begin, end);
  });
}

namespace {

void check_listed(const at::Tensor& t, const char* list, size_t i, const at::Tensor& param, bool lowp = false) {
  TORCH_CHECK(t.defined(), "adam_step: ", list, "[", i, "] is undefined");
  const char* problem = lowp ? adam_lowp_problem(t) : adam_fp32_problem(t);
  TORCH_CHECK(problem == nullptr, "adam_step: ", list, "[", i, "] ", problem, ", got ", t.scalar_type(), " ",
              t.layout(), " on ", t.device());
  TORCH_CHECK(t.numel() == param.numel(), "adam_step: ", list, "[", i, "] has ", t.numel(),
              " elements but params[", i, "] has ", param.numel());
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
  const AdamHyper hyper = fold_adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw, step, bias_correction);
  const at::Tensor no_lowp;
  std::vector<AdamJob> jobs(n);
  for (size_t i = 0; i < n; ++i) {
    check_listed(params[i], "params", i, params[i]);
    check_listed(grads[i], "grads", i, params[i]);
    check_listed(exp_avgs[i], "exp_avgs", i, params[i]);
    check_listed(exp_avg_sqs[i], "exp_avg_sqs", i, params[i]);
    if (!lowp_out.empty()) check_listed(lowp_out[i], "lowp_out", i, params[i], /*lowp=*/true);
    jobs[i] = make_adam_job(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                            lowp_out.empty() ? no_lowp : lowp_out[i], &hyper);
  }
  run_adam_jobs(jobs);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardopt, CPU, m) {
  m.impl("adam_step", &adam_step_cpu);
}

}  // namespace shardopt
