#include "gloo_reduce_scatter.h"

#include <exception>

namespace shardopt::comm {

GlooReduceScatterWork::GlooReduceScatterWork(c10::intrusive_ptr<c10d::Work> all_reduce, at::Tensor sum,
                                             at::Tensor output, int64_t rank)
    : c10d::Work(rank, c10d::OpType::_REDUCE_SCATTER_BASE),
      all_reduce_(std::move(all_reduce)),
      sum_(std::move(sum)),
      output_(std::move(output)) {}

bool GlooReduceScatterWork::isCompleted() {
  return c10d::Work::isCompleted() || all_reduce_->isCompleted();  // the copy out is cheap and done in wait()
}

bool GlooReduceScatterWork::wait(std::chrono::milliseconds timeout) {
  std::call_once(once_, [this, timeout] {
    std::exception_ptr error;
    try {
      all_reduce_->wait(timeout);
      const int64_t n = output_.numel();
      output_.copy_(sum_.narrow(0, rank_ * n, n));
    } catch (...) {
      error = std::current_exception();
    }
    sum_ = at::Tensor();
    finish(error);  // completed: wakes every other waiter
  });
  return c10d::Work::wait(timeout);  // returns at once now, rethrowing the failure if there was one
}

std::vector<at::Tensor> GlooReduceScatterWork::result() {
  return {output_};
}

void GlooReduceScatterWork::abort() {
  all_reduce_->abort();
}

c10::intrusive_ptr<c10d::Work> start_gloo_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                         const at::Tensor& input, at::Tensor output) {
  std::vector<at::Tensor> sum{input.clone()};
  auto work = pg->allreduce(sum);
  return c10::make_intrusive<GlooReduceScatterWork>(std::move(work), sum[0], std::move(output), pg->getRank());
}

}  // namespace shardopt::comm
