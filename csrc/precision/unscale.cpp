// shardopt::unscale_into on CPU: dst = src / divisor, cast to dst's dtype, in
// one pass that also raises `found` if src holds an inf or nan.
//
// This is the copy the bucket engine makes of every gradient into its reduce
// buffer (Note [Unscaling inside the reduction] in shardopt/precision.py);
// the CUDA kernel is csrc/cuda/unscale.cu, the reference
// shardopt.reference.unscale_into_reference.
#include <atomic>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "unscale.h"
#include "unscale_element.h"

namespace shardopt {

void check_unscale_args(const at::Tensor& src, const at::Tensor& dst, double divisor, const at::Tensor& found) {
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "unscale_into: src and dst must be contiguous");
  TORCH_CHECK(src.numel() == dst.numel(), "unscale_into: src has ", src.numel(), " elements, dst ",
              dst.numel());
  TORCH_CHECK(src.device() == dst.device() && found.device() == src.device(),
              "unscale_into: src, dst and found must be on one device");
  TORCH_CHECK(found.numel() == 1 && found.scalar_type() == at::kFloat,
              "unscale_into: found must be a one-element float32 tensor");
  TORCH_CHECK(divisor > 0.0, "unscale_into: divisor must be > 0, got ", divisor);
  for (const auto* t : {&src, &dst}) {
    const auto st = t->scalar_type();
    TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble,
                "unscale_into: tensors must be float64, float32, bfloat16 or float16, got ", st);
  }
}

namespace {

void unscale_into_cpu(const at::Tensor& src, const at::Tensor& dst, double divisor, const at::Tensor& found) {
  check_unscale_args(src, dst, divisor, found);
  const int64_t n = src.numel();
  if (n == 0) return;
  std::atomic<bool> bad{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "unscale_into_src", [&] {
    using src_t = scalar_t;
    const src_t* in = src.data_ptr<src_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "unscale_into_dst", [&] {
      scalar_t* out = dst.data_ptr<scalar_t>();
      using acc_t = unscale_acc_t<src_t, scalar_t>;  // Note [Unscale rounding]
      const acc_t d = static_cast<acc_t>(divisor);
      at::parallel_for(0, n, 1 << 15, [&](int64_t lo, int64_t hi) {
        // v * 0 is 0 for every finite v and nan for inf/nan, so one sum tells
        // whether the range held a non-finite value, with no branch in the loop.
        acc_t probe = 0;
        for (int64_t i = lo; i < hi; ++i) {
          const acc_t v = static_cast<acc_t>(in[i]);
          probe += v * acc_t(0);
          out[i] = unscale_value<src_t, scalar_t>(in[i], d);
        }
        if (probe != probe) bad.store(true, std::memory_order_relaxed);
      });
    });
  });
  if (bad.load()) found.fill_(1.0);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardopt, CPU, m) { m.impl("unscale_into", &unscale_into_cpu); }

void unscale_into(const at::Tensor& src, const at::Tensor& dst, double divisor, const at::Tensor& found) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardopt::unscale_into", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, double, const at::Tensor&)>();
  op.call(src, dst, divisor, found);
}

}  // namespace shardopt
