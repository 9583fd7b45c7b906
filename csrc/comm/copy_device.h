// What the host copier needs from a GPU runtime, behind one small interface.
//
// Note [Device copies behind an interface]
// ----------------------------------------
// With offload and a CUDA model, each reduced gradient chunk is copied to the
// host on a side stream (host_copier.h). Nothing CUDA runs on our CI machines,
// so the copier is split in two:
//  * HostCopier (host_copier.cpp) makes every decision: which copies go to
//    the side stream and which stay with the caller, whether a copy may be
//    non-blocking (pinned destination), when a staging slot must wait for the
//    copy still reading it, and when the end of backward must block. It is
//    plain C++ with no CUDA in it, compiled in every build;
//  * a CopyDevice carries out those decisions: CudaCopyDevice
//    (copy_device_cuda.cpp, streams and events; only in CUDA builds) or
//    FakeCopyDevice (fake_copy_device.cpp), which logs each call and performs
//    a copy only when a real device would be known to have finished it (at
//    wait_slot or synchronize). Tests run the bucket engine on CPU with the
//    fake (tests/test_device_decisions.py): a missing wait then shows up as
//    wrong gradients, not as a race on the first GPU run.
// .ci/check-cuda-build checks that CudaCopyDevice is in the CUDA binary.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/ATen.h>

namespace shardopt {

class CopyDevice {
 public:
  virtual ~CopyDevice() = default;
  // Whether src is memory of this device (a copy from it to the host can go to a side stream).
  virtual bool owns(const at::Tensor& src) const = 0;
  // Whether host tensor t is pinned (page-locked): only then can a copy into it be non-blocking.
  virtual bool is_pinned(const at::Tensor& t) const = 0;
  // Queues dst.copy_(src) on src's device's side stream, after the work already
  // queued on its current (compute) stream, then marks it as `slot`'s last copy.
  virtual void copy_to_host(const at::Tensor& dst, const at::Tensor& src, bool non_blocking, int64_t slot) = 0;
  // Makes the current stream wait for `slot`'s last copy (it still reads the slot's buffer).
  virtual void wait_slot(int64_t slot) = 0;
  // Blocks the host until every queued copy has landed.
  virtual void synchronize() = 0;
};

// The device of this build: CudaCopyDevice with CUDA, nullptr without (every
// copy is then the caller's own, synchronous one).
std::shared_ptr<CopyDevice> default_copy_device();

}  // namespace shardopt
