// The per-element rule of shardopt::unscale_into, shared by the CPU kernel
// (unscale.cpp) and the CUDA kernel (csrc/cuda/unscale.cu), so that both round
// exactly alike; its reference is shardopt.reference.unscale_into_reference.
//
// Note [Unscale rounding]
// -----------------------
// dst = src / divisor: src is widened exactly to acc_t (fp32, or fp64 when
// either side is fp64: an fp64 model), the divisor is rounded once to acc_t,
// the division is IEEE (correctly rounded: no fast-math, no reciprocal), and
// the quotient is rounded once, to nearest even, into dst's dtype. A src
// element is non-finite (inf or nan) when its widened value is; each kernel
// tests that its own way (CPU: v * 0 is nan; CUDA: isfinite) with the same
// answer. A finite src whose quotient overflows dst (fp16) is not flagged:
// the divisor only ever shrinks values.
#pragma once

#include <type_traits>

#include <c10/macros/Macros.h>

namespace shardopt {

template <typename src_t, typename dst_t>
using unscale_acc_t =
    std::conditional_t<std::is_same_v<src_t, double> || std::is_same_v<dst_t, double>, double, float>;

template <typename src_t, typename dst_t>
C10_HOST_DEVICE inline dst_t unscale_value(src_t x, unscale_acc_t<src_t, dst_t> divisor) {
  return static_cast<dst_t>(static_cast<unscale_acc_t<src_t, dst_t>>(x) / divisor);
}

}  // namespace shardopt
