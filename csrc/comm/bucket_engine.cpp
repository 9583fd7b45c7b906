#include "bucket_engine.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include <c10/util/Exception.h>

#include "../precision/unscale.h"
#include "peer_names.h"
#include "ring.h"
#include "two_level.h"

namespace shardopt {

BucketEngine::BucketEngine(c10::intrusive_ptr<c10d::ProcessGroup> pg, BucketPlan plan, EngineOptions options,
                           at::Tensor flat_grad, at::Tensor shard_grad)
    : pg_(std::move(pg)),
      plan_(std::move(plan)),
      keep_full_grads_(options.keep_full_grads),
      flat_grad_(std::move(flat_grad)),
      shard_grad_(std::move(shard_grad)),
      overlap_(options.overlap),
      wait_for_staging_(options.wait_for_staging),
      impl_(comm::parse_impl(options.impl)),
      host_copier_(options.copy_device ? options.copy_device : default_copy_device()) {
  TORCH_CHECK(pg_, "BucketEngine needs a process group");
  TORCH_CHECK(options.num_staging >= 1, "num_staging must be >= 1");
  rank_ = pg_->getRank();
  world_size_ = pg_->getSize();
  divisor_ = static_cast<double>(world_size_);
  const auto nb = static_cast<int64_t>(plan_.bucket_start.size());
  const auto np = static_cast<int64_t>(plan_.param_offset.size());
  TORCH_CHECK(static_cast<int64_t>(plan_.bucket_numel.size()) == nb &&
                  static_cast<int64_t>(plan_.bucket_params.size()) == nb &&
                  static_cast<int64_t>(plan_.launch_order.size()) == nb &&
                  static_cast<int64_t>(plan_.param_numel.size()) == np,
              "inconsistent bucket plan");
  TORCH_CHECK(shard_grad_.defined() && shard_grad_.is_contiguous() && shard_grad_.dim() == 1,
              "shard_grad must be a contiguous 1-D tensor");
  int64_t at = 0;
  for (int64_t b = 0; b < nb; ++b) {
    TORCH_CHECK(plan_.bucket_numel[b] % world_size_ == 0, "bucket ", b, " does not split over ",
                world_size_, " ranks");
    chunk_offset_.push_back(at);
    at += plan_.bucket_numel[b] / world_size_;
    max_bucket_ = std::max(max_bucket_, plan_.bucket_numel[b]);
  }
  max_chunk_ = max_bucket_ / world_size_;
  TORCH_CHECK(shard_grad_.numel() == at, "shard_grad has ", shard_grad_.numel(),
              " elements, the plan needs ", at);
  if (keep_full_grads_) {
    TORCH_CHECK(flat_grad_.defined() && flat_grad_.is_contiguous() &&
                    flat_grad_.scalar_type() == options.grad_dtype && flat_grad_.device() == options.device,
                "keep_full_grads needs the flat gradient buffer, in the gradients' dtype and device");
  }
  reduce_options_ = at::TensorOptions().dtype(options.reduce_dtype).device(options.device);
  // The flat gradient buffer is reduced in place unless it must change dtype.
  staged_ = !keep_full_grads_ || options.grad_dtype != options.reduce_dtype;
  direct_ok_ = options.reduce_dtype == shard_grad_.scalar_type() && options.device == shard_grad_.device();
  found_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(options.device));
  // Allocated once; reused for every bucket of every backward.
  pool_size_ = std::min<int64_t>(options.num_staging, nb);
  for (int64_t i = 0; i < pool_size_; ++i) {
    slots_.emplace_back();
    if (staged_) slot_staging(i);
    free_slots_.push_back(i);
  }
  param_buckets_.resize(np);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t p : plan_.bucket_params[b]) param_buckets_.at(p).push_back(b);
  }
  has_data_.assign(nb, 0);
  used_ = at::zeros({np}, at::kByte);
  reset_backward();
}

at::Tensor BucketEngine::slot_staging(int64_t slot) {
  auto& t = slots_[slot].staging;
  if (!t.defined()) t = at::zeros({max_bucket_}, reduce_options_);
  return t;
}

at::Tensor BucketEngine::slot_out(int64_t slot) {
  // Only needed when results cannot land in the shard directly, or must be
  // added to it: allocated the first time that happens.
  auto& t = slots_[slot].out;
  if (!t.defined()) t = at::empty({max_chunk_}, reduce_options_);
  return t;
}

