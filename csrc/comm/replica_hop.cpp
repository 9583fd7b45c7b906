#include "replica_hop.h"

#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "peers.h"
#include "ring_worker.h"

namespace shardopt::comm {

HopFormat parse_hop_format(const std::string& name) {
  if (name == "exact") return HopFormat::kExact;
  if (name == "bfloat16") return HopFormat::kBFloat16;
  if (name == "int8") return HopFormat::kInt8;
  TORCH_CHECK_VALUE(false, "hop format must be \"exact\", \"bfloat16\" or \"int8\", got \"", name, "\"");
}

at::Tensor hop_encode(const at::Tensor& x, HopFormat format, at::ScalarType exact_dtype) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "hop_encode: x must be a contiguous 1-D float32 tensor");
  if (format == HopFormat::kExact) return x.to(exact_dtype);
  if (format == HopFormat::kBFloat16) return x.to(at::kBFloat16);
  auto payload = at::empty({int8_message_bytes(x.numel())}, x.options().dtype(at::kByte));
  int8_encode(x, at::Tensor(), payload, at::Tensor());
  return payload;
}

at::Tensor hop_decode(const at::Tensor& payload, HopFormat format, int64_t m) {
  if (format != HopFormat::kInt8) return payload.to(at::kFloat);
  auto out = at::empty({m}, payload.options().dtype(at::kFloat));
  int8_decode(payload, out, at::Tensor());
  return out;
}

namespace {

// An empty message of the size peers will send (gloo checks sizes).
at::Tensor message_like(HopFormat format, int64_t m, const at::Tensor& chunk) {
  if (format == HopFormat::kInt8) return at::empty({int8_message_bytes(m)}, chunk.options().dtype(at::kByte));
  if (format == HopFormat::kBFloat16) return at::empty({m}, chunk.options().dtype(at::kBFloat16));
  return at::empty({m}, chunk.options());
}

// Phase 1's sum a_0 + a_1 + ... + a_{w-1} in fp32, in rank order: a_r is our
// own part (exact), the others the decoded messages, each waited for in turn.
at::Tensor decoded_sum(const Peers& peers, int64_t r, int64_t w, const at::Tensor& own, std::vector<at::Tensor>& inbox,
                       std::vector<WorkPtr>& recvs, HopFormat format) {
  const int64_t m = own.numel();
  at::Tensor sum;
  for (int64_t j = 0; j < w; ++j) {
    at::Tensor addend;
    if (j == r) {
      addend = own.to(at::kFloat);
    } else {
      peers.wait(recvs[j], "receiving from", j);
      addend = hop_decode(inbox[j], format, m);
    }
    if (sum.defined()) {
      sum.add_(addend);
    } else {
      sum = j == r ? addend.clone() : addend;  // our own part may be the chunk itself: do not sum into it
    }
  }
  return sum;
}

// The same sum from int8 messages, each decoded and added in one pass. When our
// own part is a_0 or a_1, the first addition is made by the other one's decode
// (own + d_1 or d_0 + own: fp32 addition commutes, so the bits are the same).
at::Tensor int8_sum(const Peers& peers, int64_t r, int64_t w, const at::Tensor& own_part,
                    std::vector<at::Tensor>& inbox, std::vector<WorkPtr>& recvs) {
  const auto own = own_part.to(at::kFloat);
  auto sum = at::empty_like(own);
  auto take = [&](int64_t j, const at::Tensor& base) {
    peers.wait(recvs[j], "receiving from", j);
    int8_decode(inbox[j], sum, base);
  };
  int64_t next;
  if (r <= 1) {
    take(1 - r, own);
    next = 2;
  } else {
    take(0, at::Tensor());
    next = 1;
  }
  for (int64_t j = next; j < w; ++j) {
    if (j == r) {
      sum.add_(own);
    } else {
      take(j, sum);
    }
  }
  return sum;
}

// See Note [Compressed inter-node hop]. scatter_only: phase 1 alone, the sum
// (fp32, exact apart from the additions) written into part r of the chunk; the
// other parts are left as they were (node-aware flat sharding's gradient phase,
// Note [Two-level collectives] in shardopt/parallel/mesh_plan.py).
void replica_all_reduce(const Peers& peers, int64_t r, int64_t w, const at::Tensor& chunk, HopFormat format,
                        const at::Tensor& residual, bool scatter_only) {
  const int64_t n = chunk.numel(), m = n / w;
  const auto dtype = chunk.scalar_type();
  auto part = [&](int64_t j) { return chunk.narrow(0, j * m, m); };
  const bool feedback = residual.defined();
  auto sent_residual = [&](int64_t j) { return residual.narrow(0, j * m, m); };  // phase 1, part j
  auto owned_residual = [&]() { return residual.narrow(0, n, m); };             // phase 2

  // Phase 1: part j to rank j; rank r receives everyone's part r.
  std::vector<at::Tensor> inbox(w);
  std::vector<WorkPtr> recvs(w);
  std::vector<std::pair<int64_t, WorkPtr>> sends;  // (peer, work)
  auto wait_sends = [&] {
    for (const auto& [peer, work] : sends) peers.wait(work, "sending to", peer);
    sends.clear();
  };
  for (int64_t j = 0; j < w; ++j) {
    if (j == r) continue;
    inbox[j] = message_like(format, m, chunk);
    recvs[j] = peers.recv(inbox[j], j);
  }
  std::vector<at::Tensor> outbox(w);
  for (int64_t j = 0; j < w; ++j) {
    if (j == r) continue;
    if (format == HopFormat::kExact) {
      outbox[j] = part(j);  // sent as is; not written before this phase's sends finish
    } else if (format == HopFormat::kInt8) {
      // One pass: part + residual encoded, the residual left with what the rounding lost.
      outbox[j] = message_like(format, m, chunk);
      int8_encode(part(j).to(at::kFloat), feedback ? sent_residual(j) : at::Tensor(), outbox[j], at::Tensor());
    } else {
      auto x = part(j).to(at::kFloat);
      if (feedback) x = x.add(sent_residual(j));
      outbox[j] = hop_encode(x.contiguous(), format, dtype);
      if (feedback) {
        auto res = sent_residual(j);
        at::sub_out(res, x, hop_decode(outbox[j], format, m));
      }
    }
    sends.emplace_back(j, peers.send(outbox[j], j));
  }
  // The sum, in rank order; our own addend never left this rank and is exact.
  const at::Tensor sum = format == HopFormat::kInt8 ? int8_sum(peers, r, w, part(r), inbox, recvs)
                                                    : decoded_sum(peers, r, w, part(r), inbox, recvs, format);
  wait_sends();
  if (scatter_only) {
    part(r).copy_(sum);
    return;
  }

  // Phase 2: our sum to everyone; everyone's sum into its part.
  at::Tensor mine;
  if (format == HopFormat::kExact) {
    part(r).copy_(sum);
    mine = part(r);
  } else if (format == HopFormat::kInt8) {
    // One pass: sum + residual encoded, the residual updated, and the decoded
    // message written where it goes (our part, or the sum in place to be cast).
    mine = message_like(format, m, chunk);
    const bool direct = dtype == at::kFloat;
    int8_encode(sum, feedback ? owned_residual() : at::Tensor(), mine, direct ? part(r) : sum);
    if (!direct) part(r).copy_(sum);
  } else {
    if (feedback) sum.add_(owned_residual());
    mine = hop_encode(sum, format, dtype);
    auto decoded = hop_decode(mine, format, m);
    if (feedback) {
      auto res = owned_residual();
      at::sub_out(res, sum, decoded);
    }
    part(r).copy_(decoded);
  }
  for (int64_t j = 0; j < w; ++j) {
    if (j == r) continue;
    inbox[j] = format == HopFormat::kExact ? part(j) : message_like(format, m, chunk);
    recvs[j] = peers.recv(inbox[j], j);
  }
  for (int64_t j = 0; j < w; ++j) {
    if (j != r) sends.emplace_back(j, peers.send(mine, j));
  }
  for (int64_t j = 0; j < w; ++j) {
    if (j == r) continue;
    peers.wait(recvs[j], "receiving from", j);
    if (format == HopFormat::kInt8 && dtype == at::kFloat) {
      int8_decode(inbox[j], part(j), at::Tensor());
    } else if (format != HopFormat::kExact) {
      part(j).copy_(hop_decode(inbox[j], format, m));
    }
  }
  wait_sends();
}

}  // namespace

