//! @file explain.hpp
//! @brief Why one ranked mapping beats the next: the step-time components where it saves the
//! most, in words a person reads at a glance.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "evaluate.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! The step-time components with their display names, in breakdown order.
[[nodiscard]] inline std::vector<std::pair<const char*, double>> time_components(
    const time_breakdown& t) {
  return {{"gemm", t.gemm},           {"attention", t.attention}, {"elementwise", t.elementwise},
          {"tp_comm", t.tp_comm},     {"cp_comm", t.cp_comm},     {"ep_a2a", t.ep_a2a},
          {"etp_comm", t.etp_comm},   {"sync_idle", t.sync_idle}, {"host", t.host},
          {"recompute", t.recompute}, {"pp_p2p", t.pp_p2p},       {"bubble", t.bubble},
          {"dp_comm", t.dp_comm},     {"optimizer", t.optimizer}};
}

namespace detail {

inline const char* component_words(const std::string& name) {
  if (name == "gemm") return "GEMM time (larger, better-shaped GEMMs)";
  if (name == "attention") return "attention kernels";
  if (name == "elementwise") return "memory-bound kernels";
  if (name == "tp_comm") return "TP/SP communication";
  if (name == "cp_comm") return "exposed CP communication";
  if (name == "ep_a2a") return "EP all-to-all";
  if (name == "etp_comm") return "ETP all-gather/reduce-scatter";
  if (name == "sync_idle") return "GPU idle at the dispatch's host synchronisation";
  if (name == "host") return "host-bound time (kernels issued eagerly, no CUDA graphs)";
  if (name == "recompute") return "recomputation";
  if (name == "pp_p2p") return "pipeline send/receive";
  if (name == "bubble") return "pipeline bubble";
  if (name == "dp_comm") return "exposed DP/EDP gradient traffic";
  if (name == "optimizer") return "optimizer step";
  return "?";
}

inline std::string ep_words(const plan_result& r) {
  const auto& g = r.placement.ep;
  if (g.size <= 1) return "no EP";
  if (!g.crosses_nodes()) return "EP " + std::to_string(g.size) + " inside a node";
  return "EP " + std::to_string(g.size) + " across " + std::to_string(g.nodes) + " nodes";
}

}  // namespace detail

//! One line: how `a` (ranked just above) beats `b`.
[[nodiscard]] inline std::string explain_win(const plan_result& a, const plan_result& b) {
  char buf[96];
  if (!a.feasible) {
    std::snprintf(buf, sizeof buf, "does not fit: needs %.1f GiB (ranked by memory, least first)",
                  a.memory_gib);
    return buf;
  }
  if (!b.feasible) return "the next candidate does not fit in memory";
  std::snprintf(buf, sizeof buf,
                "%.1f%% faster than the next: ", 100.0 * (b.step_time_s / a.step_time_s - 1.0));
  std::string s = buf;
  const auto ca = time_components(a.time), cb = time_components(b.time);
  std::vector<std::pair<double, std::string>> gains;
  for (std::size_t i = 0; i < ca.size(); ++i)
    if (cb[i].second - ca[i].second > 1e-9)
      gains.emplace_back(cb[i].second - ca[i].second, ca[i].first);
  std::sort(gains.rbegin(), gains.rend());
  if (gains.empty()) return s + "same time, smaller model-parallel size";
  for (std::size_t i = 0; i < gains.size() && i < 2; ++i) {
    std::snprintf(buf, sizeof buf, "%s%.0f ms less %s", i ? "; " : "", gains[i].first * 1e3,
                  detail::component_words(gains[i].second));
    s += buf;
    if (gains[i].second == "ep_a2a" || gains[i].second == "etp_comm")
      s += " (" + detail::ep_words(a) + ", etp " + std::to_string(a.map.etp) + " vs " +
           detail::ep_words(b) + ", etp " + std::to_string(b.map.etp) + ")";
    if (gains[i].second == "bubble")
      s += " (pp " + std::to_string(a.map.pp) + " vpp " + std::to_string(a.map.vpp) + ", " +
           std::to_string(a.microbatches) + " micro-batches)";
    if (gains[i].second == "recompute")
      s += " (" + std::string(to_string(a.rc)) + " vs " + std::string(to_string(b.rc)) + ")";
  }
  return s;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
