// The fused int8 codec's kernels: plain C types only.
//
// Included both by the per-ISA kernel files (int8_kernel.<isa>.cpp, compiled
// with -mavx2 etc.) and by the torch-facing driver (int8_codec.cpp); per
// Note [ISA translation units] in setup.py it stays free of torch/STL headers.
// What the kernels compute: Note [Fused int8 codec] in int8_codec.h.
#pragma once

#include <cstdint>

namespace shardopt::comm {

constexpr int64_t kInt8Block = 256;  // keep equal to shardopt/parallel/mesh_plan.py INT8_BLOCK

// One encode: numel values of x (plus the residual) into one scale per block
// and one int8 per value.
struct Int8EncodeArgs {
  const float* x;
  float* residual;  // error feedback: x + residual is encoded, then residual = what its rounding lost; or nullptr
  float* scale;     // out: one per block of kInt8Block
  int8_t* q;        // out: numel
  float* decoded;   // out, optional (nullptr): q * scale, what every receiver decodes; may be x itself
  int64_t numel;
};

// One decode: out = q * scale, or out = base + q * scale.
struct Int8DecodeArgs {
  const float* scale;
  const int8_t* q;
  float* out;
  const float* base;  // nullptr, or numel values (it may be out: out += decoded)
  int64_t numel;
};

// Each works on blocks [block_begin, block_end), so callers split the work by
// block. One variant per ISA, bitwise identical to the scalar one.
using Int8EncodeFn = void (*)(const Int8EncodeArgs* a, int64_t block_begin, int64_t block_end);
using Int8DecodeFn = void (*)(const Int8DecodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_encode_scalar(const Int8EncodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_decode_scalar(const Int8DecodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_encode_avx2(const Int8EncodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_decode_avx2(const Int8DecodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_encode_avx512(const Int8EncodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_decode_avx512(const Int8DecodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_encode_neon(const Int8EncodeArgs* a, int64_t block_begin, int64_t block_end);
void int8_decode_neon(const Int8DecodeArgs* a, int64_t block_begin, int64_t block_end);

}  // namespace shardopt::comm
