// The fused int8 codec's torch-facing half: argument checks, the choice of ISA
// variant (csrc/cpu_features.h) and the split of the blocks over threads.
// What it computes: Note [Fused int8 codec] in int8_codec.h.
#include "int8_codec.h"

#include <ATen/Parallel.h>
#include <cstdint>
#include <utility>

#include <c10/util/Exception.h>

#include "../cpu_features.h"

namespace shardopt::comm {

namespace {

// Blocks per task of at::parallel_for: 32768 values, as ATen's grain.
constexpr int64_t kGrainBlocks = (int64_t{1} << 15) / kInt8Block;

Int8EncodeFn encode_kernel() {
  switch (active_isa()) {
#if defined(SHARDOPT_HAVE_AVX512)
    case Isa::Avx512: return int8_encode_avx512;
#endif
#if defined(SHARDOPT_HAVE_AVX2)
    case Isa::Avx2: return int8_encode_avx2;
#endif
#if defined(SHARDOPT_HAVE_NEON)
    case Isa::Neon: return int8_encode_neon;
#endif
    default: return int8_encode_scalar;
  }
}

Int8DecodeFn decode_kernel() {
  switch (active_isa()) {
#if defined(SHARDOPT_HAVE_AVX512)
    case Isa::Avx512: return int8_decode_avx512;
#endif
#if defined(SHARDOPT_HAVE_AVX2)
    case Isa::Avx2: return int8_decode_avx2;
#endif
#if defined(SHARDOPT_HAVE_NEON)
    case Isa::Neon: return int8_decode_neon;
#endif
    default: return int8_decode_scalar;
  }
}

void check_values(const at::Tensor& t, const char* what, const char* name, int64_t m) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(),
                    what, ": ", name, " must be a contiguous 1-D float32 CPU tensor, got ", t.scalar_type(), " ",
                    t.sizes(), " on ", t.device());
  TORCH_CHECK_VALUE(t.numel() == m, what, ": ", name, " has ", t.numel(), " elements, expected ", m);
}

// The message's scales (at its start) and values.
std::pair<float*, int8_t*> message_parts(const at::Tensor& payload, int64_t m, const char* what) {
  TORCH_CHECK_VALUE(payload.device().is_cpu() && payload.scalar_type() == at::kByte && payload.dim() == 1 &&
                        payload.is_contiguous(),
                    what, ": the message must be a contiguous 1-D uint8 CPU tensor, got ", payload.scalar_type(),
                    " ", payload.sizes());
  TORCH_CHECK_VALUE(payload.numel() == int8_message_bytes(m), what, ": an int8 message of ", m, " values has ",
                    int8_message_bytes(m), " bytes, got ", payload.numel());
  auto* base = payload.data_ptr<uint8_t>();
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(base) % alignof(float) == 0, what,
                    ": the message must start at a 4-byte aligned address (its scales are float32)");
  return {reinterpret_cast<float*>(base), reinterpret_cast<int8_t*>(base + 4 * int8_num_blocks(m))};
}

}  // namespace

int64_t int8_num_blocks(int64_t m) {
  return (m + kInt8Block - 1) / kInt8Block;
}

int64_t int8_message_bytes(int64_t m) {
  return 4 * int8_num_blocks(m) + m;
}

void int8_encode(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& payload,
                 const at::Tensor& decoded) {
  constexpr const char* what = "int8 encode";
  const int64_t m = x.numel();
  check_values(x, what, "x", m);
  if (residual.defined()) check_values(residual, what, "the residual", m);
  if (decoded.defined()) check_values(decoded, what, "decoded", m);
  const auto [scale, q] = message_parts(payload, m, what);
  const Int8EncodeArgs args{x.data_ptr<float>(), residual.defined() ? residual.data_ptr<float>() : nullptr, scale,
                            q, decoded.defined() ? decoded.data_ptr<float>() : nullptr, m};
  const Int8EncodeFn kernel = encode_kernel();
  at::parallel_for(0, int8_num_blocks(m), kGrainBlocks,
                   [&](int64_t b0, int64_t b1) { kernel(&args, b0, b1); });
}

void int8_decode(const at::Tensor& payload, const at::Tensor& out, const at::Tensor& base) {
  constexpr const char* what = "int8 decode";
  const int64_t m = out.numel();
  check_values(out, what, "out", m);
  if (base.defined()) check_values(base, what, "base", m);
  const auto [scale, q] = message_parts(payload, m, what);
  const Int8DecodeArgs args{scale, q, out.data_ptr<float>(), base.defined() ? base.data_ptr<float>() : nullptr, m};
  const Int8DecodeFn kernel = decode_kernel();
  at::parallel_for(0, int8_num_blocks(m), kGrainBlocks,
                   [&](int64_t b0, int64_t b1) { kernel(&args, b0, b1); });
}

}  // namespace shardopt::comm
