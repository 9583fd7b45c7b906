// A background thread per process group that runs shardopt's own collectives
// one after another, in the order they were started.
//
// Why a thread of our own: gloo's point-to-point ops are asynchronous, but a
// ring collective is a long chain of them with work (reductions, forwards) in
// between, so something has to drive the chain while the caller goes on
// computing. Why one thread per group and a FIFO: every rank must run its
// collectives in the same order (the ring's messages of op k must meet op k on
// the peer), so the order of start_* calls is the order of execution, exactly
// like collectives issued on a c10d process group.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace shardopt::comm {

// The Work handed back to the caller. wait() (inherited from c10d::Work)
// blocks until the worker finished the op and rethrows its error, if any.
class RingWork : public c10d::Work {
 public:
  RingWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs);

  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Called once by the worker thread.
  void complete(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// What the worker runs for one op. `tag` is unique among the ops of this
// group that can be in flight together (see Note [Ring tags] in ring.cpp).
using RingBody = std::function<void(int tag)>;

// Queues `body` on `pg`'s worker and returns immediately. The body runs on the
// worker thread with grad mode off; if it throws, the Work fails with that
// error and so does every later op of this group (see Note [Failure is sticky]
// in ring_worker.cpp).
c10::intrusive_ptr<RingWork> enqueue(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                     c10d::OpType op_type, std::vector<at::Tensor> outputs,
                                     RingBody body);

}  // namespace shardopt::comm
