// The bucket engine: turns per-parameter "gradient ready" events into one
// reduce-scatter per bucket, and a step's updated chunks into all-gathers.
//
// Note [Bucket engine]
// --------------------
// The plan (bucket ranges, which parameters overlap each bucket, launch order)
// comes from shardopt/layout.py and is identical on every rank. The engine:
//  * copies each ready gradient, pre-divided by world size (as DDP's default
//    hook does), into a bucket-sized staging buffer taken from a small pool
//    allocated once; or, with keep_full_grads, finds gradients already in the
//    persistent flat gradient buffer (params' .grad are views of it) and
//    reduces them from there;
//  * launches a bucket's reduce-scatter once all its parameters are ready AND
//    every bucket before it in the launch order has launched, so all ranks
//    issue collectives in the same order whatever order hooks fire in;
//  * writes the result into this rank's shard of the gradient (fp32 chunks,
//    one per bucket), adding when the shard already holds gradients of an
//    earlier backward (accumulation without no_sync);
//  * at the end of backward (flush) launches the buckets whose parameters got
//    no gradient on this rank (their part of the bucket reads as zeros), and
//    waits for everything in flight.
// Mixed precision and offload (Note [Unscaling inside the reduction] in
// shardopt/precision.py): gradients arrive in the model's dtype, are reduced
// in reduce_dtype, and land in the shard's dtype and device (fp32, and host
// memory with offload). The copy into the reduce buffer divides by
// world_size * loss_scale and flags inf/nan (shardopt::unscale_into), so the
// shard holds true averaged gradients. A reduce-scatter writes straight into
// the shard chunk when dtype and device allow; otherwise into the slot's
// output buffer, copied (per bucket, as it finishes) into the shard.
// A staging buffer is recycled when its reduce-scatter has finished; if every
// buffer is held by a bucket that cannot launch yet (hooks fired out of
// order), the pool grows by one rather than deadlock, and flush() gives back
// what it grew by (Note [The staging pool between backward passes] in
// bucket_engine.cpp).
// Errors of a collective (a dead peer, a timeout) are rethrown with the bucket
// and what to check, never swallowed.
#pragma once

#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "copy_device.h"
#include "host_copier.h"
#include "replica_hop.h"
#include "ring.h"

namespace shardopt {

struct BucketPlan {
  std::vector<int64_t> bucket_start;              // flat element offset of each bucket
  std::vector<int64_t> bucket_numel;              // elements (padding included) of each bucket
  std::vector<std::vector<int64_t>> bucket_params;  // params overlapping each bucket
  std::vector<int64_t> param_offset;              // flat element offset of each param
  std::vector<int64_t> param_numel;
  std::vector<int64_t> launch_order;              // bucket indices, identical on every rank
  std::vector<int64_t> gather_bucket;             // per all-gather: its bucket
  std::vector<int64_t> gather_lo;                 // ... and [lo, hi) inside each rank's chunk
  std::vector<int64_t> gather_hi;
};

struct EngineOptions {
  // true: gradients accumulate in the caller's flat gradient buffer across
  // backward passes and are reduced from it, which is zeroed once reduced;
  // false: each ready gradient is copied into a staging buffer (the caller
  // releases the full-size one).
  bool keep_full_grads = false;
  int64_t num_staging = 2;           // staging buffers allocated up front (the pool may grow within a backward)
  bool overlap = true;               // false: each reduce-scatter is waited for at launch
  std::string impl = "auto";         // "native", "ring" or "auto" (see ring.h)
  at::ScalarType grad_dtype = at::kFloat;    // the model's gradients
  at::ScalarType reduce_dtype = at::kFloat;  // what the collectives carry
  at::Device device = at::kCPU;              // the model's device (staging lives there)
  // false: never block a backward pass for a staging buffer; take
  // back those whose reduce-scatter has finished, else grow the pool (Note
  // [Stage 3 never waits in backward] in bucket_engine.cpp).
  bool wait_for_staging = true;
  // Carries out the host copier's device calls; nullptr: this build's default
  // (CUDA streams, or none). Tests pass a FakeCopyDevice (copy_device.h).
  std::shared_ptr<CopyDevice> copy_device;
};

class BucketEngine {
 public:
  // flat_grad: the persistent full gradient buffer (keep_full_grads), else undefined.
  // shard_grad: this rank's gradient chunks, concatenated in bucket order
  // (fp32; on the host with offload).
  BucketEngine(c10::intrusive_ptr<c10d::ProcessGroup> pg, BucketPlan plan, EngineOptions options,
               at::Tensor flat_grad, at::Tensor shard_grad);

