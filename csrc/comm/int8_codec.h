// The int8 codec of the inter-node hop (Note [Compressed inter-node hop] in
// replica_hop.h), fused: one pass to encode (with error feedback), one pass to
// decode (or decode and add).
//
// Note [Fused int8 codec]
// -----------------------
// A message of m values is [one fp32 scale per block of 256][m int8 values]
// (the last block may be short). Encoding x with residual r, per block:
//     v     = x + r                          fp32 (v = x without a residual)
//     scale = max|v| / 127                   fp32 division, as torch's amax(...) / 127.0
//     inv   = scale > 0 ? 1 / scale : 0      fp32 (a block of zeros encodes as zeros)
//     q     = clamp(round-half-to-even(v * inv), -127, 127), nan -> 0
//     d     = q * scale                      fp32: what every receiver decodes
//     r     = v - d                          the error fed back at the next hop
// and decoding is d = q * scale, written into out, or added to a base
// (out = base + d, fp32; base may be out).
// Every step is exact or one IEEE fp32 rounding (no FMA: the kernels are built
// with -ffp-contract=off), so the result is bitwise that of the pure-PyTorch
// reference (shardopt.reference: int8_block_encode_reference,
// int8_encode_feedback_reference, int8_decode_reference; tests/test_hybrid.py)
// and the same on every ISA variant. A nan or inf in a block makes its scale
// nan or inf, so the block decodes to nan/inf and the step's inf/nan check
// still sees it.
//
// Rounding: scale is a division (torch's is, for fp32 on CPU), the
// quantization a multiplication by its reciprocal, exactly as the composed
// ATen version did; a block whose scale is below 2^-128 (max|v| < ~4e-37) has
// an infinite reciprocal, so its non-zero values encode as +-127 (the error
// goes to the residual); kept as is, so that messages do not change.
//
// Why fused: composed from ATen ops, one hop's codec was ten passes over the
// chunk, each allocating (abs, amax, div, where, mul, round, clamp, cast,
// copies; then the decode again for the residual). Here encoding reads x and
// r once (and the block is in L1 for its second loop) and writes q, r and
// optionally d; decoding reads q and writes (or updates) out. Speed:
// benchmarks/bench_codec.py.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

#include "int8_kernel.h"

namespace shardopt::comm {

int64_t int8_num_blocks(int64_t m);
// Bytes of the message of m values: 4 per block + m.
int64_t int8_message_bytes(int64_t m);

// Encodes float32 `x` (1-D, contiguous, CPU) into `payload` (uint8,
// int8_message_bytes(x.numel()) bytes). `residual` (optional: undefined for
// none): float32, x's size; x + residual is encoded and residual becomes what
// the rounding lost. `decoded` (optional): float32, x's size, receives the
// decoded message; it may be x itself.
void int8_encode(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& payload,
                 const at::Tensor& decoded);
// Decodes `payload` (a message of out.numel() values) into float32 `out`
// (1-D, contiguous): out = decoded, or, given `base` (float32, out's size; it
// may be out itself, to add in place), out = base + decoded.
void int8_decode(const at::Tensor& payload, const at::Tensor& out, const at::Tensor& base);

}  // namespace shardopt::comm
