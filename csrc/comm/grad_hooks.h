// The gradient hooks of ShardedDDP at stages 1 and 2, in C++.
//
// Note [Gradient hooks in C++]
// ----------------------------
// Each managed parameter's gradient accumulator (its AccumulateGrad node)
// gets a pre hook and a post hook, as torch's DDP Reducer hooks it, so the
// per-parameter path of a backward pass never enters Python:
//  * pre hook (before autograd accumulates into p.grad): the first one of a
//    backward pass (a new autograd graph task) calls `begin` in Python once,
//    with the GIL. That takes in what user code did to p.grad, takes the
//    pass's ShardedGrads out of p.grad (autograd must not accumulate into
//    one: Note [Sharded p.grad] in shardopt/sharded_grad.py), queues the
//    end-of-backward callbacks and answers what this pass does with the
//    gradients: kReduce, kNoteUsed (no_sync; OneBitAdam's compressing phase)
//    or kIgnore.
//  * post hook (p.grad is complete): kReduce hands p.grad to the bucket
//    engine (mark_ready; no GIL), then stage 1 puts back the flat-buffer view
//    if user code replaced p.grad (the engine copied its value in), stage 2
//    releases p.grad (the shard holds the reduced gradient); kNoteUsed only
//    notes the parameter used (its gradient accumulates in p.grad).
// The hooks hold the engine and the parameters but nothing of Python except
// `begin`, which holds the wrapper weakly (Note [Hooks die with the wrapper]
// in shardopt/ddp.py); remove() (the wrapper's finalizer) takes them off
// the accumulators. Stage 3 keeps Python hooks (its parameter shards need
// Python per parameter anyway: ParamShard.grad_ready).
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include "bucket_engine.h"

namespace shardopt {

// p.grad = grads[i] (None: no gradient) for every i, in one call: the
// per-step passes of shardopt/grad_sync.py over thousands of parameters.
void set_grads(const std::vector<at::Tensor>& params, const std::vector<std::optional<at::Tensor>>& grads);

enum class PassMode : int64_t { kReduce = 0, kNoteUsed = 1, kIgnore = 2 };

class GradHooks {
 public:
  // params: the optimizer's parameters (engine indices); views: stage 1's
  // flat-buffer views, one per parameter (empty at stage 2); begin: called
  // once per backward pass with the GIL, returns a PassMode as int.
  GradHooks(std::vector<at::Tensor> params, std::shared_ptr<BucketEngine> engine, std::vector<at::Tensor> views,
            int64_t stage, pybind11::object begin);
  ~GradHooks();
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;

  // Takes every hook off (idempotent).
  void remove();
  // Hooks installed (2 per parameter until remove()).
  int64_t num_hooks() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  // What torch's grad_accumulator() returns: a shared_ptr<Node> up to torch 2.12,
  // an intrusive_ptr<Node> from 2.13 on (the GPU image's torch is 2.11).
  using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<AccumulatorPtr> accumulators_;
  std::vector<torch::autograd::FunctionPreHook*> pre_hooks_;
  std::vector<uintptr_t> post_keys_;
};

}  // namespace shardopt
