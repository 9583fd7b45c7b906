// shardopt::unscale_into on CUDA: dst = src / divisor cast to dst's dtype, and
// found = 1 if src holds an inf/nan, in one pass over the gradient (Note
// [Unscaling inside the reduction] in shardopt/precision.py). Same contract as
// the CPU kernel (csrc/precision/unscale.cpp); reference:
// shardopt.reference.unscale_into_reference (tests/test_cuda_sources.py checks
// the CPU kernel against it; this one shares its arithmetic, unscale_element.h).
// Built only when torch has CUDA; .ci/check-cuda-build compiles it against a
// CUDA build of torch and checks the kernel is in the binary. Never run here.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../precision/unscale.h"
#include "../precision/unscale_element.h"

namespace shardopt {
namespace {

// One element per thread per grid stride; the arithmetic is unscale_value's,
// the same as the CPU kernel's (Note [Unscale rounding] in unscale_element.h).
template <typename src_t, typename dst_t>
__global__ void unscale_kernel(const src_t* __restrict__ in, dst_t* __restrict__ out, int64_t n,
                               unscale_acc_t<src_t, dst_t> divisor, float* found) {
  using acc_t = unscale_acc_t<src_t, dst_t>;
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const src_t x = in[i];
    bad |= !isfinite(static_cast<acc_t>(x));
    out[i] = unscale_value<src_t, dst_t>(x, divisor);
  }
  // Any thread that saw one writes 1; the races all write the same value.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1.0f;
}

void unscale_into_cuda(const at::Tensor& src, const at::Tensor& dst, double divisor, const at::Tensor& found) {
  check_unscale_args(src, dst, divisor, found);
  const int64_t n = src.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  constexpr int threads = 256;
  const int64_t max_blocks = 4LL * at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 8;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, max_blocks));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "unscale_into_src", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "unscale_into_dst", [&] {
      using acc_t = unscale_acc_t<src_t, scalar_t>;
      unscale_kernel<src_t, scalar_t><<<blocks, threads, 0, stream>>>(
          src.data_ptr<src_t>(), dst.data_ptr<scalar_t>(), n, static_cast<acc_t>(divisor),
          found.data_ptr<float>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(shardopt, CUDA, m) { m.impl("unscale_into", &unscale_into_cuda); }

}  // namespace shardopt
