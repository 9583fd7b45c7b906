// The per-element Adam update and the fp32 -> bf16/fp16 conversions, shared by
// every ISA file as the scalar loop or vector tail.
//
// Everything here is `static inline` (internal linkage): each ISA translation
// unit gets its own copy compiled with its own flags, so the linker can never
// pick an AVX-512 copy for a scalar caller (Note [ISA translation units]).
//
// Note [Adam operation order]
// The update follows torch's fused CPU Adam (aten/src/ATen/native/cpu/
// FusedAdamKernel.cpp) step for step, in fp32, each operation rounded on its
// own:
//     g  = grad (+ l2 * param, Adam only)
//     p  = param (* decay, AdamW only)
//     m  = m * beta1 + g * (1 - beta1)
//     v  = v * beta2 + (g * g) * (1 - beta2)
//     p  = p - (step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
// The vector variants use the same separate mul/add/div/sqrt instructions (all
// correctly rounded in IEEE fp32) and never FMA, and the ISA files are
// compiled with -ffp-contract=off, so every variant produces the same bits as
// the scalar one. Against torch.optim.Adam(W)'s default (single-tensor) path
// the results differ by a few ulps: it uses lerp for m, addcdiv for p, and a
// fused multiply-add for the L2 term.
#pragma once

#include <cstdint>

#include "adam_kernel.h"

namespace shardopt {
namespace {

static inline uint32_t float_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
}

// Round to nearest even, NaN -> canonical quiet NaN; the same bits as
// c10::BFloat16(float).
static inline uint16_t fp32_to_bf16(float x) {
  if (x != x) return 0x7FC0;
  uint32_t u = float_bits(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16, round to nearest even, overflow -> inf, subnormals kept;
// the same bits as F16C's vcvtps2ph and c10::Half(float).
static inline uint16_t fp32_to_fp16(float x) {
  uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7FFFFFFFu;
  if (u >= 0x7F800000u) {  // inf or NaN (NaN stays quiet, top payload bits kept)
    return u == 0x7F800000u ? (sign | 0x7C00u)
                            : static_cast<uint16_t>(sign | 0x7E00u | ((u >> 13) & 0x3FFu));
  }
  if (u >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds past 65504: inf
  if (u < 0x38800000u) {                        // below 2^-14: fp16 subnormal or zero
    if (u <= 0x33000000u) return sign;          // <= 2^-25 (half of the smallest subnormal): 0
    const uint32_t mant = (u & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - (u >> 23);    // 14..24: value in units of 2^-24
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  // Normal: re-bias the exponent (127 -> 15) and round the mantissa 23 -> 10
  // bits; a carry out of the mantissa correctly bumps the exponent.
  const uint32_t r = (u + 0x0FFFu + ((u >> 13) & 1u)) - 0x38000000u;
  return static_cast<uint16_t>(sign | (r >> 13));
}

static inline void adam_element(const AdamHyper& h, const AdamTensor& t, int64_t i) {
  float p = t.param[i];
  float g = t.grad[i];
  if (!h.adamw && h.l2 != 0.0f) g = g + p * h.l2;
  if (h.adamw) p = p * h.decay;
  const float m = t.exp_avg[i] * h.beta1 + g * h.one_minus_beta1;
  const float v = t.exp_avg_sq[i] * h.beta2 + (g * g) * h.one_minus_beta2;
  const float denom = __builtin_sqrtf(v) / h.bias_correction2_sqrt + h.eps;
  p = p - (h.step_size * m) / denom;
  t.exp_avg[i] = m;
  t.exp_avg_sq[i] = v;
  t.param[i] = p;
  if (t.lowp_kind == kAdamLowpBf16) t.lowp[i] = fp32_to_bf16(p);
  else if (t.lowp_kind == kAdamLowpFp16) t.lowp[i] = fp32_to_fp16(p);
}

}  // namespace
}  // namespace shardopt