void BucketEngine::set_loss_scale(double scale) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(scale > 0.0, "loss scale must be > 0, got ", scale);
  TORCH_CHECK(!in_backward_, "the loss scale cannot change during a backward pass");
  loss_scale_ = scale;
  divisor_ = static_cast<double>(world_size_ * (replica_hop_ ? replicas_ : 1)) * scale;
}

void BucketEngine::set_replica_hop(bool enabled) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(replicate_pg_, "set_replica_hop: there is no replicate group (set_replicate_group first)");
  TORCH_CHECK(!in_backward_ && inflight_.empty(), "set_replica_hop is called between backward passes");
  replica_hop_ = enabled;
  divisor_ = static_cast<double>(world_size_ * (replica_hop_ ? replicas_ : 1)) * loss_scale_;
}

void BucketEngine::set_replicate_group(c10::intrusive_ptr<c10d::ProcessGroup> replicate,
                                       const std::string& format) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(replicate, "set_replicate_group: process group is None");
  TORCH_CHECK(!replicate_pg_, "the replicate group is already set");
  TORCH_CHECK(!in_backward_ && !has_grad_locked(), "set_replicate_group must be called before the first backward");
  TORCH_CHECK_VALUE(reduce_options_.device().is_cpu(), "the inter-node hop runs on CPU tensors (gloo); "
                    "this model's gradients are reduced on ", reduce_options_.device());
  const auto parsed = comm::parse_hop_format(format);
  const int64_t r = replicate->getSize();
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (size_t b = 0; b < plan_.bucket_numel.size(); ++b) {
    const int64_t chunk = plan_.bucket_numel[b] / world_size_;
    TORCH_CHECK_VALUE(chunk % r == 0, "bucket ", b, "'s chunk of ", chunk, " elements does not split over ", r,
                      " replicas (plan the layout with replicas=", r, ")");
    offsets.push_back(total);
    total += chunk + chunk / r;
  }
  replicate_pg_ = std::move(replicate);
  hop_format_ = parsed;
  replicas_ = r;
  residual_offset_ = std::move(offsets);
  if (hop_format_ == comm::HopFormat::kInt8) hop_residual_ = at::zeros({total}, at::kFloat);
  divisor_ = static_cast<double>(world_size_ * replicas_) * loss_scale_;
}

void BucketEngine::set_node_groups(c10::intrusive_ptr<c10d::ProcessGroup> node,
                                   c10::intrusive_ptr<c10d::ProcessGroup> across, const std::string& format) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(node && across, "set_node_groups: process group is None");
  TORCH_CHECK(!node_pg_ && !replicate_pg_, "the node groups (or a replicate group) are already set");
  TORCH_CHECK(!in_backward_ && !has_grad_locked(), "set_node_groups must be called before the first backward");
  TORCH_CHECK_VALUE(reduce_options_.device().is_cpu(), "node-aware collectives run on CPU tensors (gloo); "
                    "this model's gradients are reduced on ", reduce_options_.device());
  const int64_t k = node->getSize(), r = across->getSize();
  TORCH_CHECK_VALUE(k * r == world_size_ && across->getRank() * k + node->getRank() == rank_,
                    "set_node_groups: rank ", rank_, " of ", world_size_, " is local rank ", node->getRank(), " of ",
                    k, " on node ", across->getRank(), " of ", r, "; expected rank = node * ranks_per_node + local");
  const auto parsed = comm::parse_hop_format(format);
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (size_t b = 0; b < plan_.bucket_numel.size(); ++b) {
    const int64_t node_chunk = plan_.bucket_numel[b] / k;  // R chunks
    offsets.push_back(total);
    total += node_chunk + node_chunk / r;
  }
  node_pg_ = std::move(node);
  across_pg_ = std::move(across);
  nodes_ = r;
  node_ = across_pg_->getRank();
  local_ = node_pg_->getRank();
  hop_format_ = parsed;
  residual_offset_ = std::move(offsets);
  if (hop_format_ == comm::HopFormat::kInt8) hop_residual_ = at::zeros({total}, at::kFloat);
}

