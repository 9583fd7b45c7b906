// The fused 1-bit codec: what it computes is Note [Fused 1-bit codec] in
// onebit_codec.h. Plain C++ loops, split over threads by block.
#include "onebit_codec.h"

#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

namespace shardopt::comm {

namespace {

// Blocks per task of at::parallel_for: about 32768 values, as ATen's grain.
int64_t grain(int64_t block) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / block);
}

int64_t num_blocks(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

void check_block(int64_t block, const char* what) {
  TORCH_CHECK_VALUE(block > 0 && block % 8 == 0 && block <= (int64_t{1} << 20), what,
                    ": the block must be a positive multiple of 8 (its signs then fill whole bytes), at most 2^20; "
                    "got ", block);
}

void check_onebit_values(const at::Tensor& t, const char* what, const char* name, int64_t n) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(),
                    what, ": ", name, " must be a contiguous 1-D float32 CPU tensor, got ", t.scalar_type(), " ",
                    t.sizes(), " on ", t.device());
  TORCH_CHECK_VALUE(t.numel() == n, what, ": ", name, " has ", t.numel(), " elements, expected ", n);
}

uint8_t* message(const at::Tensor& payload, int64_t n, int64_t block, const char* what) {
  TORCH_CHECK_VALUE(payload.device().is_cpu() && payload.scalar_type() == at::kByte && payload.dim() == 1 &&
                        payload.is_contiguous(),
                    what, ": the message must be a contiguous 1-D uint8 CPU tensor, got ", payload.scalar_type(),
                    " ", payload.sizes());
  TORCH_CHECK_VALUE(payload.numel() == onebit_message_bytes(n, block), what, ": a 1-bit message of ", n,
                    " values in blocks of ", block, " has ", onebit_message_bytes(n, block), " bytes, got ",
                    payload.numel());
  return payload.data_ptr<uint8_t>();
}

// Blocks [b0, b1): scales are memcpy'd (a message inside a row of messages need not be 4-byte aligned).
// Templated on the optional outputs so that the loops carry no per-element branches.
template <bool kResidual, bool kDecoded>
void encode_blocks(const float* x, float* residual, uint8_t* msg, float* decoded, int64_t n, int64_t block,
                   float gain, int64_t b0, int64_t b1) {
  uint8_t* bits = msg + 4 * num_blocks(n, block);
  std::vector<float> buffer(static_cast<size_t>(block));
  float* v = buffer.data();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block;
    const int64_t c = std::min(block, n - lo);
    const float* xb = x + lo;
    if constexpr (kResidual) {
      const float* rb = residual + lo;
      for (int64_t i = 0; i < c; ++i) v[i] = xb[i] + rb[i];
    } else {
      std::memcpy(v, xb, sizeof(float) * static_cast<size_t>(c));
    }
    double sum = 0.0;  // in element order: the reference's order
    for (int64_t i = 0; i < c; ++i) sum += std::fabs(static_cast<double>(v[i]));
    const float scale = static_cast<float>(sum / static_cast<double>(c)) * gain;  // fp32 product
    std::memcpy(msg + 4 * b, &scale, sizeof(float));
    const float pm[2] = {-scale, scale};
    // lo is a multiple of 8: the block's bytes are its own.
    for (int64_t i = 0; i < c; i += 8) {
      const int64_t e = std::min<int64_t>(8, c - i);
      uint8_t byte = 0;
      for (int64_t k = 0; k < e; ++k) byte |= static_cast<uint8_t>(v[i + k] >= 0.0f) << k;
      bits[(lo + i) / 8] = byte;
      for (int64_t k = 0; k < e; ++k) {
        const float d = pm[(byte >> k) & 1];
        if constexpr (kResidual) residual[lo + i + k] = v[i + k] - d;
        if constexpr (kDecoded) decoded[lo + i + k] = d;
      }
    }
  }
}

enum class Decoded { kOut, kPlusBase, kTimes };

