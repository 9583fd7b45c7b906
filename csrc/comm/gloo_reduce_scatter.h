// The native reduce-scatter on gloo, run as gloo's own all-reduce with a Work
// that copies this rank's chunk out once and says when it is done.
#pragma once

#include <mutex>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace shardopt::comm {

// Note [gloo's reduce-scatter copies on every wait]
// ProcessGroupGloo runs reduce_scatter_single (_reduce_scatter_base) as an
// all-reduce of a copy of the input and hands back a Work whose wait() copies
// this rank's chunk of that copy into the output: on every call, not once.
// Its isCompleted() never turns true either. Both broke shardopt with
// comm_impl="native" on gloo (the ring, the default there, never had either
// problem: its Works only signal):
//   * A bucket's reduce-scatter is waited for twice when an inter-node phase
//     follows it (hybrid sharding's hop, node-aware collectives): by the hop's
//     worker, which then sums the chunk across nodes in place, and by the
//     engine, to take back the staging buffer. When the engine's wait came
//     second it copied the in-node sum back over the hop's result: the other
//     nodes' gradients were silently lost (found by a randomised parity run;
//     tests/test_hybrid.py).
//   * Stage 3 takes a staging buffer back once its reduce-scatter says it is
//     complete, and grows the pool when none does within a short patience
//     (Note [Stage 3 never waits in backward]): it never did here, so the pool
//     grew to one buffer per bucket, a whole model's gradient, and the first
//     step stalled (tests/test_zero_behaviour.py).
// So on gloo shardopt runs the same all-reduce of a copy itself and returns a
// GlooReduceScatterWork: complete when the all-reduce is, copying the chunk
// into the output on the first wait only (later and concurrent waits block
// until that copy is done and share its outcome, an error included). The input
// is free for reuse as soon as the start returns (the all-reduce reads its copy).
class GlooReduceScatterWork : public c10d::Work {
 public:
  GlooReduceScatterWork(c10::intrusive_ptr<c10d::Work> all_reduce, at::Tensor sum, at::Tensor output,
                        int64_t rank);

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  std::vector<at::Tensor> result() override;
  void abort() override;

 private:
  c10::intrusive_ptr<c10d::Work> all_reduce_;
  at::Tensor sum_;     // the all-reduced copy of the input
  at::Tensor output_;  // this rank's chunk (c10d::Work::rank_) of sum_ goes here
  std::once_flag once_;
};

// Starts the sum reduce-scatter of `input` into `output` on `pg`'s CPU backend, gloo.
c10::intrusive_ptr<c10d::Work> start_gloo_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                         const at::Tensor& input, at::Tensor output);

}  // namespace shardopt::comm