at::Tensor BucketEngine::hop_residual_of(int64_t b, int64_t chunk) const {
  if (!hop_residual_.defined()) return at::Tensor();
  const int64_t parts = node_pg_ ? nodes_ : replicas_;
  return hop_residual_.narrow(0, residual_offset_[b], chunk + chunk / parts);
}

void BucketEngine::reset_hop_residual() {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(inflight_.empty(), "reset_hop_residual() called while gradients are being reduced");
  if (hop_residual_.defined()) hop_residual_.zero_();
}

at::Tensor BucketEngine::hop_residual() const {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(inflight_.empty() && !in_backward_,
              "hop_residual is read between steps, not while gradients are being reduced");
  return hop_residual_;
}

int64_t BucketEngine::hop_residual_bytes() const {
  return hop_residual_.defined() ? hop_residual_.numel() * hop_residual_.element_size() : 0;
}

void BucketEngine::reset_backward() {
  const auto nb = plan_.bucket_start.size();
  ready_.assign(plan_.param_offset.size(), 0);
  pending_.assign(nb, 0);
  for (size_t b = 0; b < nb; ++b) pending_[b] = static_cast<int64_t>(plan_.bucket_params[b].size());
  slot_of_.assign(nb, -1);
  next_launch_ = 0;
  in_backward_ = false;
}

at::Tensor BucketEngine::chunk_view(int64_t b) const {
  return shard_grad_.narrow(0, chunk_offset_[b], plan_.bucket_numel[b] / world_size_);
}

// Note [Stage 3 never waits in backward]
// At stage 3 (wait_for_staging=false) a backward pass also waits for parameter all-gathers (another
// process group, in a fixed schedule of their own). If rank A waited here for
// a reduce-scatter that rank B has not launched yet, while B waits for an
// all-gather that only A's backward would go on to issue, neither would move:
// the two streams' orders differ between ranks as soon as ranks run different
// modules. So with wait_for_staging=false this never blocks for long: a
// staging buffer whose reduce-scatter finishes within kStagingPatience is taken
// back, and if none does, the pool grows by one (until the end of this
// backward: Note [The staging pool between backward passes]; what a backward
// needs at most is then bounded by how far its computation outruns the link,
// never by a deadlock). The patience keeps the pool near its size when
// reductions keep up, which they do unless the link is slow.
constexpr auto kStagingPatience = std::chrono::milliseconds(20);

bool BucketEngine::oldest_is_done() const {
  const auto& f = inflight_.front();
  return (!f.work || f.work->isCompleted()) && (!f.hop || f.hop->isCompleted());
}

bool BucketEngine::oldest_done_soon() const {
  const auto until = std::chrono::steady_clock::now() + kStagingPatience;
  while (!oldest_is_done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

int64_t BucketEngine::acquire_slot() {
  if (wait_for_staging_) {
    while (free_slots_.empty() && !inflight_.empty()) free_a_slot();
  } else {
    release_reduced_slots();
    while (free_slots_.empty() && !inflight_.empty() && oldest_done_soon()) finish_oldest();
  }
  if (free_slots_.empty()) {
    // Every buffer belongs to a bucket that waits for an earlier one in the
    // launch order: grow rather than deadlock (see Note [Bucket engine]).
    slots_.emplace_back();
    return static_cast<int64_t>(slots_.size()) - 1;
  }
  int64_t s = free_slots_.back();
  free_slots_.pop_back();
  return s;
}

void BucketEngine::note_used(int64_t param) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(param >= 0 && param < used_.numel(), "parameter index ", param, " out of range");
  used_.data_ptr<uint8_t>()[param] = 1;
}

void BucketEngine::mark_ready(int64_t param, const at::Tensor& grad) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(param >= 0 && param < static_cast<int64_t>(ready_.size()), "parameter index ", param,
              " out of range");
  TORCH_CHECK(!ready_[param], "gradient of parameter ", param,
              " was reported twice in one backward pass. shardopt reduces each parameter once per "
              "backward; reentrant backward (e.g. reentrant activation checkpointing) is not supported: "
              "use torch.utils.checkpoint with use_reentrant=False.");
  TORCH_CHECK(!grad.is_sparse(), "parameter ", param,
              " has a sparse gradient; shardopt needs dense gradients (e.g. nn.Embedding(sparse=False))");
  const int64_t numel = plan_.param_numel[param];
  TORCH_CHECK(grad.numel() == numel, "gradient of parameter ", param, " has ", grad.numel(),
              " elements, expected ", numel);
  in_backward_ = true;
  ready_[param] = 1;
  used_.data_ptr<uint8_t>()[param] = 1;
  const int64_t off = plan_.param_offset[param];
  auto src = grad.reshape({-1});
  if (keep_full_grads_) {
    auto dst = flat_grad_.narrow(0, off, numel);
    // .grad is normally a view of the flat buffer and autograd accumulated in
    // place; if something replaced it, take its value.
    if (src.data_ptr() != dst.data_ptr()) dst.copy_(src);
  } else if (!src.is_contiguous()) {
    src = src.contiguous();
  }
  // Bucket by bucket, launching as soon as one completes: a parameter that
  // straddles many buckets then needs one staging buffer at a time, not one each.
  for (int64_t b : param_buckets_[param]) {
    if (!keep_full_grads_) {
      if (slot_of_[b] < 0) slot_of_[b] = acquire_slot();
      const int64_t lo = std::max(off, plan_.bucket_start[b]);
      const int64_t hi = std::min(off + numel, plan_.bucket_start[b] + plan_.bucket_numel[b]);
      auto dst = slot_staging(slot_of_[b]).narrow(0, lo - plan_.bucket_start[b], hi - lo);
      // Pre-divide (by world size and loss scale) while copying: one pass, the
      // sum cannot overflow in low precision, and inf/nan are noticed here.
      unscale_into(src.narrow(0, lo - off, hi - lo), dst, divisor_, found_);
    }
    --pending_[b];
    launch_ready_buckets();
  }
}

