#include "ring.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/version.h>

#include "gloo_reduce_scatter.h"
#include "peers.h"
#include "ring_worker.h"

namespace shardopt::comm {

// Note [Ring schedule]
// Ranks form a ring r -> r+1 (mod W); each rank sends only to its right
// neighbour and receives only from its left one. Buffers are cut into W chunks
// of n elements; chunk c is the one rank c ends up owning.
//
// Reduce-scatter, W-1 steps. In step s rank r sends its running sum of chunk
// r-1-s to the right and receives the left's running sum of chunk r-2-s, adds
// its own input chunk to it, and that is what it sends in step s+1. Chunk c
// starts at rank c+1 and travels the whole ring, collecting one addend per
// rank, so after step W-2 rank r holds the complete sum of chunk r. Every rank
// sends and receives (W-1)/W of the buffer: the minimum, and half of what an
// all-reduce moves, which is why torch's all-reduce-based reduce-scatter on
// gloo loses.
//
// All-gather, W-1 steps: in step s rank r sends chunk r-s (its own in step 0)
// and receives chunk r-1-s straight into the output; it forwards that in step
// s+1. No arithmetic and no scratch.
//
// Pipelining. A step is not one message: each chunk is cut into P pieces of at
// most ring_piece_bytes(), and message m = s*P + j carries piece j of step s.
// Messages are processed strictly in m order, so piece j of step s+1 can be
// sent as soon as piece j of step s was received and reduced, while the later
// pieces of step s are still on the wire: receiving overlaps reducing, and the
// ring never waits for a whole chunk. For reduce-scatter, receives land in
// `output` (a chunk's worth of receives posted ahead), or, when output is
// input's chunk r, in a small ring of `depth` piece-sized scratch slots (posted
// `depth` messages ahead): memory cost depth * piece bytes whatever the bucket.
// Partial sums are accumulated in place in `input`, which is why
// reduce-scatter clobbers it: input chunk c is written when its partial sum
// arrives, then only sent, and chunk r (the own addend of the last step) is only
// read. That is also why output may alias input chunk r.
//
// Deadlock freedom: a rank only ever blocks on receive m, and its left
// neighbour posts send m right after processing its own receive m-P (or at the
// start, for step 0), independent of what anyone does later. Induction on m.

// Note [Ring tags]
// gloo pairs a send with a receive by (peer, tag), first come first served per
// tag. Within one op every message uses the op's tag: the ring sends and posts
// receives in the same m order on both sides, so FIFO pairing is exactly right,
// and the piece sizes (which gloo checks) agree because every rank computes the
// same pieces. Ops of one group run one after another on the group's worker,
// yet each gets its own tag (kTagBase + sequence number, same on every rank
// because ranks start ops in the same order): if an op fails part way, its
// stragglers can never be paired with a later op's messages, and a user's own
// send/recv (tag 0 by default) never meets ours. gloo's own collectives use
// separate slot prefixes, so they cannot collide with p2p tags at all.

namespace {

std::atomic<int64_t> g_piece_bytes{1 << 20};
std::atomic<int64_t> g_depth{4};

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// bytes: uint8 is accepted too (the ops that only move data: all-gather, all-to-all).
void check_common(const GroupPtr& pg, const at::Tensor& input, const at::Tensor& output,
                  const char* op, bool bytes = false) {
  TORCH_CHECK(pg, op, ": process group is None");
  TORCH_CHECK_VALUE(input.defined() && output.defined(), op, ": input and output must be tensors");
  TORCH_CHECK_VALUE(input.dim() == 1 && output.dim() == 1, op,
                    ": input and output must be 1-D, got shapes ", input.sizes(), " and ",
                    output.sizes());
  TORCH_CHECK_VALUE(input.is_contiguous() && output.is_contiguous(), op,
                    ": input and output must be contiguous");
  TORCH_CHECK_VALUE(input.scalar_type() == output.scalar_type(), op,
                    ": input and output dtypes differ: ", input.scalar_type(), " vs ",
                    output.scalar_type());
  TORCH_CHECK_VALUE(is_supported_dtype(input.scalar_type()) || (bytes && input.scalar_type() == at::kByte), op,
                    ": dtype must be float32, bfloat16 or float16", bytes ? " (or uint8)" : "", ", got ",
                    input.scalar_type());
  TORCH_CHECK_VALUE(input.device() == output.device(), op, ": input and output devices differ: ",
                    input.device(), " vs ", output.device());
}

// `inner` is one chunk of `outer`'s length-n chunks; returns whether `inner` is
// exactly chunk `rank` (in place). Any other overlap is refused: the ring would
// overwrite data it has yet to send.
bool check_aliasing(const at::Tensor& outer, const at::Tensor& inner, int64_t rank, const char* op,
                    const char* outer_name, const char* inner_name) {
  const int64_t n = inner.numel();
  if (n == 0) return false;
  const bool exact = inner.data_ptr() == outer.narrow(0, rank * n, n).data_ptr();
  if (exact) return true;
  TORCH_CHECK_VALUE(at::get_overlap_status(outer, inner) == at::MemOverlapStatus::No, op, ": ",
                    inner_name, " overlaps ", outer_name, " but is not exactly its chunk ", rank,
                    " (", outer_name, "[", rank * n, ":", (rank + 1) * n,
                    "]); only that in-place form is supported");
  return false;
}

void check_reduce_scatter(const GroupPtr& pg, const at::Tensor& input, const at::Tensor& output,
                          const char* op) {
  check_common(pg, input, output, op);
  const int64_t w = pg->getSize();
  TORCH_CHECK_VALUE(input.numel() % w == 0, op, ": input numel ", input.numel(),
                    " is not a multiple of world size ", w);
  TORCH_CHECK_VALUE(output.numel() * w == input.numel(), op, ": output numel ", output.numel(),
                    " must be input numel / world size = ", input.numel() / w);
  check_aliasing(input, output, pg->getRank(), op, "input", "output");
}

void check_all_gather(const GroupPtr& pg, const at::Tensor& input, const at::Tensor& output,
                      const char* op) {
  check_common(pg, input, output, op, /*bytes=*/true);
  const int64_t w = pg->getSize();
  TORCH_CHECK_VALUE(output.numel() == input.numel() * w, op, ": output numel ", output.numel(),
                    " must be world size * input numel = ", input.numel() * w);
  check_aliasing(output, input, pg->getRank(), op, "output", "input");
}

// One op's view of the ring: its neighbours, tag and deadline per receive;
// every failure names the neighbour (peers.h).
class Ring {
 public:
  Ring(const GroupPtr& pg, int tag, std::chrono::milliseconds timeout, const char* op)
      : peers_(pg, tag, timeout, op, "The peer may have died or not started this collective.") {}

