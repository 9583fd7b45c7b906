// The torch-facing half of fused Adam, shared by its two entries: the
// shardopt::adam_step op (cpu_adam.cpp; torch.compile, the ZeRO path) and
// CPUAdam's pybind step (bindings.cpp). Each entry turns its arguments into
// AdamJobs with these checks, then calls run_adam_jobs: one kernel, one
// parallel pass, whatever the entry.
#pragma once

#include <vector>

#include <ATen/ATen.h>

#include "adam_kernel.h"

namespace shardopt {

// One tensor's work: its buffers, its length, and the folded hyper-parameters
// of its group and step count (tensors of one call may differ in both).
struct AdamJob {
  AdamTensor tensor;
  int64_t numel;
  const AdamHyper* hyper;
};

// lr, betas, eps and weight_decay folded into the kernel's fp32 constants,
// bias corrections for `step` (the count including this step, >= 1) in
// double as torch's fused Adam does. TORCH_CHECKs the ranges.
AdamHyper fold_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                          double step, bool bias_correction);

// Why a defined `t` cannot be one of a job's fp32 buffers (dense, CPU, float32,
// contiguous), or nullptr if it can. The caller names `t` in its error and
// compares numels itself (the op compares numels, CPUAdam whole shapes).
const char* adam_fp32_problem(const at::Tensor& t);

// The same for a low-precision copy (contiguous CPU bfloat16 or float16).
const char* adam_lowp_problem(const at::Tensor& t);

// Fills a job from tensors that passed the checks above; `lowp` may be
// undefined (no copy).
AdamJob make_adam_job(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const at::Tensor& lowp, const AdamHyper* hyper);

// Runs every job in one parallel pass with the kernel of active_isa().
// Touches no Python or torch state, so it may run without the GIL.
void run_adam_jobs(const std::vector<AdamJob>& jobs);

}  // namespace shardopt
