// Offload's device-to-host copies of reduced gradient chunks, off the compute stream.
//
// With CUDA, a reduced chunk is copied into (pinned) host memory on a side
// stream, after the reduction's output is ready, so the copy overlaps the rest
// of backward instead of queueing the next kernels behind it; each staging
// slot's last copy is remembered, so the slot is not reused before that copy
// has read it. Everywhere else (no device, or a source the device does not
// own: CPU tensors) start_copy declines and the bucket engine copies
// synchronously. This class only decides; a CopyDevice carries the decisions
// out (Note [Device copies behind an interface] in copy_device.h).
#pragma once

#include <memory>
#include <unordered_set>

#include <ATen/ATen.h>

#include "copy_device.h"

namespace shardopt {

class HostCopier {
 public:
  // device: nullptr declines every copy.
  explicit HostCopier(std::shared_ptr<CopyDevice> device);
  // Starts dst.copy_(src) for a device src and a host dst; returns false (and
  // does nothing) when this is not such a copy or there is no device.
  bool start_copy(const at::Tensor& dst, const at::Tensor& src, int64_t slot);
  // Makes the current stream wait until the slot's last copy has read it
  // (nothing when no copy of the slot is outstanding).
  void before_reuse(int64_t slot);
  // Blocks until every started copy has landed in host memory (nothing when
  // none was started since the last call).
  void finish_all();

 private:
  std::shared_ptr<CopyDevice> device_;
  std::unordered_set<int64_t> unread_;  // slots whose buffer a started copy may still be reading
  bool in_flight_ = false;              // a copy started since the last finish_all
};

}  // namespace shardopt
