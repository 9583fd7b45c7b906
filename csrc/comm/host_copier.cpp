// See host_copier.h. No CUDA here: the device calls go through CopyDevice.
#include "host_copier.h"

namespace shardopt {

HostCopier::HostCopier(std::shared_ptr<CopyDevice> device) : device_(std::move(device)) {}

bool HostCopier::start_copy(const at::Tensor& dst, const at::Tensor& src, int64_t slot) {
  if (!device_ || !dst.is_cpu() || !device_->owns(src)) return false;
  // Into pageable memory a "non-blocking" copy would be staged through a
  // pinned bounce buffer by the driver and block anyway; ask for what happens.
  device_->copy_to_host(dst, src, /*non_blocking=*/device_->is_pinned(dst), slot);
  unread_.insert(slot);
  in_flight_ = true;
  return true;
}

void HostCopier::before_reuse(int64_t slot) {
  // Once the stream waits for the copy, later work on it is ordered after the
  // copy's read: reusing the slot again needs no wait until its next copy.
  if (unread_.erase(slot)) device_->wait_slot(slot);
}

void HostCopier::finish_all() {
  // A stream waiting for a copy (before_reuse) does not mean it has landed:
  // the host still blocks once for every copy started since the last call.
  if (!in_flight_) return;
  device_->synchronize();
  unread_.clear();
  in_flight_ = false;
}

}  // namespace shardopt
