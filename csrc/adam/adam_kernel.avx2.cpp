// AVX2 variant: 8 floats per iteration, scalar tail. Same operations in the
// same order as adam_element (Note [Adam operation order]): no FMA. fp16
// output uses F16C, which AVX2-era CPUs all have (cpu_features checks it).
#include <immintrin.h>

#include "adam_element.h"

namespace shardopt {
namespace {

static inline void store_bf16(uint16_t* out, __m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Every lane now fits in 16 bits, so the saturating pack is exact.
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

static inline void store_fp16(uint16_t* out, __m256 p) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
}

template <bool kAdamW, bool kL2, int kLowp>
void run(const AdamHyper& h, const AdamTensor& t, int64_t begin, int64_t end) {
  const __m256 beta1 = _mm256_set1_ps(h.beta1), beta2 = _mm256_set1_ps(h.beta2);
  const __m256 c1 = _mm256_set1_ps(h.one_minus_beta1), c2 = _mm256_set1_ps(h.one_minus_beta2);
  const __m256 step_size = _mm256_set1_ps(h.step_size), bc2 = _mm256_set1_ps(h.bias_correction2_sqrt);
  const __m256 eps = _mm256_set1_ps(h.eps), l2 = _mm256_set1_ps(h.l2), decay = _mm256_set1_ps(h.decay);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 p = _mm256_loadu_ps(t.param + i);
    __m256 g = _mm256_loadu_ps(t.grad + i);
    if (kL2) g = _mm256_add_ps(g, _mm256_mul_ps(p, l2));
    if (kAdamW) p = _mm256_mul_ps(p, decay);
    const __m256 m = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(t.exp_avg + i), beta1), _mm256_mul_ps(g, c1));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(t.exp_avg_sq + i), beta2),
                                   _mm256_mul_ps(_mm256_mul_ps(g, g), c2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m), denom));
    _mm256_storeu_ps(t.exp_avg + i, m);
    _mm256_storeu_ps(t.exp_avg_sq + i, v);
    _mm256_storeu_ps(t.param + i, p);
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

void adam_kernel_avx2(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end) {
  if (h->adamw) return run_lowp<true, false>(*h, *t, begin, end);
  if (h->l2 != 0.0f) return run_lowp<false, true>(*h, *t, begin, end);
  run_lowp<false, false>(*h, *t, begin, end);
}

}  // namespace shardopt
