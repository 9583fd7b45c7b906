// Point-to-point with the other members of one group, for shardopt's own
// collectives on a group's worker (the ring, the inter-node hop, the
// all-to-all): every wait bounded by the group's timeout, and every failure,
// posting or waiting, raised as a DistBackendError naming this rank, the op,
// the peer by its global rank and host (Note [Naming a peer] in
// peer_names.h), the timeout and the original cause:
//
//   shardopt ring all_gather on rank 0 of 2 in the node group (global rank 2):
//   failed receiving from global rank 3 (host node-b/10.0.0.7, rank 1 of the
//   node group); process group timeout 30000 ms, tag 1560281088. The peer may
//   have died or not started this collective. Cause: ...
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "peer_names.h"
#include "ring.h"

namespace shardopt::comm {

class Peers {
 public:
  // `op` names the collective ("ring all_gather"); `advice` is the sentence
  // after the timeout (what the failure probably means).
  Peers(const GroupPtr& pg, int tag, std::chrono::milliseconds timeout, const char* op, const char* advice)
      : pg_(pg), rank_(pg->getRank()), world_(pg->getSize()), tag_(tag), timeout_(timeout), op_(op),
        advice_(advice) {}

  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }

  WorkPtr send(const at::Tensor& t, int64_t peer) const {
    return guarded("sending to", peer, [&] {
      std::vector<at::Tensor> ts{t};
      return pg_->send(ts, static_cast<int>(peer), tag_);
    });
  }
  WorkPtr recv(const at::Tensor& t, int64_t peer) const {
    return guarded("receiving from", peer, [&] {
      std::vector<at::Tensor> ts{t};
      return pg_->recv(ts, static_cast<int>(peer), tag_);
    });
  }
  // `what`: "sending to" or "receiving from", as the op was posted.
  void wait(const WorkPtr& w, const char* what, int64_t peer) const {
    guarded(what, peer, [&] { return w->wait(timeout_); });
  }

 private:
  // Posting can fail too (gloo throws at once on a closed connection), so both
  // posting and waiting report which peer and which op.
  template <typename F>
  auto guarded(const char* what, int64_t peer, F&& f) const -> decltype(f()) {
    try {
      return f();
    } catch (const std::exception& e) {
      const auto* ce = dynamic_cast<const c10::Error*>(&e);
      TORCH_CHECK_WITH(DistBackendError, false, "shardopt ", op_, " on ", self_name(pg_), ": failed ", what, " ",
                       peer_name(pg_, peer), "; process group timeout ", timeout_.count(), " ms, tag ", tag_,
                       ". ", advice_, " Cause: ", ce ? ce->what_without_backtrace() : e.what());
    }
  }

  GroupPtr pg_;
  int64_t rank_, world_;
  int tag_;
  std::chrono::milliseconds timeout_;
  const char* op_;
  const char* advice_;
};

}  // namespace shardopt::comm
