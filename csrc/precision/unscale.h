// Gradient copy with unscaling and an inf/nan check (shardopt::unscale_into).
#pragma once

#include <ATen/ATen.h>

namespace shardopt {

// dst = src / divisor (cast to dst's dtype); sets found (one float32 element)
// to 1 if src holds an inf or nan, and leaves it alone otherwise. dst may be
// src. Calls the op through the dispatcher, so a CUDA tensor runs the CUDA kernel.
void unscale_into(const at::Tensor& src, const at::Tensor& dst, double divisor, const at::Tensor& found);

// The argument checks every backend's kernel shares.
void check_unscale_args(const at::Tensor& src, const at::Tensor& dst, double divisor, const at::Tensor& found);

}  // namespace shardopt