template <Decoded kHow>
void decode_blocks(const uint8_t* msg, float* out, const float* other, int64_t n, int64_t block, int64_t b0,
                   int64_t b1) {
  const uint8_t* bits = msg + 4 * num_blocks(n, block);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block;
    const int64_t c = std::min(block, n - lo);
    float scale;
    std::memcpy(&scale, msg + 4 * b, sizeof(float));
    const float pm[2] = {-scale, scale};
    for (int64_t i = 0; i < c; i += 8) {
      const uint8_t byte = bits[(lo + i) / 8];
      const int64_t e = std::min<int64_t>(8, c - i);
      float* o = out + lo + i;
      for (int64_t k = 0; k < e; ++k) {
        if constexpr (kHow == Decoded::kPlusBase) {
          o[k] = other[lo + i + k] + pm[(byte >> k) & 1];
        } else if constexpr (kHow == Decoded::kTimes) {
          o[k] = pm[(byte >> k) & 1] * other[lo + i + k];
        } else {
          o[k] = pm[(byte >> k) & 1];
        }
      }
    }
  }
}

}  // namespace

int64_t onebit_message_bytes(int64_t n, int64_t block) {
  check_block(block, "onebit_message_bytes");
  return 4 * num_blocks(n, block) + (n + 7) / 8;
}

void onebit_encode(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& payload,
                   const at::Tensor& decoded, int64_t block, double gain) {
  constexpr const char* what = "1-bit encode";
  check_block(block, what);
  TORCH_CHECK_VALUE(gain > 0.0 && gain < 2.0, what,
                    ": the scale's gain must be in (0, 2) (Note [Fused 1-bit codec]), got ", gain);
  const int64_t n = x.numel();
  check_onebit_values(x, what, "x", n);
  if (residual.defined()) check_onebit_values(residual, what, "the residual", n);
  if (decoded.defined()) check_onebit_values(decoded, what, "decoded", n);
  uint8_t* msg = message(payload, n, block, what);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.defined() ? residual.data_ptr<float>() : nullptr;
  float* dp = decoded.defined() ? decoded.data_ptr<float>() : nullptr;
  const float g = static_cast<float>(gain);
  auto kernel = rp ? (dp ? encode_blocks<true, true> : encode_blocks<true, false>)
                  : (dp ? encode_blocks<false, true> : encode_blocks<false, false>);
  at::parallel_for(0, num_blocks(n, block), grain(block),
                   [&](int64_t b0, int64_t b1) { kernel(xp, rp, msg, dp, n, block, g, b0, b1); });
}

void onebit_decode(const at::Tensor& payload, const at::Tensor& out, const at::Tensor& base, int64_t block,
                   const at::Tensor& times) {
  constexpr const char* what = "1-bit decode";
  check_block(block, what);
  TORCH_CHECK_VALUE(!(base.defined() && times.defined()), what, ": give a base (out = base + decoded) or times "
                    "(out = decoded * times), not both");
  const int64_t n = out.numel();
  check_onebit_values(out, what, "out", n);
  if (base.defined()) check_onebit_values(base, what, "base", n);
  if (times.defined()) check_onebit_values(times, what, "times", n);
  const uint8_t* msg = message(payload, n, block, what);
  float* op = out.data_ptr<float>();
  const float* other = base.defined() ? base.data_ptr<float>() : times.defined() ? times.data_ptr<float>() : nullptr;
  auto kernel = base.defined() ? decode_blocks<Decoded::kPlusBase>
                               : times.defined() ? decode_blocks<Decoded::kTimes> : decode_blocks<Decoded::kOut>;
  at::parallel_for(0, num_blocks(n, block), grain(block),
                   [&](int64_t b0, int64_t b1) { kernel(msg, op, other, n, block, b0, b1); });
}

void onebit_local_momentum(const at::Tensor& grad, const at::Tensor& local, const at::Tensor& denom, double a,
                           double beta1, const at::Tensor& x) {
  constexpr const char* what = "1-bit local momentum";
  const int64_t n = local.numel();
  check_onebit_values(grad, what, "grad", n);
  check_onebit_values(local, what, "the local momentum", n);
  check_onebit_values(denom, what, "the denominator", n);
  check_onebit_values(x, what, "x", n);
  const float* gp = grad.data_ptr<float>();
  const float* dp = denom.data_ptr<float>();
  float* mp = local.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  // The scalars in fp32, as ATen's fp32 ops take a Python float.
  const float af = static_cast<float>(a);
  const float bf = static_cast<float>(beta1);
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float decayed = mp[i] * bf;
      const float added = gp[i] * af;
      const float m = decayed + added;
      mp[i] = m;
      xp[i] = m / dp[i];
    }
  });
}

}  // namespace shardopt::comm
