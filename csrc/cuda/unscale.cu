// shardopt::unscale_into on CUDA: dst = src / divisor cast to dst's dtype, and
// found = 1 if src holds an inf/nan, in one pass over the gradient (Note
// [Unscaling inside the reduction] in shardopt/precision.py). Same contract as
// the CPU kernel (csrc/precision/unscale.cpp); reference:
// shardopt.reference.unscale_into_reference. Built only when torch has CUDA;
// .ci/check-cuda-build compiles it against a CUDA build of torch.
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../precision/unscale.h"

namespace shardopt {
namespace {

template <typename src_t, typename dst_t, typename acc_t>
__global__ void unscale_kernel(const src_t* __restrict__ in, dst_t* __restrict__ out, int64_t n, acc_t divisor,
                               float* found) {
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const acc_t v = static_cast<acc_t>(in[i]);
    bad |= !isfinite(v);
    out[i] = static_cast<dst_t>(v / divisor);
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
      // fp32 math, or fp64 when either side is fp64 (an fp64 model).
      using acc_t = std::conditional_t<std::is_same_v<src_t, double> || std::is_same_v<scalar_t, double>,
                                       double, float>;
      unscale_kernel<src_t, scalar_t, acc_t><<<blocks, threads, 0, stream>>>(
          src.data_ptr<src_t>(), dst.data_ptr<scalar_t>(), n, static_cast<acc_t>(divisor),
          found.data_ptr<float>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(shardopt, CUDA, m) { m.impl("unscale_into", &unscale_into_cuda); }

}  // namespace shardopt
