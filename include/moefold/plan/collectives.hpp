//! @file collectives.hpp
//! @brief Time of one collective on a real group: ring all-gather / reduce-scatter, all-to-all
//! and point-to-point, priced on the intra-node or inter-node link according to where the
//! group's members sit (placement.hpp).
#pragma once

#include <algorithm>

#include "calibration.hpp"
#include "cluster.hpp"
#include "efficiency.hpp"
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
