// A Work whose inner Work is waited for exactly once, however many callers wait.
#pragma once

#include <exception>
#include <mutex>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace shardopt::comm {

// Note [gloo's reduce-scatter copies on every wait]
// ProcessGroupGloo runs reduce_scatter_single (_reduce_scatter_base) as an
// all-reduce of a copy of the input, and hands back a Work whose wait() copies
// this rank's chunk of that copy into the output: on every call, not once.
// Its isCompleted() never turns true either. shardopt waits for a bucket's
// reduce-scatter in two places when an inter-node phase follows it (hybrid
// sharding's hop, node-aware collectives): the hop's worker, before summing
// the chunk across nodes in place, and the engine, to take back the staging
// buffer. When the engine's wait came second it copied the in-node sum back
// over the hop's result, so with comm_impl="native" on gloo a node's gradients
// silently lost the other nodes' part (found by a randomised parity run;
// tests/test_hybrid.py covers it). The ring (the default on gloo) was never
// affected: its Works only signal. WaitOnceWork waits for the inner Work on
// the first call; later and concurrent callers block until that is done and
// share its outcome (its error, rethrown, included).
class WaitOnceWork : public c10d::Work {
 public:
  explicit WaitOnceWork(c10::intrusive_ptr<c10d::Work> inner);

  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  std::vector<at::Tensor> result() override;
  void abort() override;

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::once_flag once_;
};

// `work`, wrapped in a WaitOnceWork when it comes from the CPU backend of `pg`
// and that backend is gloo (whose reduce-scatter needs it); as it is otherwise
// (NCCL's wait() makes the caller's stream wait, which must happen per caller).
c10::intrusive_ptr<c10d::Work> wait_once_on_gloo(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                 const at::Tensor& tensor, c10::intrusive_ptr<c10d::Work> work);

}  // namespace shardopt::comm
