// NEON (aarch64) variant: 4 floats per iteration, scalar tail. Same operations
// in the same order as adam_element (Note [Adam operation order]): vmul/vadd,
// never vfma. Only built on aarch64; the guard keeps the file harmless if a
// build system hands it to an x86 compiler anyway.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "adam_element.h"

namespace shardopt {
namespace {

static inline void store_bf16(uint16_t* out, float32x4_t p) {
  const uint32x4_t u = vreinterpretq_u32_f32(p);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
  const uint32x4_t is_num = vceqq_f32(p, p);  // false only for NaN
  r = vbslq_u32(is_num, r, vdupq_n_u32(0x7FC0));
  vst1_u16(out, vmovn_u32(r));
}

static inline void store_fp16(uint16_t* out, float32x4_t p) {
  // FCVTN rounds with the FPCR mode, round-to-nearest-even by default.
  vst1_u16(out, vreinterpret_u16_f16(vcvt_f16_f32(p)));
}

template <bool kAdamW, bool kL2, int kLowp>
void run(const AdamHyper& h, const AdamTensor& t, int64_t begin, int64_t end) {
  const float32x4_t beta1 = vdupq_n_f32(h.beta1), beta2 = vdupq_n_f32(h.beta2);
  const float32x4_t c1 = vdupq_n_f32(h.one_minus_beta1), c2 = vdupq_n_f32(h.one_minus_beta2);
  const float32x4_t step_size = vdupq_n_f32(h.step_size), bc2 = vdupq_n_f32(h.bias_correction2_sqrt);
  const float32x4_t eps = vdupq_n_f32(h.eps), l2 = vdupq_n_f32(h.l2), decay = vdupq_n_f32(h.decay);
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    float32x4_t p = vld1q_f32(t.param + i);
    float32x4_t g = vld1q_f32(t.grad + i);
    if (kL2) g = vaddq_f32(g, vmulq_f32(p, l2));
    if (kAdamW) p = vmulq_f32(p, decay);
    const float32x4_t m = vaddq_f32(vmulq_f32(vld1q_f32(t.exp_avg + i), beta1), vmulq_f32(g, c1));
    const float32x4_t v = vaddq_f32(vmulq_f32(vld1q_f32(t.exp_avg_sq + i), beta2), vmulq_f32(vmulq_f32(g, g), c2));
    const float32x4_t denom = vaddq_f32(vdivq_f32(vsqrtq_f32(v), bc2), eps);
    p = vsubq_f32(p, vdivq_f32(vmulq_f32(step_size, m), denom));
    vst1q_f32(t.exp_avg + i, m);
    vst1q_f32(t.exp_avg_sq + i, v);
    vst1q_f32(t.param + i, p);
    if (kLowp == kAdamLowpBf16) store_bf16(t.lowp + i, p);
    if (kLowp == kAdamLowpFp16) store_fp16(t.lowp + i, p);
  }
  for (; i < end; ++i) adam_element(h, t, i);
}

template <bool kAdamW, bool kL2>
void run_lowp(const AdamHyper& h, const AdamTensor& t, int64_t begin, int64_t end) {
  switch (t.lowp_kind) {
    case kAdamLowpBf16: return run<kAdamW, kL2, kAdamLowpBf16>(h, t, begin, end);
    case kAdamLowpFp16: return run<kAdamW, kL2, kAdamLowpFp16>(h, t, begin, end);
    default: return run<kAdamW, kL2, kAdamLowpNone>(h, t, begin, end);
  }
}

}  // namespace

void adam_kernel_neon(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end) {
  if (h->adamw) return run_lowp<true, false>(*h, *t, begin, end);
  if (h->l2 != 0.0f) return run_lowp<false, true>(*h, *t, begin, end);
  run_lowp<false, false>(*h, *t, begin, end);
}

}  // namespace shardopt
#endif  // __aarch64__
