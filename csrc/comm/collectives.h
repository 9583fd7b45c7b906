// The two collectives the bucket engine issues, behind one choice of
// implementation: "native" uses the process group's own collectives; "ring"
// and "auto" are resolved in collectives.cpp (see ring.h once merged).
#pragma once

#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace shardopt::comm {

// Sum-reduce-scatter of contiguous 1-D `input` (numel divisible by world size)
// into `output` (this rank's chunk). `input` may be used as scratch.
c10::intrusive_ptr<c10d::Work> start_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                    at::Tensor input, at::Tensor output,
                                                    const std::string& impl);

// All-gather in place: `rows` is [world_size, n] with contiguous rows (any row
// stride); row `rank` holds this rank's data and every other row is filled.
c10::intrusive_ptr<c10d::Work> start_all_gather_rows(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                     at::Tensor rows, const std::string& impl);

}  // namespace shardopt::comm
