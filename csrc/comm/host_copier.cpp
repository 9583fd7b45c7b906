// See host_copier.h. The CUDA parts compile only in a build with CUDA
// (SHARDOPT_WITH_CUDA); .ci/check-cuda-build compiles them.
#include "host_copier.h"

#include <unordered_map>

#ifdef SHARDOPT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace shardopt {

#ifdef SHARDOPT_WITH_CUDA
struct HostCopier::Impl {
  std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;  // one side stream per device
  std::unordered_map<int64_t, at::cuda::CUDAEvent> slot_done;          // the slot's last copy finished
  bool pending = false;

  c10::cuda::CUDAStream& stream(c10::DeviceIndex d) {
    auto it = streams.find(d);
    if (it == streams.end()) it = streams.emplace(d, c10::cuda::getStreamFromPool(false, d)).first;
    return it->second;
  }
};

HostCopier::HostCopier() : impl_(std::make_unique<Impl>()) {}

bool HostCopier::start_copy(const at::Tensor& dst, const at::Tensor& src, int64_t slot) {
  if (!src.is_cuda() || !dst.is_cpu()) return false;
  const c10::cuda::CUDAGuard guard(src.device());
  auto compute = c10::cuda::getCurrentCUDAStream(src.device().index());
  auto& side = impl_->stream(src.device().index());
  // The reduction's output is complete on the compute stream at this point.
  at::cuda::CUDAEvent ready;
  ready.record(compute);
  ready.block(side);
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    dst.copy_(src, /*non_blocking=*/dst.is_pinned());
  }
  impl_->slot_done[slot].record(side);
  impl_->pending = true;
  return true;
}

void HostCopier::before_reuse(int64_t slot) {
  auto it = impl_->slot_done.find(slot);
  if (it != impl_->slot_done.end() && it->second.isCreated()) {
    it->second.block(c10::cuda::getCurrentCUDAStream(it->second.device_index()));
  }
}

void HostCopier::finish_all() {
  if (!impl_->pending) return;
  for (auto& [device, s] : impl_->streams) s.synchronize();
  impl_->pending = false;
}

#else  // no CUDA in this build: every copy is the caller's, synchronous one.
struct HostCopier::Impl {};
HostCopier::HostCopier() = default;
bool HostCopier::start_copy(const at::Tensor&, const at::Tensor&, int64_t) { return false; }
void HostCopier::before_reuse(int64_t) {}
void HostCopier::finish_all() {}
#endif

HostCopier::~HostCopier() = default;

}  // namespace shardopt
