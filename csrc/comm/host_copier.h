// Offload's device-to-host copies of reduced gradient chunks, off the compute stream.
//
// With CUDA, a reduced chunk is copied into pinned host memory on a side
// stream, after an event says the reduction's output is ready, so the copy
// overlaps the rest of backward instead of queueing the next kernels behind
// it; an event per staging slot keeps the slot from being reused before its
// copy has read it. Everywhere else (CPU tensors) start_copy declines and the
// bucket engine copies synchronously.
#pragma once

#include <memory>

#include <ATen/ATen.h>

namespace shardopt {

class HostCopier {
 public:
  HostCopier();
  ~HostCopier();
  // Starts dst.copy_(src) for a CUDA src and a CPU dst; returns false (and
  // does nothing) when this is not such a copy or the build has no CUDA.
  bool start_copy(const at::Tensor& dst, const at::Tensor& src, int64_t slot);
  // Makes the current stream wait until the slot's last copy has read it.
  void before_reuse(int64_t slot);
  // Blocks until every started copy has landed in host memory.
  void finish_all();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardopt
