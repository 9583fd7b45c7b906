// CudaCopyDevice: the CopyDevice of a CUDA build (Note [Device copies behind
// an interface] in copy_device.h). Compiled only with SHARDOPT_WITH_CUDA;
// .ci/check-cuda-build compiles it and checks it is in the binary.
#include "copy_device.h"

#ifdef SHARDOPT_WITH_CUDA
#include <unordered_map>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace shardopt {

#ifdef SHARDOPT_WITH_CUDA
namespace {

class CudaCopyDevice final : public CopyDevice {
 public:
  bool owns(const at::Tensor& src) const override { return src.is_cuda(); }

  bool is_pinned(const at::Tensor& t) const override { return t.is_cpu() && t.is_pinned(); }

  void copy_to_host(const at::Tensor& dst, const at::Tensor& src, bool non_blocking, int64_t slot) override {
    const c10::cuda::CUDAGuard guard(src.device());
    auto compute = c10::cuda::getCurrentCUDAStream(src.device().index());
    auto& side = stream(src.device().index());
    // The reduction's output is complete on the compute stream at this point.
    at::cuda::CUDAEvent ready;
    ready.record(compute);
    ready.block(side);
    {
      const c10::cuda::CUDAStreamGuard on_side(side);
      dst.copy_(src, non_blocking);
    }
    slot_done_[slot].record(side);
  }

  void wait_slot(int64_t slot) override {
    auto it = slot_done_.find(slot);
    if (it != slot_done_.end() && it->second.isCreated()) {
      it->second.block(c10::cuda::getCurrentCUDAStream(it->second.device_index()));
    }
  }

  void synchronize() override {
    for (auto& [device, s] : streams_) s.synchronize();
  }

 private:
  c10::cuda::CUDAStream& stream(c10::DeviceIndex d) {
    auto it = streams_.find(d);
    if (it == streams_.end()) it = streams_.emplace(d, c10::cuda::getStreamFromPool(false, d)).first;
    return it->second;
  }

  std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> streams_;  // one side stream per device
  std::unordered_map<int64_t, at::cuda::CUDAEvent> slot_done_;          // the slot's last copy finished
};

}  // namespace

std::shared_ptr<CopyDevice> default_copy_device() { return std::make_shared<CudaCopyDevice>(); }

#else  // no CUDA in this build

std::shared_ptr<CopyDevice> default_copy_device() { return nullptr; }

#endif

}  // namespace shardopt
