// The fused Adam/AdamW kernel's interface: plain C types only.
//
// This header is included both by the per-ISA kernel files (compiled with
// -mavx512f etc.) and by the torch-facing driver (cpu_adam.cpp). Per
// Note [ISA translation units] in setup.py it must stay free of torch/STL
// headers: only raw pointers, fixed-width integers and floats cross the
// boundary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardopt {

// Hyper-parameters of one step, already folded into the fp32 constants the
// inner loop uses. The caller computes them in double (bias corrections as in
// torch's fused Adam) and rounds each to float once.
struct AdamHyper {
  float beta1;
  float beta2;
  float one_minus_beta1;        // (float)(1 - beta1)
  float one_minus_beta2;        // (float)(1 - beta2)
  float step_size;              // lr / bias_correction1
  float bias_correction2_sqrt;  // sqrt(bias_correction2)
  float eps;
  float l2;                     // Adam (adamw == 0): grad += l2 * param; 0 disables
  float decay;                  // AdamW (adamw != 0): param *= decay = 1 - lr * weight_decay
  int adamw;
};

// Optional low-precision copy of the updated parameter, written in the same pass.
enum AdamLowp { kAdamLowpNone = 0, kAdamLowpBf16 = 1, kAdamLowpFp16 = 2 };

// One tensor's buffers (all of the same length). Indices passed to the kernel
// are element offsets into these.
struct AdamTensor {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* lowp;  // bf16/fp16 bits, or nullptr when lowp_kind == kAdamLowpNone
  int lowp_kind;
};

// Updates elements [begin, end) of `t` in one pass. One variant per ISA; each
// is bitwise identical to the scalar one (no FMA contraction anywhere, see
// Note [Adam operation order] in adam_element.h).
using AdamKernelFn = void (*)(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end);
void adam_kernel_scalar(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end);
void adam_kernel_avx2(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end);
void adam_kernel_avx512(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end);
void adam_kernel_neon(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end);

}  // namespace shardopt
