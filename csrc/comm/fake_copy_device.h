// FakeCopyDevice: a CopyDevice for CPU tests (Note [Device copies behind an
// interface] in copy_device.h). It claims every source as device memory, logs
// each call, and defers each copy until a real device would be known to have
// done it: wait_slot(slot) runs that slot's queued copies, synchronize() all.
// A copier that forgets a wait leaves stale or overwritten data behind.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "copy_device.h"

namespace shardopt {

class FakeCopyDevice final : public CopyDevice {
 public:
  explicit FakeCopyDevice(bool pinned) : pinned_(pinned) {}
  bool owns(const at::Tensor& src) const override;
  bool is_pinned(const at::Tensor& t) const override;
  void copy_to_host(const at::Tensor& dst, const at::Tensor& src, bool non_blocking, int64_t slot) override;
  void wait_slot(int64_t slot) override;
  void synchronize() override;

  // "copy slot=S numel=N non_blocking=B", "wait slot=S (K queued)", "sync (K queued)", in call order.
  std::vector<std::string> log() const;
  // Copies queued and not yet carried out.
  int64_t queued() const;

 private:
  struct Pending {
    at::Tensor dst, src;
    int64_t slot;
  };
  void run(int64_t slot, bool all);

  bool pinned_;
  mutable std::mutex mu_;
  std::vector<Pending> pending_;
  std::vector<std::string> log_;
};

}  // namespace shardopt
