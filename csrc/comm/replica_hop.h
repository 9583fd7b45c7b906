// The inter-node hop of hybrid sharding: an all-reduce of this rank's gradient
// chunk with the ranks holding the same chunk in the other replicas
// (Note [Hybrid sharding] in shardopt/mesh_plan.py), optionally compressed.
//
// Note [Compressed inter-node hop]
// --------------------------------
// The chunk (n elements, n % R == 0) is cut into R parts of m = n/R; replica
// rank j owns part j. Two phases, each a direct exchange with every other
// replica (point-to-point on the replicate group):
//   1. every rank sends part j, encoded, to rank j; rank j decodes what it
//      receives and forms the sum in fp32, in rank order, its own part taken
//      exactly (it never left the rank);
//   2. rank j encodes that sum and sends it to every other rank; every rank,
//      the owner too, decodes it into part j of its chunk.
// Every rank sends (R-1)/R of its chunk per phase, 2 (R-1)/R in all, the same
// as a ring all-reduce, in the hop's format. Every replica ends with bit-equal
// chunks (everyone decodes the owner's one encoding), so replicas never drift.
// Formats:
//   exact    the reduction dtype itself (fp32 by default): no rounding but the
//            fp32 additions;
//   bfloat16 half the bytes; a value is rounded when it leaves its rank and the
//            sum when it leaves its owner;
//   int8     a quarter of the bytes plus one fp32 scale per INT8_BLOCK (256)
//            elements: symmetric, scale = max|x| / 127 per block, round to
//            nearest. With error feedback: what a rank's rounding lost (in
//            phase 1 for the parts it sends, in phase 2 for the part it owns)
//            is kept in a residual and added to the same elements at the next
//            hop, so rounding errors do not accumulate over steps (as in 1-bit
//            Adam / ZeRO++'s qgZ; ZeRO++ only does this for stage 3). The
//            residual is n + m fp32 elements per chunk; a skipped step (inf/nan)
//            resets it.
// The int8 codec is fused: one pass encodes and updates the residual, one
// decodes (into the sum, adding, in phase 1; into the chunk in phase 2); Note
// [Fused int8 codec] in int8_codec.h. Its pure-PyTorch reference is in
// shardopt/reference.py, tested against it bit for bit.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/ATen.h>

#include "int8_codec.h"
#include "ring.h"

namespace shardopt::comm {

enum class HopFormat { kExact, kBFloat16, kInt8 };

// "exact" | "bfloat16" | "int8"
HopFormat parse_hop_format(const std::string& name);

// Encodes float32 `x` (1-D, contiguous) into one message: int8 = [fp32 scale per
// block][int8 values] as bytes; bfloat16 = x in bf16; exact = x in `exact_dtype`.
at::Tensor hop_encode(const at::Tensor& x, HopFormat format, at::ScalarType exact_dtype);
// Decodes a message of m elements into float32.
at::Tensor hop_decode(const at::Tensor& payload, HopFormat format, int64_t m);

// Starts the in-place sum all-reduce of `chunk` over `pg` (the replicate group)
// on pg's worker (ring_worker.h), after `after` (the reduce-scatter that
// produces the chunk; may be null) has finished. chunk: 1-D, contiguous, CPU,
// float32/bfloat16/float16, numel % group size == 0. residual: for int8, a
// float32 tensor of numel + numel / group size elements, zero at first, kept
// by the caller across hops (error feedback); undefined otherwise. Same
// contract as the ring ops (ring.h): start in the same order on every rank,
// do not touch chunk until wait() returns, errors are rethrown by wait().
WorkPtr start_replica_all_reduce(const GroupPtr& pg, WorkPtr after, at::Tensor chunk, HopFormat format,
                                 at::Tensor residual);

// Phase 1 alone: part r (r = this rank in pg) of `chunk` receives the sum over
// pg of everyone's part r; the other parts are unspecified afterwards only in
// that they are not written. Same arguments and contract as above (the int8
// residual keeps its size; only its sent parts are used). Node-aware flat
// sharding's gradient phase (Note [Two-level collectives] in
// shardopt/parallel/mesh_plan.py).
WorkPtr start_replica_reduce_scatter(const GroupPtr& pg, WorkPtr after, at::Tensor chunk, HopFormat format,
                                     at::Tensor residual);
// Either of the two (scatter_only picks).
WorkPtr start_replica_hop(const GroupPtr& pg, WorkPtr after, at::Tensor chunk, HopFormat format,
                          at::Tensor residual, bool scatter_only);

}  // namespace shardopt::comm