  int64_t rank() const { return peers_.rank(); }
  int64_t world() const { return peers_.world(); }

  WorkPtr send_right(const at::Tensor& t) const { return peers_.send(t, right()); }
  WorkPtr recv_left(const at::Tensor& t) const { return peers_.recv(t, left()); }
  void wait_recv(const WorkPtr& w) const { peers_.wait(w, "receiving from", left()); }
  void wait_send(const WorkPtr& w) const { peers_.wait(w, "sending to", right()); }

 private:
  int64_t right() const { return (rank() + 1) % world(); }
  int64_t left() const { return (rank() + world() - 1) % world(); }

  Peers peers_;
};

// Splits a chunk of n elements into pieces of `piece` elements (the last shorter).
struct Pieces {
  int64_t n, piece, count;
  Pieces(int64_t n_, int64_t piece_) : n(n_), piece(piece_), count((n_ + piece_ - 1) / piece_) {}
  at::Tensor of(const at::Tensor& chunk, int64_t j) const {
    const int64_t begin = j * piece;
    return chunk.narrow(0, begin, std::min(piece, n - begin));
  }
};

int64_t piece_elems(const at::Tensor& t) {
  return std::max<int64_t>(1, g_piece_bytes.load() / static_cast<int64_t>(t.element_size()));
}

at::Tensor chunk_of(const at::Tensor& buffer, int64_t c, int64_t world, int64_t n) {
  c = ((c % world) + world) % world;
  return buffer.narrow(0, c * n, n);
}

// See Note [Ring schedule].
void ring_reduce_scatter(const Ring& ring, const at::Tensor& input, const at::Tensor& output,
                         int64_t piece, int64_t depth) {
  const int64_t w = ring.world(), r = ring.rank(), n = output.numel();
  if (n == 0) return;
  auto chunk = [&](int64_t c) { return chunk_of(input, c, w, n); };
  if (w == 1) {
    if (input.data_ptr() != output.data_ptr()) output.copy_(input);
    return;
  }
  const Pieces pieces(n, std::min(piece, n));
  const int64_t p = pieces.count, messages = (w - 1) * p;
  // Where messages land (Note [Ring schedule], pipelining): in `output` itself
  // when it is a separate buffer, piece j of every step in output's piece j, so
  // a whole chunk of receives is posted ahead at no memory cost; when output is
  // input's own chunk (in place) it still holds our last addend, so messages
  // land in `depth` piece-sized scratch slots instead.
  const bool land_in_output = output.data_ptr() != chunk(r).data_ptr();
  const int64_t slots = land_in_output ? p : std::min(messages, std::max<int64_t>(1, depth));
  at::Tensor scratch =
      land_in_output ? at::Tensor() : at::empty({slots, pieces.piece}, input.options());
  // Message m lands in slot m % slots, trimmed to piece m % p's length.
  auto slot = [&](int64_t m) {
    if (land_in_output) return pieces.of(output, m % p);
    return scratch[m % slots].narrow(0, 0, pieces.of(output, m % p).numel());
  };

  std::vector<WorkPtr> recvs(messages), sends;
  sends.reserve(messages);
  for (int64_t m = 0; m < slots; ++m) recvs[m] = ring.recv_left(slot(m));
  for (int64_t j = 0; j < p; ++j) sends.push_back(ring.send_right(pieces.of(chunk(r - 1), j)));

  for (int64_t m = 0; m < messages; ++m) {
    const int64_t s = m / p, j = m % p;
    ring.wait_recv(recvs[m]);
    recvs[m].reset();
    const at::Tensor got = slot(m);
    if (s == w - 2) {
      // Last step: chunk r, plus our own addend, is the result.
      at::Tensor result = pieces.of(output, j);
      if (land_in_output) {
        result.add_(pieces.of(chunk(r), j));  // `got` is this very piece
      } else {
        at::add_out(result, pieces.of(chunk(r), j), got);
      }
    } else {
      at::Tensor partial = pieces.of(chunk(r - 2 - s), j);
      partial.add_(got);
      sends.push_back(ring.send_right(partial));
    }
    // The slot is consumed: reuse it for the message `slots` ahead.
    if (m + slots < messages) recvs[m + slots] = ring.recv_left(slot(m + slots));
  }
  for (const auto& s : sends) ring.wait_send(s);
}

// See Note [Ring schedule].
void ring_all_gather(const Ring& ring, const at::Tensor& input, const at::Tensor& output,
                     int64_t piece) {
  const int64_t w = ring.world(), r = ring.rank(), n = input.numel();
  if (n == 0) return;
  auto chunk = [&](int64_t c) { return chunk_of(output, c, w, n); };
  const bool in_place = input.data_ptr() == chunk(r).data_ptr();
  if (w == 1) {
    if (!in_place) output.copy_(input);
    return;
  }
  // Pieces exist so that a piece can be forwarded while the next is on the
  // wire; with two ranks nothing is forwarded, and one message per direction
  // measured ~10% faster than 1 MB pieces (benchmarks/results/).
  const Pieces pieces(n, w == 2 ? n : std::min(piece, n));
  const int64_t p = pieces.count, messages = (w - 1) * p;

  // Receives go straight to their final place, so all can be posted up front.
  std::vector<WorkPtr> recvs(messages), sends;
  sends.reserve(messages);
  for (int64_t m = 0; m < messages; ++m)
    recvs[m] = ring.recv_left(pieces.of(chunk(r - 1 - m / p), m % p));
  for (int64_t j = 0; j < p; ++j) sends.push_back(ring.send_right(pieces.of(input, j)));
  // While the first pieces are on the wire. (Chunk r is never received into.)
  if (!in_place) chunk(r).copy_(input);

  for (int64_t m = 0; m < messages; ++m) {
    const int64_t s = m / p, j = m % p;
    ring.wait_recv(recvs[m]);
    recvs[m].reset();
    if (s < w - 2) sends.push_back(ring.send_right(pieces.of(chunk(r - 1 - s), j)));
  }
  for (const auto& s : sends) ring.wait_send(s);
}

// Row j of input to rank j, row j of output from rank j (rows of n elements);
// our own row is copied. Every receive is posted first, then every send; the
// receives are waited for in rank order, each naming its peer on failure.
void peer_all_to_all(const Peers& peers, const at::Tensor& input, const at::Tensor& output) {
  const int64_t w = peers.world(), r = peers.rank(), n = input.numel() / w;
  auto row = [n](const at::Tensor& t, int64_t j) { return t.narrow(0, j * n, n); };
  if (n == 0) return;
  std::vector<WorkPtr> recvs(w), sends(w);
  for (int64_t j = 0; j < w; ++j) {
    if (j != r) recvs[j] = peers.recv(row(output, j), j);
  }
  for (int64_t j = 0; j < w; ++j) {
    if (j != r) sends[j] = peers.send(row(input, j), j);
  }
  row(output, r).copy_(row(input, r));
  for (int64_t j = 0; j < w; ++j) {
    if (j != r) peers.wait(recvs[j], "receiving from", j);
  }
  for (int64_t j = 0; j < w; ++j) {
    if (j != r) peers.wait(sends[j], "sending to", j);
  }
}

}  // namespace

WorkPtr start_all_to_all(const GroupPtr& pg, at::Tensor input, at::Tensor output) {
  constexpr const char* op = "all_to_all";
  check_common(pg, input, output, op, /*bytes=*/true);
  TORCH_CHECK_VALUE(input.device().is_cpu(), op, ": needs CPU tensors, got ", input.device());
  const int64_t w = pg->getSize();
  TORCH_CHECK_VALUE(input.numel() == output.numel() && input.numel() % w == 0, op, ": input and output must "
                    "have the same numel, a multiple of the group size ", w, "; got ", input.numel(), " and ",
                    output.numel());
  TORCH_CHECK_VALUE(input.numel() == 0 || at::get_overlap_status(input, output) == at::MemOverlapStatus::No, op,
                    ": input and output overlap");
  const auto timeout = group_timeout(pg);
  return enqueue(pg, c10d::OpType::ALLTOALL_BASE, {output}, [pg, input, output, timeout](int tag) {
    const Peers peers(pg, tag, timeout, "all_to_all", "The peer may have died or not started this collective.");
    peer_all_to_all(peers, input, output);
  });
}

std::chrono::milliseconds group_timeout(const GroupPtr& pg) {
  try {
    return pg->getBackend(c10::DeviceType::CPU)->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    return kBackendDefaultTimeout;  // a backend without options: c10d's default
  }
}

WorkPtr start_reduce_scatter(const GroupPtr& pg, at::Tensor input, at::Tensor output) {
  constexpr const char* op = "ring reduce_scatter";
  check_reduce_scatter(pg, input, output, op);
  TORCH_CHECK_VALUE(input.device().is_cpu(), op, ": the ring needs CPU tensors, got ",
                    input.device(), " (use impl=\"native\")");
  const auto timeout = group_timeout(pg);
  const int64_t piece = piece_elems(input), depth = g_depth.load();
  return enqueue(pg, c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                 [pg, input, output, timeout, piece, depth](int tag) {
                   const Ring ring(pg, tag, timeout, "ring reduce_scatter");
                   ring_reduce_scatter(ring, input, output, piece, depth);
                 });
}

WorkPtr start_all_gather(const GroupPtr& pg, at::Tensor input, at::Tensor output) {
  return start_all_gather_after(pg, WorkPtr(), std::move(input), std::move(output));
}

WorkPtr start_all_gather_after(const GroupPtr& pg, WorkPtr after, at::Tensor input, at::Tensor output,
                               std::function<void()> then) {
  constexpr const char* op = "ring all_gather";
  check_all_gather(pg, input, output, op);
  TORCH_CHECK_VALUE(input.device().is_cpu(), op, ": the ring needs CPU tensors, got ",
                    input.device(), " (use impl=\"native\")");
  const auto timeout = group_timeout(pg);
  const int64_t piece = piece_elems(input);
  return enqueue(pg, c10d::OpType::_ALLGATHER_BASE, {output},
                 [pg, after = std::move(after), then = std::move(then), input, output, timeout, piece](int tag) {
                   if (after) after->wait();
                   if (then) then();
                   const Ring ring(pg, tag, timeout, "ring all_gather");
                   ring_all_gather(ring, input, output, piece);
                 });
}

// torch 2.13 renamed ProcessGroup::_reduce_scatter_base / _allgather_base to
// reduce_scatter_single / all_gather_single (the old names stay, deprecated);
// older torch (the GPU image's 2.11) has only the old ones.
#define SHARDOPT_TORCH_HAS_SINGLE_COLLECTIVES \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13))

WorkPtr start_reduce_scatter_native(const GroupPtr& pg, at::Tensor input, at::Tensor output) {
  check_reduce_scatter(pg, input, output, "native reduce_scatter");
  // Note [gloo's reduce-scatter copies on every wait] (gloo_reduce_scatter.h).
  if (input.device().is_cpu() && ring_is_default(pg)) return start_gloo_reduce_scatter(pg, input, output);
#if SHARDOPT_TORCH_HAS_SINGLE_COLLECTIVES
  return pg->reduce_scatter_single(output, input);
#else
  return pg->_reduce_scatter_base(output, input);
#endif
}

WorkPtr start_all_gather_native(const GroupPtr& pg, at::Tensor input, at::Tensor output) {
  check_all_gather(pg, input, output, "native all_gather");
#if SHARDOPT_TORCH_HAS_SINGLE_COLLECTIVES
  return pg->all_gather_single(output, input);
#else
  return pg->_allgather_base(output, input);
#endif
}

Impl parse_impl(const std::string& name) {
  if (name == "auto") return Impl::kAuto;
  if (name == "ring") return Impl::kRing;
  if (name == "native") return Impl::kNative;
  TORCH_CHECK_VALUE(false, "impl must be \"auto\", \"ring\" or \"native\", got \"", name, "\"");
}

bool ring_is_default(const GroupPtr& pg) {
  // Ask the CPU backend, not the group's name: a group made with
  // "cpu:gloo,cuda:nccl" reports neither, but CPU tensors go to gloo.
  try {
    return pg->getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo";
  } catch (const std::exception&) {
    return false;  // no CPU backend: nothing for the ring to run on
  }
}

static bool use_ring(const GroupPtr& pg, const at::Tensor& t, Impl impl) {
  if (impl == Impl::kAuto) return t.device().is_cpu() && ring_is_default(pg);
  return impl == Impl::kRing;
}

WorkPtr start_reduce_scatter_auto(const GroupPtr& pg, at::Tensor input, at::Tensor output,
                                  Impl impl) {
  TORCH_CHECK(pg, "reduce_scatter: process group is None");
  return use_ring(pg, input, impl) ? start_reduce_scatter(pg, input, output)
                                   : start_reduce_scatter_native(pg, input, output);
}

WorkPtr start_all_gather_auto(const GroupPtr& pg, at::Tensor input, at::Tensor output, Impl impl) {
  TORCH_CHECK(pg, "all_gather: process group is None");
  return use_ring(pg, input, impl) ? start_all_gather(pg, input, output)
                                   : start_all_gather_native(pg, input, output);
}

int64_t ring_piece_bytes() {
  return g_piece_bytes.load();
}

void set_ring_piece_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes > 0, "ring piece size must be positive, got ", bytes);
  g_piece_bytes.store(bytes);
}

int64_t ring_depth() {
  return g_depth.load();
}

void set_ring_depth(int64_t depth) {
  TORCH_CHECK_VALUE(depth > 0, "ring depth must be positive, got ", depth);
  g_depth.store(depth);
}

}  // namespace shardopt::comm
