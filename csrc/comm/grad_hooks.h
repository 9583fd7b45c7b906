// The gradient hooks of ShardedDDP, in C++: where each parameter's gradient goes (GradRoute).
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
//    engine (mark_ready; no GIL), then kKeepInFlatBuffer puts back the
//    flat-buffer view if user code replaced p.grad (the engine copied its
//    value in), kRelease releases p.grad (the shard holds the reduced
//    gradient); kNoteUsed only
//    notes the parameter used (its gradient accumulates in p.grad).
// The hooks hold the engine and the parameters but nothing of Python except
// `begin`, which holds the wrapper weakly (Note [Hooks die with the wrapper]
// in shardopt/ddp.py); remove() (the wrapper's finalizer) takes them off
// the accumulators.
//
// Note [Stage 3's gradient hooks in C++]
// --------------------------------------
// With kBeforeAccumulation (stage 3) Python runs once per pass (`begin`) and
// once per bucket (`bucket_done`): a Python hook per parameter costs about
// 29 us on a GPU, where autograd's device thread takes the GIL for each. Each
// parameter has one C++ hook that does the rest *before* accumulation:
//  * it hands the incoming gradient to the bucket engine itself (kReduce),
//    or adds it to p.grad itself (kNoteUsed: no_sync, OneBitAdam's local
//    phase), and returns no gradient, so AccumulateGrad has nothing to do;
//    then
//  * the backward round's count of parameters still without a gradient, per
//    bucket, which the store arms when its backward round begins (arm) and
//    disarms when the round closes: a bucket whose count reaches zero is
//    handed to `bucket_done` (the store frees it).
// Nothing is accumulated into a stage-3 parameter, so AccumulateGrad's shape
// check never meets a parameter whose bucket is not gathered (Note [Gradients
// of parameters not gathered] in shardopt/zero3/buckets.py).
//
// Why a hook on the *tensor*, not on its AccumulateGrad node as the other
// routes: a parameter holds its accumulator weakly and autograd makes a new one
// when the old is gone; torch.compile's graphs (after a recompile) feed
// accumulators of their own. A node hook is lost with its node, while
// autograd reads a tensor's pre hooks from the tensor (autograd meta) each
// time any of its accumulators runs. Two caveats: Python's first
// `p.register_hook(...)` on a leaf replaces the tensor's pre-hook list (its
// setter clears it), so ensure() (after each forward) puts ours back, behind
// the user's, which then run first and see the gradient; and a call that
// only captures a gradient (torch.autograd.grad) must get it, so the hook
// acts only when the graph task will run the parameter's accumulator.
// The counts and the mode are read under one mutex; Python is called without
// it held (it may arm or disarm).
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

// Where a reduced parameter's full-size gradient goes.
enum class GradRoute : int64_t {
  kKeepInFlatBuffer = 0,    // p.grad is a view of the engine's flat gradient buffer and stays one
  kRelease = 1,             // the engine copies p.grad into staging; p.grad is released
  kBeforeAccumulation = 2,  // a hook on the tensor hands the gradient over before AccumulateGrad runs
};

class GradHooks {
 public:
  // params: the optimizer's parameters (engine indices); views: the
  // flat-buffer views, one per parameter (kKeepInFlatBuffer; else empty);
  // begin: called once per backward pass with the GIL, returns a PassMode as int.
  GradHooks(std::vector<at::Tensor> params, std::shared_ptr<BucketEngine> engine, std::vector<at::Tensor> views,
            GradRoute route, pybind11::object begin);
  ~GradHooks();
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;

  // kBeforeAccumulation (Note [Stage 3's gradient hooks in C++]): each parameter's buckets, and
  // bucket_done(b) (called with the GIL when bucket b's count reaches zero).
  void count_buckets(std::vector<std::vector<int64_t>> param_buckets, pybind11::object bucket_done);
  // A backward round begins: per bucket, how many of its parameters it waits for (-1: not counted).
  void arm(std::vector<int64_t> pending);
  // The round closed: nothing is counted until the next arm().
  void disarm();
  // kBeforeAccumulation: puts back each parameter's tensor hook where Python's first register_hook on it cleared the
  // list (Note [Stage 3's gradient hooks in C++]). Returns how many it put back.
  int64_t ensure();
  // Takes every hook off (idempotent).
  void remove();
  // Hooks installed (2 per parameter on the accumulator, 1 on the tensor, until remove()).
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
  bool on_tensors_ = false;  // kBeforeAccumulation: each parameter has a hook on the tensor itself (TensorHook)
};

}  // namespace shardopt