void BucketEngine::launch_ready_buckets() {
  while (next_launch_ < plan_.launch_order.size() &&
         pending_[plan_.launch_order[next_launch_]] == 0) {
    launch(plan_.launch_order[next_launch_]);
    ++next_launch_;
  }
}

void BucketEngine::launch(int64_t b) {
  const int64_t start = plan_.bucket_start[b], numel = plan_.bucket_numel[b];
  if (slot_of_[b] < 0) slot_of_[b] = acquire_slot();
  const int64_t slot = slot_of_[b];
  host_copier_.before_reuse(slot);  // its output buffer may still be on its way to the host
  at::Tensor input;
  if (keep_full_grads_) {
    auto grads = flat_grad_.narrow(0, start, numel);
    input = staged_ ? slot_staging(slot).narrow(0, 0, numel) : grads;
    unscale_into(grads, input, divisor_, found_);
  } else {
    input = slot_staging(slot).narrow(0, 0, numel);
    // Parameters that got no gradient on this rank contribute zeros, and so
    // does padding: the buffer last held another bucket (or the collective's
    // scratch), so neither may be assumed zero.
    int64_t covered = start;
    for (int64_t p : plan_.bucket_params[b]) {
      const int64_t lo = std::max(plan_.param_offset[p], start);
      const int64_t hi = std::min(plan_.param_offset[p] + plan_.param_numel[p], start + numel);
      covered = std::max(covered, hi);
      if (!ready_[p]) input.narrow(0, lo - start, hi - lo).zero_();
    }
    // Parameters of a region are packed from its start; padding is its tail.
    input.narrow(0, covered - start, start + numel - covered).zero_();
  }
  const bool accumulate = has_data_[b] != 0;
  has_data_[b] = 1;
  ++n_reduce_scatters_;
  if (node_pg_) {
    InFlight f{b, nullptr, nullptr, slot, at::Tensor(), false, accumulate};
    launch_two_level(b, input, f);
    inflight_.push_back(std::move(f));
  } else {
    const bool direct = direct_ok_ && !accumulate;
    at::Tensor out = direct ? chunk_view(b) : slot_out(slot).narrow(0, 0, numel / world_size_);
    c10::intrusive_ptr<c10d::Work> work, hop;
    if (world_size_ == 1) {
      out.copy_(input);
    } else {
      work = comm::start_reduce_scatter_auto(pg_, input, out, impl_);
    }
    if (replicate_pg_ && replica_hop_) {
      // The inter-node hop, chained after the reduce-scatter on the replicate
      // group's worker: bucket b crosses the link while b+1 is reduced in the node.
      hop = comm::start_replica_all_reduce(replicate_pg_, work, out, hop_format_,
                                           hop_residual_of(b, numel / world_size_));
    }
    inflight_.push_back(InFlight{b, std::move(work), std::move(hop), slot, std::move(out), direct, accumulate});
  }
  if (!overlap_) finish_oldest();
  else if (!wait_for_staging_) {
    while (!inflight_.empty() && oldest_is_done()) finish_oldest();  // give finished slots back early
  }
}