  // A parameter's gradient of this backward is complete: copied into staging (unless keep_full_grads).
  void mark_ready(int64_t param, const at::Tensor& grad);
  // Records that a parameter got a gradient without reducing it (no_sync).
  void note_used(int64_t param);
  // Parameters that have not been marked ready in the current backward.
  std::vector<int64_t> unready_params() const;
  // End of backward: launch every remaining bucket, wait for all, reset.
  void flush();
  // True once mark_ready was called in the current (unflushed) backward.
  bool backward_in_progress() const;
  // Forget accumulated gradients (the optimizer's zero_grad).
  void zero_grad();
  // uint8 flag per parameter: got a gradient on this rank since zero_grad.
  at::Tensor used() const { return used_; }
  // Whether any reduction wrote into the shard since zero_grad.
  bool has_grad() const;
  // Gradients are divided by world_size * replicas * scale while being staged.
  void set_loss_scale(double scale);
  // Hybrid sharding (Note [Hybrid sharding] in shardopt/mesh_plan.py): after its
  // reduce-scatter, each bucket's chunk is all-reduced over `replicate`, in
  // `format` ("exact", "bfloat16", "int8"; Note [Compressed inter-node hop]).
  // Call once, before the first backward.
  void set_replicate_group(c10::intrusive_ptr<c10d::ProcessGroup> replicate, const std::string& format);
  // Hybrid sharding: whether the hop runs (default). Off, a bucket is reduced
  // inside its shard group only, divided by the shard group's size: the mean
  // over this replica's ranks, which OneBitAdam's compression stage then sends
  // across replicas itself (Note [1-bit Adam under ZeRO] in shardopt/onebit.py).
  // Between backward passes only.
  void set_replica_hop(bool enabled);
  // Node-aware flat sharding (Note [Two-level collectives] in
  // shardopt/parallel/mesh_plan.py): the engine's group is the whole world,
  // W = R * K ranks, with the layout's chunk order of Note [Node-aware chunk
  // order] (layout.py). Each bucket is reduce-scattered over `node` (this
  // rank's K ranks) into a node chunk, whose part for this node is then
  // summed over `across` (the R ranks of this local rank), in `format` as the
  // hybrid hop, and lands in the shard; the parameter gathers mirror it
  // (exact). Call once, before the first backward.
  void set_node_groups(c10::intrusive_ptr<c10d::ProcessGroup> node, c10::intrusive_ptr<c10d::ProcessGroup> across,
                       const std::string& format);
  // Node-aware flat sharding: the parameter gathers' phase across nodes carries
  // each chunk in `dtype` (bfloat16: half the bytes of fp32) instead of the
  // parameters' own; every rank, the chunk's owner included, then holds the
  // chunk rounded to `dtype` (Note [Parameters across nodes in bf16] in
  // shardopt/parallel/mesh_plan.py). Call after set_node_groups.
  void set_gather_dtype(c10::ScalarType dtype);
  // Forgets the int8 hop's error feedback (after a step skipped for inf/nan).
  void reset_hop_residual();
  // Bytes of the int8 hop's error-feedback residual (0 without one).
  int64_t hop_residual_bytes() const;
  // The residual itself (undefined without one), shared, not copied: checkpoints
  // read and restore it (shardopt/checkpoint/hop_residual.py). Only between
  // steps: refused while gradients are being reduced.
  at::Tensor hop_residual() const;
  // One float32 element: 1 if a gradient staged since zero_grad held an inf/nan.
  at::Tensor found_nonfinite() const { return found_; }

  // All-gathers every rank's updated chunks into `flat` (the flat parameter
  // buffer, in place), one collective per gather span, in the plan's gather
  // order. start_* launches them all and returns; until a bucket's gathers are
  // finished, its part of `flat` must not be read (other ranks' chunks are
  // being written) nor written (this rank's chunk is being sent). See Note
  // [Gathering in the next forward] in shardopt/prefetch.py.
  void start_all_gather_params(const at::Tensor& flat);
  // Waits for the pending gathers of one bucket (no-op if none).
  void finish_all_gather(int64_t bucket);
  // Waits for every pending gather (no-op if none).
  void finish_all_gather_params();
  // start + finish.
  void all_gather_params(const at::Tensor& flat);
  // Buckets whose gathers were started and not yet finished.
  int64_t num_pending_gathers() const;

  // Counters, for tests and benchmarks.
  int64_t num_reduce_scatters() const { return n_reduce_scatters_; }
  int64_t num_all_gathers() const { return n_all_gathers_; }
  int64_t num_staging_buffers() const { return static_cast<int64_t>(slots_.size()); }
  int64_t staging_bytes() const;
  // Seconds spent copying reduced chunks into the shard (offload: device to host).
  double copy_seconds() const { return copy_seconds_; }

