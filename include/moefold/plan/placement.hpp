//! @file placement.hpp
//! @brief Where the real process groups of a folded mesh fall on the nodes. The planner prices
//! every collective by the groups Megatron-Core builds (mesh/groups.hpp), not by a guess from
//! the sizes: with folding, whether an EP group stays inside a node depends on the order and
//! on every other size.
#pragma once

#include <vector>

#include "../mesh/fold.hpp"
#include "../mesh/groups.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! How one kind of group sits on the nodes (worst group of the kind).
struct group_placement {
  int size = 1;       //!< ranks per group
  int nodes = 1;      //!< most nodes one group spans
  int min_local = 1;  //!< fewest members of one group that share a node with a given member
  [[nodiscard]] bool crosses_nodes() const noexcept { return nodes > 1; }
  //! Largest fraction of a member's peers that sit on other nodes (0 inside a node).
  [[nodiscard]] double off_node_fraction() const noexcept {
    return size > 1 ? static_cast<double>(size - min_local) / (size - 1) : 0.0;
  }
};

struct fold_placement {
  group_placement tp, cp, ep, etp, dp_cp, edp, pp;
};

namespace detail {

inline group_placement place(const group_list& l, int gpus_per_node, std::vector<int>& count) {
  group_placement p;
  p.size = l.group_size();
  p.min_local = p.size;
  p.nodes = 1;
  for (int g = 0; g < l.count(); ++g) {
    int nodes = 0;
    for (int k = 0; k < p.size; ++k) {
      int& c = count[static_cast<std::size_t>(l(g, k) / gpus_per_node)];
      nodes += c == 0 ? 1 : 0;
      ++c;
    }
    for (int k = 0; k < p.size; ++k) {
      const int c = count[static_cast<std::size_t>(l(g, k) / gpus_per_node)];
      if (c < p.min_local) p.min_local = c;
    }
    for (int k = 0; k < p.size; ++k) count[static_cast<std::size_t>(l(g, k) / gpus_per_node)] = 0;
    if (nodes > p.nodes) p.nodes = nodes;
  }
  return p;
}

}  // namespace detail

//! The placement of the groups that carry traffic in a training step.
[[nodiscard]] inline fold_placement place_groups(const dynamic_folded_mesh& f, int gpus_per_node) {
  const megatron_groups groups(f);
  std::vector<int> count(static_cast<std::size_t>(f.world_size() / gpus_per_node + 1), 0);
  auto p = [&](group_kind k) { return detail::place(groups(k), gpus_per_node, count); };
  return {p(group_kind::tp),    p(group_kind::cp),  p(group_kind::ep), p(group_kind::etp),
          p(group_kind::dp_cp), p(group_kind::edp), p(group_kind::pp)};
}

//! Only the attention-mesh groups (tp, cp, dp-cp, pp): under one order they depend on tp, cp
//! and pp alone, so a search can reuse them across every MoE mapping.
inline void place_attention_groups(const dynamic_folded_mesh& f, int gpus_per_node,
                                   fold_placement& out) {
  const megatron_groups groups(f);
  std::vector<int> count(static_cast<std::size_t>(f.world_size() / gpus_per_node + 1), 0);
  auto p = [&](group_kind k) { return detail::place(groups(k), gpus_per_node, count); };
  out.tp = p(group_kind::tp);
  out.cp = p(group_kind::cp);
  out.dp_cp = p(group_kind::dp_cp);
  out.pp = p(group_kind::pp);
}

//! Only the MoE-mesh groups (ep, etp, edp): they depend on etp, ep and pp alone.
inline void place_moe_groups(const dynamic_folded_mesh& f, int gpus_per_node, fold_placement& out) {
  const megatron_groups groups(f);
  std::vector<int> count(static_cast<std::size_t>(f.world_size() / gpus_per_node + 1), 0);
  auto p = [&](group_kind k) { return detail::place(groups(k), gpus_per_node, count); };
  out.ep = p(group_kind::ep);
  out.etp = p(group_kind::etp);
  out.edp = p(group_kind::edp);
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