// Note [Two-level collectives] (shardopt/parallel/mesh_plan.py): the node
// chunk (R of the bucket's W chunks) is reduce-scattered inside the node into a
// buffer of its own (so the staging buffer is free again as soon as that is
// done, while the node chunk crosses the link), then part `node_` of it is
// summed across the nodes; finish_oldest takes that part into the shard.
void BucketEngine::launch_two_level(int64_t b, const at::Tensor& input, InFlight& f) {
  const int64_t k = node_pg_->getSize(), node_chunk = plan_.bucket_numel[b] / k;
  f.out = at::empty({node_chunk}, reduce_options_);
  if (k == 1) {
    f.out.copy_(input);
  } else {
    f.work = comm::start_reduce_scatter_auto(node_pg_, input, f.out, impl_);
  }
  f.hop = comm::start_replica_reduce_scatter(across_pg_, f.work, f.out, hop_format_, hop_residual_of(b, node_chunk));
}

void BucketEngine::set_gather_dtype(c10::ScalarType dtype) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK_VALUE(node_pg_, "set_gather_dtype: the parameters cross nodes only with node-aware collectives "
                    "(set_node_groups first)");
  TORCH_CHECK_VALUE(pending_gathers_ == 0, "set_gather_dtype: parameter gathers are in flight");
  TORCH_CHECK_VALUE(dtype == at::kBFloat16, "set_gather_dtype: only bfloat16 is built, got ", dtype);
  gather_dtype_ = dtype;
}

void BucketEngine::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t bucket) {
  if (!work) return;
  try {
    work->wait();
  } catch (const std::exception& e) {
    // The cause names the peer, by global rank and host (Note [Naming a peer] in peer_names.h).
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(false, "shardopt: ", what, " of bucket ", bucket, " failed on ", comm::self_name(pg_), ": ",
                ce ? ce->what_without_backtrace() : e.what(),
                "\nA peer rank has probably exited, crashed, or is not running the same sequence of "
                "backward()/step() calls; see the other ranks' logs.");
  }
}

// A staging buffer is needed: the oldest bucket still holding one gives it
// back. With an inter-node hop into the shard itself (direct), that is as
// soon as its reduce-scatter inside the node is done: backward goes on filling
// buckets while earlier ones are still crossing the slow link.
void BucketEngine::free_a_slot() {
  for (auto& f : inflight_) {
    if (f.slot < 0) continue;
    if (f.hop && (f.direct || node_pg_)) {
      give_back_slot(f);
      return;
    }
    break;
  }
  finish_oldest();
}

// Without waiting for staging, with two-level reductions: a bucket's staging buffer is read only by
// its in-node reduce-scatter (the node chunk crosses the link from a buffer of
// its own), so every one whose in-node phase is done is taken back at once,
// without waiting: the pool does not grow while the slow link is busy.
void BucketEngine::release_reduced_slots() {
  if (!node_pg_) return;
  for (auto& f : inflight_) {
    if (f.slot < 0 || (f.work && !f.work->isCompleted())) continue;
    give_back_slot(f);  // its reduce-scatter is done: the wait returns at once, or rethrows its failure
  }
}

// A bucket whose in-node reduce-scatter no longer needs its staging buffer
// (the rest of its reduction reads a buffer of its own) gives the buffer back.
void BucketEngine::give_back_slot(InFlight& f) {
  wait(f.work, "reduce-scatter", f.bucket);
  f.work.reset();
  free_slots_.push_back(f.slot);
  f.slot = -1;
}

