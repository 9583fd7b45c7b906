// OneBitAdam's 1-bit format (Note [1-bit format] in shardopt/onebit.py), fused:
// one pass to encode a message with error feedback, one to decode it (or
// decode and add).
//
// Note [Fused 1-bit codec]
// ------------------------
// A message of n values is [one fp32 scale per block (1024 by default; any
// multiple of 8)][ceil(n / 8)
// bytes of signs] (the last block may be short; element 8k+i is bit i of byte
// k). Encoding x with residual r, per block of c values:
//     v     = x + r                      fp32 (v = x without a residual)
//     scale = fp32(S / c) * gain         S = the fp64 sum of |v| in element
//                                        order (the mean |v|); the product
//                                        in fp32; gain 1 by default, in (0, 2)
//     bit   = v >= 0                     (nan -> 0)
//     d     = bit ? scale : -scale       what every receiver decodes
//     r     = v - d                      fp32: the error fed back next time
// and decoding writes d into out, adds it to a base (out = base + d, fp32) or
// multiplies it by a factor per element (out = d * t, fp32: the momentum is d
// times the decoded x / d).
// Every step is exact or one IEEE rounding, and S is summed in a fixed order,
// so the result is bitwise that of the pure-PyTorch reference
// (shardopt.reference: onebit_encode_reference, onebit_decode_reference,
// onebit_encode_feedback_reference; tests/test_onebit.py). A nan or inf in a
// block makes its scale nan or inf (the step checks for them before encoding).
// Why a gain below 2: with error feedback the residual of a block is
// r' = v - gain * mean|v| * sign(v), and |r'|^2 = |v|^2 - c mean|v|^2 gain (2 - gain),
// less than |v|^2 for any gain in (0, 2): every encode shrinks what it is given
// (gain 1 the most; Note [The gains of the 1-bit scales] in shardopt/onebit.py
// says why OneBitAdam takes more).
//
// Why fused: in ATen ops an encode is a dozen passes with allocations (abs,
// the block sums in fp64, the bit packing as a multiply-and-sum over
// bytes, the decode again for the residual), most of OneBitAdam's step on
// the emulated cluster (measured in benchmarks/results/); here x and r are
// read once and the block stays in L1 for its second loop.
//
// Note [The local momentum in one pass]
// -------------------------------------
// What a rank encodes at a compressing step (Note [1-bit Adam under ZeRO] in
// shardopt/onebit.py) is its local momentum over the frozen denominator d:
//     m = m * b1 + g * a        a = (1 - b1) * the clipping coefficient
//     x = m / d
// in fp32, each product, sum and quotient one IEEE rounding in that order (the
// PyTorch ops g.mul(a), m.mul_(b1).add_(...), m / d give the same bits:
// shardopt.reference.onebit_local_momentum_reference). Four ATen passes with
// a temporary take a fifth of the hybrid step on the emulated cluster
// (measured in benchmarks/results/); here one pass reads g, m, d and writes
// m and x. Every unit is compiled with -ffp-contract=off (setup.py
// COMMON_FLAGS): no product and sum may be contracted into one rounding.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace shardopt::comm {

constexpr int64_t kOneBitBlock = 1024;  // keep equal to shardopt/onebit.py ONEBIT_BLOCK

int64_t onebit_message_bytes(int64_t n, int64_t block = kOneBitBlock);

// Encodes float32 `x` (1-D, contiguous, CPU) into `payload` (uint8, 1-D,
// onebit_message_bytes(x.numel(), block) bytes, any alignment). `residual`
// (optional, undefined for none): float32, x's size; x + residual is encoded
// and residual becomes what the encoding lost. `decoded` (optional): float32,
// x's size, receives the decoded message; it may be x itself. `gain`: each
// block's scale is its mean |v| times gain (in fp32), 0 < gain < 2.
void onebit_encode(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& payload,
                   const at::Tensor& decoded, int64_t block = kOneBitBlock, double gain = 1.0);
// Decodes `payload` (a message of out.numel() values) into float32 `out`
// (1-D, contiguous): out = decoded, or, given `base` (float32, out's size; it
// may be out itself), out = base + decoded.
// Given `times` instead (float32, out's size), out = decoded * times.
void onebit_decode(const at::Tensor& payload, const at::Tensor& out, const at::Tensor& base,
                   int64_t block = kOneBitBlock, const at::Tensor& times = at::Tensor());
// Note [The local momentum in one pass]: local = local * beta1 + grad * a and
// x = local / denom, float32, 1-D, contiguous, all of one size; local in place.
void onebit_local_momentum(const at::Tensor& grad, const at::Tensor& local, const at::Tensor& denom, double a,
                           double beta1, const at::Tensor& x);

}  // namespace shardopt::comm
