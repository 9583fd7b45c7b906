// The node-aware ("two-level") all-gather: Note [Two-level collectives] in
// shardopt/parallel/mesh_plan.py, in the chunk order of Note [Node-aware chunk
// order] in shardopt/layout.py. One function, used by the bucket engine's
// parameter gathers (stages 1-2) and by stage 3's ParamShard (through the
// binding shardopt._C.two_level_all_gather).
#pragma once

#include <optional>

#include <ATen/ATen.h>

#include "ring.h"

namespace shardopt::comm {

// W = R * K ranks on R nodes of K, rank = node * K + local. `node` is this
// rank's node (K ranks; this rank is its rank `local`), `across` the R ranks
// with this local rank (this rank is its rank `node`).
//
// output (W * input.numel() elements, W chunks) receives every rank's input,
// rank (node i, local j)'s at chunk j * R + i. Two phases, the call returns at once:
//   across the link: the R ranks of `across` all-gather their inputs into node
//     chunk `local` (output's R chunks from local * R), with `impl`;
//   inside the node: the K node chunks are ring-all-gathered over `node`, in
//     place, on the node group's worker once the first phase is done
//     (start_all_gather_after; node-aware collectives run on gloo).
// A node's link carries (R-1)/R of the output once, where a flat ring over W
// carries (W-1)/W of it.
// Aliasing: input may be exactly output's chunk local * R + node (in place), or
// must not overlap output. The returned Work is the last phase's; its failure
// includes the first phase's. The contract of ring.h otherwise (1-D
// contiguous, same sizes on every rank, start in the same order everywhere,
// never touch output or write input before wait()).
// across_dtype (float32 tensors only): the phase across the link carries the
// inputs in a narrower format, and the node chunk is widened back on the node
// group's worker before the phase inside the node: every rank's output, its own
// chunk included, holds every input rounded the same way (Note [Parameters
// across nodes in bf16], Note [Parameters across nodes in int8] in
// shardopt/parallel/mesh_plan.py). The formats:
//   kBFloat16  each value rounded to bf16 (2 bytes a value);
//   kChar      the int8 codec's message of each input (int8_codec.h: one fp32
//              scale per block of 256 of that input, then one int8 a value;
//              no error feedback), its slot padded to 4 bytes: every
//              receiver decodes the same values.
WorkPtr start_two_level_all_gather(const GroupPtr& node, const GroupPtr& across, at::Tensor input,
                                   at::Tensor output, Impl impl = Impl::kAuto,
                                   std::optional<at::ScalarType> across_dtype = std::nullopt);

}  // namespace shardopt::comm