void BucketEngine::finish_oldest() {
  InFlight f = std::move(inflight_.front());
  inflight_.pop_front();
  wait(f.work, "reduce-scatter", f.bucket);
  wait(f.hop, "inter-node hop", f.bucket);
  if (node_pg_) {  // this node's part of the node chunk (Note [Two-level collectives])
    auto chunk = chunk_view(f.bucket);
    auto part = f.out.narrow(0, node_ * chunk.numel(), chunk.numel());
    if (f.accumulate) {
      chunk.add_(part);
    } else {
      chunk.copy_(part);
    }
  } else if (!f.direct) {
    // Into the shard's dtype and device (the host, with offload), per bucket.
    const auto t0 = std::chrono::steady_clock::now();
    auto chunk = chunk_view(f.bucket);
    if (f.accumulate) {
      chunk.add_(f.out.device() == chunk.device() ? f.out : f.out.to(chunk.device()));
    } else if (!host_copier_.start_copy(chunk, f.out, f.slot)) {
      chunk.copy_(f.out);
    }
    copy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (keep_full_grads_) {
    // The next backward accumulates into .grad views of this buffer again.
    flat_grad_.narrow(0, plan_.bucket_start[f.bucket], plan_.bucket_numel[f.bucket]).zero_();
  }
  if (f.slot >= 0) free_slots_.push_back(f.slot);
}

std::vector<int64_t> BucketEngine::unready_params() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (size_t p = 0; p < ready_.size(); ++p) {
    if (!ready_[p]) out.push_back(static_cast<int64_t>(p));
  }
  return out;
}

bool BucketEngine::backward_in_progress() const {
  std::lock_guard<std::mutex> g(mu_);
  return in_backward_;
}

void BucketEngine::flush() {
  std::lock_guard<std::mutex> g(mu_);
  while (next_launch_ < plan_.launch_order.size()) {
    launch(plan_.launch_order[next_launch_]);
    ++next_launch_;
  }
  while (!inflight_.empty()) finish_oldest();
  host_copier_.finish_all();  // the optimizer reads the shard next
  shrink_pool();
  reset_backward();
}

// Note [The staging pool between backward passes]
// The pool may grow during a backward (a bucket that cannot launch yet holds
// every buffer, Note [Bucket engine]; a reduce-scatter that lags at stage 3,
// Note [Stage 3 never waits in backward]). What it grew by is dropped here, at
// the end of flush(), so each backward starts with the configured pool and a
// slow step costs memory only while it runs. This is the first point where no
// buffer is read: flush() has launched every bucket and waited for every
// reduce-scatter and inter-node hop (the only readers of a staging buffer and
// the only writers of an output buffer), and host_copier_.finish_all() for
// every copy out of an output buffer; so every slot is free. Between backward
// passes the engine touches no slot (parameter gathers write into the caller's
// flat buffer), and the next backward allocates again if it needs more.
void BucketEngine::shrink_pool() {
  if (static_cast<int64_t>(slots_.size()) <= pool_size_) return;
  TORCH_INTERNAL_ASSERT(inflight_.empty() && free_slots_.size() == slots_.size(),
                        "the staging pool shrinks only once every buffer is free");
  slots_.resize(pool_size_);
  free_slots_.erase(std::remove_if(free_slots_.begin(), free_slots_.end(),
                                   [this](int64_t s) { return s >= pool_size_; }),
                    free_slots_.end());
}

void BucketEngine::zero_grad() {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(inflight_.empty() && !in_backward_,
              "zero_grad() called while gradients of a backward pass are still being reduced");
  std::fill(has_data_.begin(), has_data_.end(), 0);
  used_.zero_();
  found_.zero_();
  if (keep_full_grads_) flat_grad_.zero_();
}

bool BucketEngine::has_grad() const {
  std::lock_guard<std::mutex> g(mu_);
  return has_grad_locked();
}

bool BucketEngine::has_grad_locked() const {
  for (auto h : has_data_) {
    if (h) return true;
  }
  return false;
}

int64_t BucketEngine::staging_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  int64_t n = 0;
  for (const auto& s : slots_) {
    for (const auto* t : {&s.staging, &s.out}) {
      if (t->defined()) n += t->numel() * t->element_size();
    }
  }
  return n;
}

