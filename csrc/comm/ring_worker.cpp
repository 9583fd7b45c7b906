#include "ring_worker.h"

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace shardopt::comm {

// ---------------------------------------------------------------------------
// RingWork

RingWork::RingWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, op_type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

std::vector<at::Tensor> RingWork::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> RingWork::getFuture() {
  return future_;
}

void RingWork::complete(std::exception_ptr error) {
  // Work first, future second: whoever is woken by the future must already see
  // isCompleted(). (One woken by wait() and then reading future.value() at once
  // could still race; future.wait() never does.)
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

// ---------------------------------------------------------------------------
// The per-group queue

namespace {

// Note [Failure is sticky]
// When an op fails (a peer died, a receive timed out) the ranks no longer
// agree on where they are in the message stream: some sends of the failed op
// may have been delivered, others not. Running the next queued op could then
// pair its messages with stale ones, or make every later op wait out the full
// timeout one after another (8 queued buckets = 8 timeouts). So after the first
// failure the queue fails every later op at once with that error, the way NCCL
// poisons a communicator; the process group has to be re-created.

// Tags of our ops start here: high enough that a user's own send/recv (tag 0
// by default) never pairs with our messages, below INT_MAX because c10d tags
// are ints. See Note [Ring tags] in ring.cpp.
constexpr int kTagBase = 0x5D000000;
constexpr int kTagSpan = 1 << 20;

struct Task {
  c10::intrusive_ptr<RingWork> work;
  RingBody body;
  int tag;
  // Keeps the group (and so gloo's context) alive while the op is queued.
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
};

class OpQueue : public std::enable_shared_from_this<OpQueue> {
 public:
  explicit OpQueue(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) : group_(pg) {}

  void start() {
    // Detached: the registry is never destroyed (see registry()), so joining at
    // exit would only risk deadlocking static destructors against gloo.
    std::thread([self = shared_from_this()] { self->loop(); }).detach();
  }

  // True while the group this queue was made for is alive. The registry is
  // keyed by address, and a destroyed group's address can be reused.
  bool serves(const c10d::ProcessGroup* pg) const {
    auto alive = group_.lock();
    return alive.get() == pg;
  }

  c10::intrusive_ptr<RingWork> push(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                    c10d::OpType op_type, std::vector<at::Tensor> outputs,
                                    RingBody body) {
    auto work = c10::make_intrusive<RingWork>(pg->getRank(), op_type, std::move(outputs));
    {
      std::lock_guard<std::mutex> lock(mu_);
      int tag = kTagBase + static_cast<int>(next_seq_++ % kTagSpan);
      tasks_.push_back(Task{work, std::move(body), tag, pg});
    }
    cv_.notify_one();
    return work;
  }

  // Lets the thread exit once the queue is empty. Called when the group is gone.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    // Gradients are never wanted here, and in-place writes into leaf tensors
    // that require grad (a flat parameter buffer) must not be refused.
    at::NoGradGuard no_grad;
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping and drained
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      std::exception_ptr error = first_error_;
      if (!error) {
        try {
          task.body(task.tag);
        } catch (...) {
          error = std::current_exception();
          first_error_ = error;
        }
      } else {
        error = std::make_exception_ptr(c10::DistBackendError(
            {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
            "shardopt: not run because an earlier shardopt collective on this process group failed "
            "(see Note [Failure is sticky]); that failure was: " + describe(first_error_)));
      }
      // Drop the op's tensors and group reference before waking the waiter, so
      // that after wait() the caller holds the only references to its buffers.
      task.body = nullptr;
      task.pg.reset();
      task.work->complete(error);
    }
  }

  static std::string describe(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const c10::Error& err) {
      return err.what_without_backtrace();
    } catch (const std::exception& err) {
      return err.what();
    } catch (...) {
      return "unknown error";
    }
  }

  c10::weak_intrusive_ptr<c10d::ProcessGroup> group_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  uint64_t next_seq_ = 0;
  bool stopping_ = false;
  std::exception_ptr first_error_;  // only touched by the worker thread
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10d::ProcessGroup*, std::shared_ptr<OpQueue>> queues;
};

Registry& registry() {
  // Leaked on purpose: detached worker threads may still be parked on their
  // queues when static destructors run at exit.
  static auto* r = new Registry();
  return *r;
}

std::shared_ptr<OpQueue> queue_for(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.queues.find(pg.get());
  if (it != reg.queues.end() && it->second->serves(pg.get())) return it->second;
  // A new group: first retire the queues of groups that no longer exist, so
  // programs that create and destroy many groups do not collect threads.
  for (auto q = reg.queues.begin(); q != reg.queues.end();) {
    if (!q->second->serves(q->first)) {
      q->second->stop();
      q = reg.queues.erase(q);
    } else {
      ++q;
    }
  }
  auto queue = std::make_shared<OpQueue>(pg);
  queue->start();
  reg.queues[pg.get()] = queue;
  return queue;
}

}  // namespace

c10::intrusive_ptr<RingWork> enqueue(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                     c10d::OpType op_type, std::vector<at::Tensor> outputs,
                                     RingBody body) {
  return queue_for(pg)->push(pg, op_type, std::move(outputs), std::move(body));
}

}  // namespace shardopt::comm
