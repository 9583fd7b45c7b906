// Who a peer is, for error messages: its global rank and host, not only its
// rank in the sub-group an op runs on.
//
// Note [Naming a peer]
// --------------------
// shardopt's collectives run on sub-groups: a node, the ranks of one local rank
// across the nodes, a mesh's replicate or shard group, stage 3's copies of
// them. A rank's index in such a group ("replica rank 1") means nothing to the
// user's launcher or logs, which know global ranks and hosts. A c10d group does
// not know its members' global ranks (Python's torch.distributed keeps that
// map), so Python registers them here once, when it builds or first uses a
// group (shardopt/parallel/peers.py): the group's members in group-rank order,
// a label saying what the group is for ("node", "across-nodes", "replicate",
// "shard", "world", ...), and, per global rank, the host that rank runs on
// (learned at the optimizer's construction: one all-gather of each rank's
// hostname and the address of its GLOO_SOCKET_IFNAME interface). Every error
// about a peer, C++ or Python, formats the peer with peer_name():
//
//   global rank 2 (host node-b/10.0.0.7, rank 1 of the across-nodes group)
//
// and the rank that raises with self_name(). The registry is keyed by the
// group's address and holds it weakly (a destroyed group's address may be
// reused by a new one, which then counts as unregistered). An unregistered
// group still names the peer by its group rank, saying that its global rank
// is unknown.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace shardopt::comm {

// Registers `pg`'s members: global_ranks[r] is group rank r's global rank
// (global_ranks.size() must be pg's size). `label` says what the group is
// ("node": "rank 1 of the node group"). Registering again replaces.
void set_group_members(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, std::string label,
                       std::vector<int64_t> global_ranks);
// Whether `pg` is registered (and alive).
bool has_group_members(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);
// The registered label of `pg`, "" when unregistered.
std::string group_label(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);
// Registers the host of each of `global_ranks` (hosts[i] of global_ranks[i]);
// an empty host is left unknown.
void set_rank_hosts(const std::vector<int64_t>& global_ranks, const std::vector<std::string>& hosts);

// "global rank G (host H, rank r of the L group)"; the host is left out when
// unknown; an unregistered group gives "rank r of its group (global rank not
// registered)".
std::string peer_name(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t rank);
// This rank: "rank r of W in the L group (global rank G)"; unregistered:
// "rank r of W".
std::string self_name(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);

}  // namespace shardopt::comm