void BucketEngine::start_all_gather_params(const at::Tensor& flat) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(flat.is_contiguous() && flat.dim() == 1, "flat parameter buffer must be contiguous 1-D");
  TORCH_CHECK(pending_gathers_ == 0, "start_all_gather_params: the previous all-gather of parameters "
              "was not finished");
  gathers_.clear();
  if (world_size_ == 1) return;
  if (node_pg_) {
    start_two_level_gathers(flat);
    pending_gathers_ = static_cast<int64_t>(gathers_.size());
    return;
  }
  for (size_t i = 0; i < plan_.gather_bucket.size(); ++i) {
    const int64_t b = plan_.gather_bucket[i];
    const int64_t chunk = plan_.bucket_numel[b] / world_size_;
    // Row r = rank r's chunk; columns [lo, hi) of each row. A whole-chunk span
    // is the bucket itself: gathered in place. A partial span is strided; the
    // collectives want one contiguous output, so it is gathered into a staging
    // copy (an extra pass over the span; only when allgather_bucket_size is
    // smaller than the reduce bucket).
    auto rows = flat.narrow(0, plan_.bucket_start[b], plan_.bucket_numel[b])
                    .view({world_size_, chunk})
                    .narrow(1, plan_.gather_lo[i], plan_.gather_hi[i] - plan_.gather_lo[i]);
    at::Tensor staged = rows.is_contiguous() ? at::Tensor() : rows.contiguous();
    const at::Tensor& target = staged.defined() ? staged : rows;
    auto work = comm::start_all_gather_auto(pg_, target.select(0, rank_), target.view({-1}), impl_);
    gathers_.push_back(Gather{std::move(work), b, rows, staged});
    ++n_all_gathers_;
  }
  pending_gathers_ = static_cast<int64_t>(gathers_.size());
}

// The mirror of the two-level reduction, one span at a time: the R ranks of
// this local rank gather their chunks' span into the node chunk's (across the
// link), then the node's K ranks gather those (inside the node), chained on the
// node group's worker (comm::start_two_level_all_gather, csrc/comm/two_level.h,
// which stage 3's parameter gathers use too). A whole-chunk span is gathered in
// place; a partial one through a staging buffer in chunk order, copied into the
// bucket's strided rows at finish. With a narrower gather dtype (Note
// [Parameters across nodes in bf16] in shardopt/parallel/mesh_plan.py) the
// phase across the link carries the spans in it, and every rank, this chunk's
// owner included, ends with the rounded values.
void BucketEngine::start_two_level_gathers(const at::Tensor& flat) {
  for (size_t i = 0; i < plan_.gather_bucket.size(); ++i) {
    const int64_t b = plan_.gather_bucket[i];
    const int64_t chunk = plan_.bucket_numel[b] / world_size_;
    const int64_t lo = plan_.gather_lo[i], span = plan_.gather_hi[i] - lo;
    auto bucket = flat.narrow(0, plan_.bucket_start[b], plan_.bucket_numel[b]);
    auto rows = bucket.view({world_size_, chunk}).narrow(1, lo, span);  // chunk c = local * R + node
    auto mine = rows.select(0, local_ * nodes_ + node_);
    at::Tensor staged = rows.is_contiguous() ? at::Tensor() : at::empty({world_size_, span}, flat.options());
    auto work = comm::start_two_level_all_gather(node_pg_, across_pg_, mine,
                                                 staged.defined() ? staged.view({-1}) : bucket, impl_, gather_dtype_);
    gathers_.push_back(Gather{std::move(work), b, rows, staged});
    n_all_gathers_ += 2;
  }
}

void BucketEngine::finish_gather(Gather& gth) {
  if (!gth.rows.defined()) return;  // already finished
  // Forget it first: after a failure the group is broken anyway (every later
  // op fails too), and a retry must not copy a half-received span.
  Gather done = std::move(gth);
  gth = Gather{};
  --pending_gathers_;
  wait(done.work, "all-gather", done.bucket);
  if (done.staged.defined()) done.rows.copy_(done.staged);
}

void BucketEngine::finish_all_gather(int64_t bucket) {
  std::lock_guard<std::mutex> g(mu_);
  if (pending_gathers_ == 0) return;
  for (auto& gth : gathers_) {
    if (gth.bucket == bucket) finish_gather(gth);
  }
}

void BucketEngine::finish_all_gather_params() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& gth : gathers_) finish_gather(gth);
  gathers_.clear();
}

void BucketEngine::all_gather_params(const at::Tensor& flat) {
  start_all_gather_params(flat);
  finish_all_gather_params();
}

int64_t BucketEngine::num_pending_gathers() const {
  std::lock_guard<std::mutex> g(mu_);
  return pending_gathers_;
}

}  // namespace shardopt
