#include "peer_names.h"

#include <mutex>
#include <sstream>
#include <unordered_map>

#include <c10/util/Exception.h>

namespace shardopt::comm {

namespace {

struct Members {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;  // to tell a live group from a reused address
  std::string label;
  std::vector<int64_t> global_ranks;
};

struct PeerRegistry {
  std::mutex mu;
  std::unordered_map<const c10d::ProcessGroup*, Members> groups;
  std::unordered_map<int64_t, std::string> hosts;  // global rank -> host
};

PeerRegistry& peer_registry() {
  // Leaked on purpose, as the ring workers' registry (ring_worker.cpp): errors
  // may be formatted by detached worker threads while static destructors run.
  static auto* r = new PeerRegistry();
  return *r;
}

// The registered members of pg, or nullptr; call with the registry's lock held.
const Members* find_locked(PeerRegistry& reg, const c10d::ProcessGroup* pg) {
  auto it = reg.groups.find(pg);
  if (it == reg.groups.end()) return nullptr;
  if (it->second.group.lock().get() != pg) {  // that group is gone; this is another at its address
    reg.groups.erase(it);
    return nullptr;
  }
  return &it->second;
}

}  // namespace

void set_group_members(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, std::string label,
                       std::vector<int64_t> global_ranks) {
  TORCH_CHECK_VALUE(pg, "set_group_members: process group is None");
  TORCH_CHECK_VALUE(static_cast<int64_t>(global_ranks.size()) == pg->getSize(), "set_group_members: ",
                    global_ranks.size(), " global ranks for a group of ", pg->getSize());
  auto& reg = peer_registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  // Drop the entries of groups that no longer exist, so programs that make many groups do not collect them.
  for (auto it = reg.groups.begin(); it != reg.groups.end();) {
    if (it->second.group.expired()) {
      it = reg.groups.erase(it);
    } else {
      ++it;
    }
  }
  reg.groups.insert_or_assign(pg.get(), Members{c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg), std::move(label),
                                                std::move(global_ranks)});
}

bool has_group_members(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  if (!pg) return false;
  auto& reg = peer_registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  return find_locked(reg, pg.get()) != nullptr;
}

std::string group_label(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  if (!pg) return "";
  auto& reg = peer_registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const Members* m = find_locked(reg, pg.get());
  return m ? m->label : "";
}

void set_rank_hosts(const std::vector<int64_t>& global_ranks, const std::vector<std::string>& hosts) {
  TORCH_CHECK_VALUE(global_ranks.size() == hosts.size(), "set_rank_hosts: ", global_ranks.size(),
                    " ranks but ", hosts.size(), " hosts");
  auto& reg = peer_registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (!hosts[i].empty()) reg.hosts[global_ranks[i]] = hosts[i];
  }
}

std::string peer_name(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t rank) {
  std::ostringstream out;
  auto& reg = peer_registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const Members* m = pg ? find_locked(reg, pg.get()) : nullptr;
  if (!m || rank < 0 || rank >= static_cast<int64_t>(m->global_ranks.size())) {
    out << "rank " << rank << " of its group (global rank not registered)";
    return out.str();
  }
  const int64_t global = m->global_ranks[rank];
  out << "global rank " << global << " (";
  auto host = reg.hosts.find(global);
  if (host != reg.hosts.end()) out << "host " << host->second << ", ";
  out << "rank " << rank << " of the " << m->label << " group)";
  return out.str();
}

std::string self_name(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  std::ostringstream out;
  if (!pg) return "rank ?";
  const int64_t rank = pg->getRank();
  out << "rank " << rank << " of " << pg->getSize();
  auto& reg = peer_registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const Members* m = find_locked(reg, pg.get());
  if (m && rank >= 0 && rank < static_cast<int64_t>(m->global_ranks.size())) {
    out << " in the " << m->label << " group (global rank " << m->global_ranks[rank] << ")";
  }
  return out.str();
}

}  // namespace shardopt::comm
