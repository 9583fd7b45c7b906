// Reduce-scatter and all-gather over a c10d::ProcessGroup.
//
// On gloo, torch's reduce_scatter_tensor is an all-reduce followed by a slice
// and its all_gather_into_tensor is about as slow, so here both are pipelined
// rings built on the group's point-to-point send/recv (Note [Ring schedule] in
// ring.cpp). On NCCL (and anything else) the group's native collectives are
// used: start_*_auto chooses.
//
// Contract shared by every function below:
//  - Tensors are 1-D, contiguous, of one dtype (float32, bfloat16 or float16;
//    all-gather and all-to-all, which only move data, take uint8 too) and one
//    device; the ring needs CPU tensors. Sizes must be the same on every
//    rank. Violations raise c10::Error (ValueError/RuntimeError in Python)
//    before anything is queued.
//  - The returned Work is already started. wait() blocks until the op is done
//    and rethrows its error; it never hangs on a dead peer: every receive of the
//    ring is bounded by the group's timeout. work.get_future() also works. The
//    error names the peer by its global rank and host where Python registered
//    the group (Note [Naming a peer] in peer_names.h).
//  - Ring ops of one group run one at a time on a background thread, in the
//    order they were started (so start them in the same order on every rank,
//    as with any collective). Any number may be in flight. After one fails,
//    every later one on that group fails too (Note [Failure is sticky]).
//  - Until wait() returns, the caller must not touch `output`, and must not
//    write `input`.
//  - Sums are accumulated in the tensors' dtype, as NCCL does: each element of
//    the result is ((x_a + x_b) + x_c) + ... with one rounding per addition in
//    a rank order that depends on the element's chunk. Integer-valued data whose
//    sums are representable is therefore exact; otherwise the error is at most
//    (world_size - 1) roundings.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace shardopt::comm {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// Sum-reduce-scatter: input.numel() % world_size == 0; output (numel/world_size
// elements) receives chunk `rank` of the elementwise sum over ranks.
// Aliasing: output may be exactly input's chunk `rank` (in place), or must not
// overlap input at all.
// Scratch: the ring accumulates partial sums in place in `input`, so after the
// op input's contents are unspecified (chunk `rank` is only read, and is the
// result if output aliases it). This saves a chunk-sized buffer per op.
WorkPtr start_reduce_scatter(const GroupPtr& pg, at::Tensor input, at::Tensor output);

// All-gather: output (world_size * input.numel() elements) receives every
// rank's input, in rank order. input is never written.
// Aliasing: input may be exactly output's chunk `rank` (in place: the gather
// writes the other chunks around it), or must not overlap output at all.
WorkPtr start_all_gather(const GroupPtr& pg, at::Tensor input, at::Tensor output);
// The same ring all-gather, run on pg's worker once `after` (an op of another
// group, e.g. the first phase of a two-level gather; may be null) has finished;
// its failure is this op's failure. `then` (may be empty) runs on the worker
// between the two, e.g. to widen what the first phase received in a narrower
// dtype into `input`.
WorkPtr start_all_gather_after(const GroupPtr& pg, WorkPtr after, at::Tensor input, at::Tensor output,
                               std::function<void()> then = {});

// All-to-all on the group's worker, point to point: input and output hold W
// rows of numel / W elements; row j of input goes to rank j, row j of output
// comes from rank j (this rank's own row is copied). float32, bfloat16,
// float16 or uint8; CPU; input and output must not overlap. OneBitAdam's first
// exchange (shardopt/onebit.py), whose failure thus names the peer as the
// ring's does (peers.h).
WorkPtr start_all_to_all(const GroupPtr& pg, at::Tensor input, at::Tensor output);

// The group's own collectives (reduce_scatter_single / all_gather_single), with
// the same checks. Native reduce-scatter leaves input unchanged.
WorkPtr start_reduce_scatter_native(const GroupPtr& pg, at::Tensor input, at::Tensor output);
WorkPtr start_all_gather_native(const GroupPtr& pg, at::Tensor input, at::Tensor output);

// Which implementation to run. kAuto: the ring when the group's CPU backend is
// gloo (from 4 MB buckets up, reduce-scatter measured 1.5-5x and all-gather
// 1.1-3.7x faster than gloo's own, in benchmarks/results/), native everywhere
// else (NCCL keeps its own collectives).
enum class Impl { kAuto, kRing, kNative };
Impl parse_impl(const std::string& name);  // "auto" | "ring" | "native"
bool ring_is_default(const GroupPtr& pg);

WorkPtr start_reduce_scatter_auto(const GroupPtr& pg, at::Tensor input, at::Tensor output,
                                  Impl impl = Impl::kAuto);
WorkPtr start_all_gather_auto(const GroupPtr& pg, at::Tensor input, at::Tensor output,
                              Impl impl = Impl::kAuto);

// Pipeline tuning (Note [Ring schedule]), for benchmarks. Process-wide, read
// when an op starts (ops already queued keep their values).
// Piece: the ring cuts each chunk into messages of at most this many bytes
// (rounded down to whole elements, at least one). Must be the same on every
// rank: the pieces are the messages, and gloo checks their sizes.
// Depth: how many reduce-scatter receives are posted ahead, each into its own
// piece-sized scratch slot. May differ between ranks.
// The group's timeout (c10d's default when its backend has no options): every
// receive of shardopt's own collectives is bounded by it.
std::chrono::milliseconds group_timeout(const GroupPtr& pg);

int64_t ring_piece_bytes();
void set_ring_piece_bytes(int64_t bytes);
int64_t ring_depth();
void set_ring_depth(int64_t depth);

}  // namespace shardopt::comm
