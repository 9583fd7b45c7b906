// The one TORCH_LIBRARY(shardopt) block: every op's schema is declared here so
// the whole op surface of the extension reads in one place. Kernels register
// with TORCH_LIBRARY_IMPL next to their implementation, and fake (meta)
// kernels for torch.compile / opcheck live in shardopt/_ops.py.
#include <torch/library.h>

TORCH_LIBRARY(shardopt, m) {
  // Fused Adam/AdamW over many tensors in one pass (csrc/adam/cpu_adam.cpp).
  // `step` counts this step (>= 1); lowp_out is [] or one bf16/fp16 tensor
  // per param that receives a copy of the updated param.
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] lowp_out, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adamw, float step, bool bias_correction) -> ()");
  // Adam's memory traffic with no math: the bandwidth ceiling adam_step is
  // judged against (csrc/adam/stream_limit.cpp).
  m.def(
      "stream_limit(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs) -> ()");
  // dst = src / divisor cast to dst's dtype, and found = 1 if src holds an
  // inf/nan: the bucket engine's gradient copy (csrc/precision/unscale.cpp,
  // csrc/cuda/unscale.cu). dst may alias src.
  m.def("unscale_into(Tensor src, Tensor(a!) dst, float divisor, Tensor(b!) found) -> ()");
}
