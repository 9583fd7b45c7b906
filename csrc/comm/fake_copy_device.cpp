// See fake_copy_device.h.
#include "fake_copy_device.h"

namespace shardopt {

bool FakeCopyDevice::owns(const at::Tensor&) const { return true; }

bool FakeCopyDevice::is_pinned(const at::Tensor& t) const { return pinned_ && t.is_cpu(); }

void FakeCopyDevice::copy_to_host(const at::Tensor& dst, const at::Tensor& src, bool non_blocking, int64_t slot) {
  std::lock_guard<std::mutex> g(mu_);
  // Keeps src itself, not a copy: like a side stream, the fake reads it later.
  pending_.push_back(Pending{dst, src, slot});
  log_.push_back("copy slot=" + std::to_string(slot) + " numel=" + std::to_string(src.numel()) +
                 " non_blocking=" + (non_blocking ? "1" : "0"));
}

void FakeCopyDevice::run(int64_t slot, bool all) {
  std::vector<Pending> keep;
  for (auto& p : pending_) {
    if (all || p.slot == slot) {
      p.dst.copy_(p.src);
    } else {
      keep.push_back(std::move(p));
    }
  }
  pending_ = std::move(keep);
}

void FakeCopyDevice::wait_slot(int64_t slot) {
  std::lock_guard<std::mutex> g(mu_);
  log_.push_back("wait slot=" + std::to_string(slot) + " (" + std::to_string(pending_.size()) + " queued)");
  run(slot, false);
}

void FakeCopyDevice::synchronize() {
  std::lock_guard<std::mutex> g(mu_);
  log_.push_back("sync (" + std::to_string(pending_.size()) + " queued)");
  run(-1, true);
}

std::vector<std::string> FakeCopyDevice::log() const {
  std::lock_guard<std::mutex> g(mu_);
  return log_;
}

int64_t FakeCopyDevice::queued() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int64_t>(pending_.size());
}

}  // namespace shardopt
