// The fused int8 codec's loops over one block, shared by every ISA file
// (int8_kernel.<isa>.cpp). Plain loops that GCC and Clang vectorise at the
// width of the file's flags; every operation is exact or a single IEEE fp32
// rounding, and ISA files are compiled with -ffp-contract=off, so every
// variant gives the bits of the scalar one (and of shardopt.reference).
//
// Everything here has internal linkage (anonymous namespace, `static inline`):
// each ISA translation unit gets its own copy compiled with its own flags
// (Note [ISA translation units] in setup.py).
#pragma once

#include <cstdint>

#include "int8_kernel.h"

namespace shardopt::comm {
namespace {

static inline uint32_t int8_float_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
}

static inline float int8_bits_float(uint32_t u) {
  float x;
  __builtin_memcpy(&x, &u, sizeof x);
  return x;
}

// round-half-to-even(y) clamped to [-127, 127], nan -> 0, as an int8
// (Note [Fused int8 codec], "Rounding"). Worked on |y| and the sign apart, in
// integer operations on the bits, because GCC does not vectorise a float
// select that guards a float operation (it might trap) without
// -fno-trapping-math:
//   - a nan (bits of |y| above inf's) becomes 0, by a mask;
//   - |y| > 127 (inf included) becomes 127: for non-negative floats the order
//     of the bits is the order of the values, so an unsigned minimum. Clamping
//     before rounding gives what rounding before clamping gives (rounding is
//     monotone and keeps integers);
//   - |y| <= 127 < 2^22 is rounded to an integer by adding and subtracting
//     1.5 * 2^23: one IEEE addition, ties to even (1.5 * 2^23 is even), as
//     nearbyint does, with no call and no SSE4.1;
//   - the sign goes back on: round-half-to-even is symmetric.
static inline int8_t int8_round(float y) {
  const uint32_t u = int8_float_bits(y);
  uint32_t a = u & 0x7FFFFFFFu;
  a &= ~static_cast<uint32_t>(static_cast<int32_t>(0x7F800000u - a) >> 31);  // nan -> +0
  a = a < 0x42FE0000u ? a : 0x42FE0000u;                                     // 127.0f
  constexpr float kMagic = 12582912.0f;                                       // 1.5 * 2^23
  const int32_t r = static_cast<int32_t>((int8_bits_float(a) + kMagic) - kMagic);
  const int32_t sign = static_cast<int32_t>(u) >> 31;  // 0 or -1
  return static_cast<int8_t>((r ^ sign) - sign);
}

// Encodes elements [lo, lo + n) (one block, n <= kInt8Block) of a.
template <bool kFeedback, bool kDecoded>
static inline void int8_encode_block(const Int8EncodeArgs& a, int64_t block, int64_t lo, int64_t n) {
  float v[kInt8Block];
  const float* x = a.x + lo;
  float* res = a.residual + (kFeedback ? lo : 0);
  // max |v| as the maximum of the bit patterns with the sign cleared: for
  // non-negative floats their order, and a nan is above inf, so a block with
  // a nan gets a nan scale, as torch's amax gives. An integer maximum
  // vectorises without -ffast-math.
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float t = kFeedback ? x[i] + res[i] : x[i];
    v[i] = t;
    const uint32_t m = int8_float_bits(t) & 0x7FFFFFFFu;
    top = m > top ? m : top;
  }
  const float scale = int8_bits_float(top) / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;  // a block of zeros (or a nan scale) encodes as zeros
  a.scale[block] = scale;
  int8_t* q = a.q + lo;
  float* dec = a.decoded + (kDecoded ? lo : 0);
  for (int64_t i = 0; i < n; ++i) {
    const int8_t k = int8_round(v[i] * inv);
    q[i] = k;
    if (kFeedback || kDecoded) {
      const float d = static_cast<float>(k) * scale;
      if (kFeedback) res[i] = v[i] - d;
      if (kDecoded) dec[i] = d;
    }
  }
}

template <bool kFeedback, bool kDecoded>
static inline void int8_encode_blocks(const Int8EncodeArgs& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t n = a.numel - lo < kInt8Block ? a.numel - lo : kInt8Block;
    int8_encode_block<kFeedback, kDecoded>(a, b, lo, n);
  }
}

static inline void int8_encode_range(const Int8EncodeArgs* a, int64_t b0, int64_t b1) {
  if (a->residual) {
    if (a->decoded) return int8_encode_blocks<true, true>(*a, b0, b1);
    return int8_encode_blocks<true, false>(*a, b0, b1);
  }
  if (a->decoded) return int8_encode_blocks<false, true>(*a, b0, b1);
  int8_encode_blocks<false, false>(*a, b0, b1);
}

template <bool kBase>
static inline void int8_decode_blocks(const Int8DecodeArgs& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t n = a.numel - lo < kInt8Block ? a.numel - lo : kInt8Block;
    const float scale = a.scale[b];
    const int8_t* q = a.q + lo;
    const float* base = a.base + (kBase ? lo : 0);
    float* out = a.out + lo;
    for (int64_t i = 0; i < n; ++i) {
      const float d = static_cast<float>(q[i]) * scale;
      out[i] = kBase ? base[i] + d : d;
    }
  }
}

static inline void int8_decode_range(const Int8DecodeArgs* a, int64_t b0, int64_t b1) {
  if (a->base) return int8_decode_blocks<true>(*a, b0, b1);
  int8_decode_blocks<false>(*a, b0, b1);
}

}  // namespace
}  // namespace shardopt::comm
