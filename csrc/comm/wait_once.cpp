#include "wait_once.h"

#include "ring.h"

namespace shardopt::comm {

WaitOnceWork::WaitOnceWork(c10::intrusive_ptr<c10d::Work> inner)
    : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)) {}

bool WaitOnceWork::wait(std::chrono::milliseconds timeout) {
  std::call_once(once_, [this, timeout] {
    std::exception_ptr error;
    try {
      inner_->wait(timeout);
    } catch (...) {
      error = std::current_exception();
    }
    finish(error);  // completed: wakes every other waiter
  });
  return c10d::Work::wait(timeout);  // returns at once now, rethrowing the inner failure if there was one
}

std::vector<at::Tensor> WaitOnceWork::result() {
  return inner_->result();
}

void WaitOnceWork::abort() {
  inner_->abort();
}

c10::intrusive_ptr<c10d::Work> wait_once_on_gloo(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                 const at::Tensor& tensor, c10::intrusive_ptr<c10d::Work> work) {
  if (!work || !tensor.device().is_cpu() || !ring_is_default(pg)) return work;
  return c10::make_intrusive<WaitOnceWork>(std::move(work));
}

}  // namespace shardopt::comm