WorkPtr start_replica_all_reduce(const GroupPtr& pg, WorkPtr after, at::Tensor chunk, HopFormat format,
                                 at::Tensor residual) {
  return start_replica_hop(pg, std::move(after), std::move(chunk), format, std::move(residual), false);
}

WorkPtr start_replica_reduce_scatter(const GroupPtr& pg, WorkPtr after, at::Tensor chunk, HopFormat format,
                                     at::Tensor residual) {
  return start_replica_hop(pg, std::move(after), std::move(chunk), format, std::move(residual), true);
}

WorkPtr start_replica_hop(const GroupPtr& pg, WorkPtr after, at::Tensor chunk, HopFormat format,
                          at::Tensor residual, bool scatter_only) {
  constexpr const char* op = "inter-node hop";
  TORCH_CHECK(pg, op, ": process group is None");
  TORCH_CHECK_VALUE(chunk.defined() && chunk.dim() == 1 && chunk.is_contiguous(), op,
                    ": the chunk must be a contiguous 1-D tensor");
  TORCH_CHECK_VALUE(chunk.device().is_cpu(), op, ": runs on CPU tensors (gloo), got ", chunk.device());
  const auto dtype = chunk.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
                    ": dtype must be float32, bfloat16 or float16, got ", dtype);
  const int64_t w = pg->getSize(), n = chunk.numel();
  TORCH_CHECK_VALUE(n % w == 0, op, ": chunk of ", n, " elements does not split over ", w, " replicas");
  if (format == HopFormat::kInt8 && residual.defined()) {
    TORCH_CHECK_VALUE(residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                          residual.numel() == n + n / w && residual.device() == chunk.device(),
                      op, ": the int8 residual must be contiguous float32 with ", n + n / w, " elements");
  } else {
    TORCH_CHECK_VALUE(!residual.defined(), op, ": a residual is only kept for the int8 format");
  }
  return enqueue(pg, c10d::OpType::ALLREDUCE, {chunk},
                 [pg, after = std::move(after), chunk, format, residual, scatter_only](int tag) {
                   // The chunk exists once the intra-node reduce-scatter is done;
                   // its failure is this op's failure.
                   if (after) after->wait();
                   const Peers peers(pg, tag, group_timeout(pg), "inter-node hop",
                                     "The node may be down or its link cut.");
                   if (pg->getSize() > 1) replica_all_reduce(peers, pg->getRank(), pg->getSize(), chunk, format,
                                                             residual, scatter_only);
                 });
}

}  // namespace shardopt::comm
