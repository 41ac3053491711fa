//! @file collectives.hpp
//! @brief Time of one collective on a real group: ring all-gather / reduce-scatter, all-to-all,
//! the EP dispatch / combine of each dispatcher, and point-to-point, priced on the intra-node or
//! inter-node link according to where the group's members sit (placement.hpp).
#pragma once

#include <algorithm>
#include <cmath>

#include "calibration.hpp"
#include "cluster.hpp"
#include "efficiency.hpp"
#include "model.hpp"
#include "placement.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! All-gather (or reduce-scatter) whose full result is `bytes` per rank: every rank receives
//! (n-1)/n of it. A ring that leaves a node runs at the inter-node rate of each GPU's NIC.
[[nodiscard]] inline double ring_time(double bytes, const group_placement& g,
                                      const cluster_config& c, const efficiency& e) {
  if (g.size <= 1 || bytes <= 0) return 0.0;
  const double n = g.size;
  const bool inter = g.crosses_nodes();
  // Measured bus bandwidth by size (it includes the latency), when calibrated.
  if (const calibration* cal = e.measured) {
    const auto& t = inter ? cal->collectives.ring_inter : cal->collectives.ring_intra;
    if (!t.empty()) return (n - 1) / n * bytes / detail::interpolate_log(t, bytes);
  }
  const double bw = inter ? c.inter_bw * e.ring_inter : c.intra_bw * e.ring_intra;
  const double lat = inter ? c.inter_latency_s : c.intra_latency_s;
  return (n - 1) / n * bytes / bw + (n - 1) * lat;
}

//! All-to-all where each rank sends `bytes` in total, spread evenly over the group (its own
//! share stays). Traffic to peers on the same node and to other nodes flows at the same time;
//! the slower of the two sets the time.
[[nodiscard]] inline double a2a_time(double bytes, const group_placement& g,
                                     const cluster_config& c, const efficiency& e) {
  if (g.size <= 1 || bytes <= 0) return 0.0;
  const double n = g.size;
  const double leaving = bytes * (n - 1) / n;
  const double off = g.off_node_fraction();
  // Measured bus bandwidth by size per link class (latency included), when calibrated; a side
  // without a table keeps the built-in rate and latency.
  const calibration* cal = e.measured;
  const std::vector<sized_rate>* in_t =
      cal != nullptr && !cal->collectives.a2a_intra.empty() ? &cal->collectives.a2a_intra : nullptr;
  const std::vector<sized_rate>* out_t =
      cal != nullptr && !cal->collectives.a2a_inter.empty() ? &cal->collectives.a2a_inter : nullptr;
  const double t_in = leaving * (1.0 - off) /
                      (in_t ? detail::interpolate_log(*in_t, bytes) : c.intra_bw * e.a2a_intra);
  const double t_out =
      leaving * off / (out_t ? detail::interpolate_log(*out_t, bytes) : c.inter_bw * e.a2a_inter);
  const bool measured = g.crosses_nodes() ? out_t != nullptr : in_t != nullptr;
  const double lat = g.crosses_nodes() ? c.inter_latency_s : c.intra_latency_s;
  return std::max(t_in, t_out) + (measured ? 0.0 : 2 * lat);
}

//! Expected number of parts a token reaches when it picks `k` distinct items of `items` and the
//! items fall evenly into `parts` parts: parts * (1 - C(items - items/parts, k) / C(items, k)).
//! (Routing is taken as uniform: Megatron-Bridge's published runs force-balance it.)
[[nodiscard]] inline double expected_parts_hit(double items, double parts, int k) noexcept {
  if (parts <= 1 || items <= 0) return parts > 0 ? 1.0 : 0.0;
  const double other = items - items / parts;  // items outside one given part
  double miss = 1.0;                           // P(the part gets none of the k picks)
  for (int i = 0; i < k && miss > 0; ++i)
    miss = other - i > 0 ? miss * (other - i) / (items - i) : 0;
  return parts * (1.0 - miss);
}

