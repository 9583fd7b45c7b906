// shardopt::stream_limit: the memory-bandwidth ceiling of a fused Adam step.
//
// Reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
// exp_avg_sq (28 bytes per parameter, Adam's real traffic) with no math
// worth the name, over the same one-pass multi-tensor structure and thread
// pool as adam_step. The benchmark judges adam_step against it. The buffers'
// contents are scrambled: it exists only to be timed.
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "multi_tensor.h"

namespace shardopt {
namespace {

void stream_limit_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "stream_limit: the four tensor lists must have the same length");
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->layout() == at::kStrided && t->numel() == params[i].numel(),
                  "stream_limit: tensor ", i, " of each list must be a contiguous float32 CPU tensor with ",
                  params[i].numel(), " elements");
    }
    numels[i] = params[i].numel();
  }
  parallel_over_tensors(numels, kDefaultGrain, [&](size_t i, int64_t begin, int64_t end) {
    float* __restrict p = params[i].data_ptr<float>();
    const float* __restrict g = grads[i].const_data_ptr<float>();
    float* __restrict m = exp_avgs[i].data_ptr<float>();
    float* __restrict v = exp_avg_sqs[i].data_ptr<float>();
    // A rotation plus one add: every load feeds a store to a different array,
    // so the compiler can elide none of the 28 bytes.
    for (int64_t k = begin; k < end; ++k) {
      const float pk = p[k], mk = m[k], vk = v[k];
      p[k] = vk;
      m[k] = pk;
      v[k] = mk + g[k];
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(shardopt, CPU, m) {
  m.impl("stream_limit", &stream_limit_cpu);
}

}  // namespace shardopt
