// AVX-512 variant: 16 floats per iteration, scalar tail. Same operations in
// the same order as adam_element (Note [Adam operation order]): no FMA.
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// `__m512 __Y = __Y;` idiom) once inlined at -O3: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "adam_element.h"

namespace shardopt {
namespace {

static inline void store_bf16(uint16_t* out, __m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

static inline void store_fp16(uint16_t* out, __m512 p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// kAdamW: decoupled decay; kL2: grad += l2 * param. Both are compile-time so
// the loop carries no per-element branches.
template <bool kAdamW, bool kL2, int kLowp>
void run(const AdamHyper& h, const AdamTensor& t, int64_t begin, int64_t end) {
  const __m512 beta1 = _mm512_set1_ps(h.beta1), beta2 = _mm512_set1_ps(h.beta2);
  const __m512 c1 = _mm512_set1_ps(h.one_minus_beta1), c2 = _mm512_set1_ps(h.one_minus_beta2);
  const __m512 step_size = _mm512_set1_ps(h.step_size), bc2 = _mm512_set1_ps(h.bias_correction2_sqrt);
  const __m512 eps = _mm512_set1_ps(h.eps), l2 = _mm512_set1_ps(h.l2), decay = _mm512_set1_ps(h.decay);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 p = _mm512_loadu_ps(t.param + i);
    __m512 g = _mm512_loadu_ps(t.grad + i);
    if (kL2) g = _mm512_add_ps(g, _mm512_mul_ps(p, l2));
    if (kAdamW) p = _mm512_mul_ps(p, decay);
    const __m512 m = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(t.exp_avg + i), beta1), _mm512_mul_ps(g, c1));
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(t.exp_avg_sq + i), beta2),
                                   _mm512_mul_ps(_mm512_mul_ps(g, g), c2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
    _mm512_storeu_ps(t.exp_avg + i, m);
    _mm512_storeu_ps(t.exp_avg_sq + i, v);
    _mm512_storeu_ps(t.param + i, p);
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

void adam_kernel_avx512(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end) {
  if (h->adamw) return run_lowp<true, false>(*h, *t, begin, end);
  if (h->l2 != 0.0f) return run_lowp<false, true>(*h, *t, begin, end);
  run_lowp<false, false>(*h, *t, begin, end);
}

}  // namespace shardopt