//! Where one token's k expert copies land in an EP group of `ranks` ranks over `nodes` nodes:
//! the expected distinct nodes and distinct ranks it reaches. Group-limited routing confines
//! the k picks to router_group_topk groups; when groups line up with nodes (or ranks), only the
//! chosen groups' nodes (ranks) can be reached.
struct token_spread {
  double nodes = 1, ranks = 1;
};

[[nodiscard]] inline token_spread spread_of_token(const model_config& m, int ranks, int nodes) {
  const double e = m.experts, n = ranks, nn = nodes;
  token_spread t{expected_parts_hit(e, nn, m.topk), expected_parts_hit(e, n, m.topk)};
  if (m.router_groups > 0 && m.router_group_topk < m.router_groups) {
    const double groups = m.router_groups, chosen = m.router_group_topk;
    const double per_group = e / groups;  // experts of one group
    if (m.router_groups % nodes == 0)     // whole groups per node: the chosen groups' nodes
      t.nodes = std::min(t.nodes, expected_parts_hit(groups, nn, m.router_group_topk));
    else if (nodes % m.router_groups == 0)  // a group spans nodes/groups nodes
      t.nodes =
          std::min(t.nodes, expected_parts_hit(chosen * per_group, chosen * nn / groups, m.topk));
    const double per_rank = e / n;
    if (std::fmod(per_group, per_rank) == 0)  // groups made of whole ranks
      t.ranks = std::min(
          t.ranks, expected_parts_hit(chosen * per_group, chosen * per_group / per_rank, m.topk));
  }
  return t;
}

//! One EP dispatch or combine: each rank sends `tokens` tokens of `row_bytes` each to the
//! experts of their top-k (and receives as much back). With the `alltoall` dispatcher every
//! (token, expert) pair is a row of an NCCL all-to-all. DeepEP and HybridEP send a token once
//! to each destination node over RDMA and forward it over NVLink to each destination GPU
//! there; inside a node, once to each destination GPU. Both links run at once; the slower one
//! sets the time.
[[nodiscard]] inline double ep_exchange_time(double tokens, double row_bytes, const model_config& m,
                                             const group_placement& g, const cluster_config& c,
                                             const efficiency& e) {
  if (g.size <= 1 || tokens <= 0 || row_bytes <= 0) return 0.0;
  if (e.stack.dispatcher == ep_dispatcher::alltoall)
    return a2a_time(tokens * m.topk * row_bytes, g, c, e);
  const double n = g.size, nodes = g.nodes, per_node = n / nodes;
  const token_spread t = spread_of_token(m, g.size, g.nodes);
  // Remote nodes and, on each reached node, the GPUs other than the one that received it.
  const double inter = tokens * row_bytes * t.nodes * (nodes - 1) / nodes;
  const double intra = tokens * row_bytes * t.ranks * (per_node - 1) / per_node;
  const double lat = g.crosses_nodes() ? c.inter_latency_s : c.intra_latency_s;
  return std::max(inter / (c.inter_bw * e.deepep_inter), intra / (c.intra_bw * e.deepep_intra)) +
         2 * lat;
}

//! Fraction of the GPU's SMs the EP communication kernels hold while they run beside compute.
[[nodiscard]] inline double comm_sm_fraction(const efficiency& e) noexcept {
  const double sms = e.stack.dispatcher == ep_dispatcher::deepep     ? e.deepep_sms
                     : e.stack.dispatcher == ep_dispatcher::hybridep ? e.hybridep_sms
                                                                     : e.nccl_sms;
  return e.sm_count > 0 ? std::min(1.0, sms / e.sm_count) : 0.0;
}

//! One point-to-point message of `bytes` between neighbouring pipeline stages.
[[nodiscard]] inline double p2p_time(double bytes, const group_placement& pp,
                                     const cluster_config& c, const efficiency& e) {
  if (pp.size <= 1 || bytes <= 0) return 0.0;
  const bool inter = pp.crosses_nodes();
  const double bw = inter ? c.inter_bw * e.ring_inter : c.intra_bw * e.ring_intra;
  return bytes / bw + (inter ? c.inter_latency_s : c.intra_latency_s);
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