 private:
  // A bucket's transient memory, reused round-robin.
  struct Slot {
    at::Tensor staging;  // bucket-sized, reduce dtype (when gradients are copied to be reduced)
    at::Tensor out;      // chunk-sized, reduce dtype (when the result cannot go straight to the shard)
  };
  struct InFlight {
    int64_t bucket;
    c10::intrusive_ptr<c10d::Work> work;  // null when done synchronously (world size 1)
    c10::intrusive_ptr<c10d::Work> hop;   // the inter-node hop after it (hybrid sharding), else null
    int64_t slot;                          // -1 once given back early (see free_a_slot)
    at::Tensor out;                        // reduce-scatter output
    bool direct;                           // out is the shard chunk itself
    bool accumulate;                       // out must be added into the shard chunk
  };

  // One all-gather span in flight.
  struct Gather {
    c10::intrusive_ptr<c10d::Work> work;
    int64_t bucket;
    at::Tensor rows;    // where the result belongs: [world_size, n], contiguous rows
    at::Tensor staged;  // defined when rows is strided: gathered here, copied to rows after
  };

  at::Tensor chunk_view(int64_t bucket) const;
  void finish_gather(Gather& gather);
  int64_t acquire_slot();
  at::Tensor slot_staging(int64_t slot);
  at::Tensor slot_out(int64_t slot);
  void launch(int64_t bucket);
  void launch_ready_buckets();
  void finish_oldest();
  bool oldest_is_done() const;
  bool oldest_done_soon() const;
  void free_a_slot();
  void release_reduced_slots();
  void give_back_slot(InFlight& f);
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t bucket);
  void reset_backward();
  void shrink_pool();
  void launch_two_level(int64_t bucket, const at::Tensor& input, InFlight& f);
  void start_two_level_gathers(const at::Tensor& flat);
  at::Tensor hop_residual_of(int64_t bucket, int64_t chunk) const;
  bool has_grad_locked() const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  BucketPlan plan_;
  bool keep_full_grads_;
  at::Tensor flat_grad_;
  at::Tensor shard_grad_;
  std::vector<int64_t> chunk_offset_;
  bool overlap_;
  bool wait_for_staging_;
  comm::Impl impl_;
  at::TensorOptions reduce_options_;  // reduce dtype on the model's device
  bool staged_;        // gradients are copied into a staging buffer to be reduced
  bool direct_ok_;     // a reduce-scatter may write into the shard chunk itself
  int64_t max_bucket_ = 0, max_chunk_ = 0;
  double divisor_;     // world_size * replicas (1 with the hop off) * loss scale
  double loss_scale_ = 1.0;
  // Hybrid sharding: the inter-node hop (null without one).
  c10::intrusive_ptr<c10d::ProcessGroup> replicate_pg_;
  comm::HopFormat hop_format_ = comm::HopFormat::kExact;
  int64_t replicas_ = 1;
  bool replica_hop_ = true;  // set_replica_hop
  // Node-aware flat sharding (null without): the in-node and the across-nodes group.
  c10::intrusive_ptr<c10d::ProcessGroup> node_pg_, across_pg_;
  int64_t nodes_ = 1, node_ = 0, local_ = 0;  // R, this rank's node and local rank
  std::optional<c10::ScalarType> gather_dtype_;  // the parameters' dtype across nodes, if narrower
  at::Tensor hop_residual_;                 // int8: error feedback, per bucket chunk + chunk / replicas
  std::vector<int64_t> residual_offset_;
  at::Tensor found_;
  int64_t rank_, world_size_;
  std::vector<std::vector<int64_t>> param_buckets_;  // buckets each param overlaps

  // Per backward.
  std::vector<uint8_t> ready_;
  std::vector<int64_t> pending_;      // params not yet ready, per bucket
  std::vector<int64_t> slot_of_;      // slot of each bucket, -1 if none yet
  size_t next_launch_ = 0;            // index into plan_.launch_order
  bool in_backward_ = false;

  // Across backward passes until zero_grad.
  std::vector<uint8_t> has_data_;     // shard chunk holds a reduced gradient
  at::Tensor used_;

  std::vector<Slot> slots_;
  std::vector<int64_t> free_slots_;
  int64_t pool_size_ = 0;             // slots_ between backward passes: min(num_staging, buckets)
  std::deque<InFlight> inflight_;
  std::vector<Gather> gathers_;       // started, not finished (empty slots: finished)
  int64_t pending_gathers_ = 0;
  int64_t n_reduce_scatters_ = 0, n_all_gathers_ = 0;
  double copy_seconds_ = 0.0;
  HostCopier host_copier_;  // offload with CUDA: copies to the host on a side stream
  mutable std::mutex mu_;
};

}  // namespace shardopt
