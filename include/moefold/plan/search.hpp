//! @file search.hpp
//! @brief Every legal folded mapping of a model on a cluster, evaluated and ranked. Sizes the
//! caller fixes are kept; the others range over their legal values (divisors of the GPU count
//! that also divide the model's heads, experts, FFN sizes, layers, sequence and batch, exactly
//! the rules of check_mapping). The fold of each (tp, cp, ep, etp, pp) is checked and placed
//! once and reused for every vpp and micro-batch size.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../core/expected.hpp"
#include "evaluate.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! Sizes held fixed during a search (unset: searched).
struct search_constraints {
  std::optional<int> tp{}, cp{}, ep{}, etp{}, pp{}, vpp{}, mbs{};
};

struct search_result {
  std::vector<plan_result> ranked;  //!< feasible by step time, then infeasible by memory
  long long legal = 0;              //!< legal mappings evaluated
  long long feasible = 0;           //!< of which fit in memory
};

namespace detail {
inline std::vector<int> divisors_of(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}
inline std::vector<int> choices(const std::optional<int>& fixed, std::vector<int> all) {
  if (fixed) return {*fixed};
  return all;
}
}  // namespace detail

//! Searches and ranks. `progress(done, total)` is called now and then with the number of folds
//! handled (may be empty). `keep` bounds how many results are kept (the best ones).
[[nodiscard]] inline expected<search_result> search(
    const model_config& m, const cluster_config& c, const search_constraints& fixed,
    std::size_t keep, const std::function<void(long long, long long)>& progress = {},
    const efficiency& e = {}) {
  if (auto ok = validate(m); !ok) return unexpected<error>(ok.error());
  if (auto ok = validate(c); !ok) return unexpected<error>(ok.error());
  const int w = c.gpus;
  const auto world_div = detail::divisors_of(w);
  auto filtered = [&](auto pred) {
    std::vector<int> v;
    for (int d : world_div)
      if (pred(d)) v.push_back(d);
    return v;
  };
  const int kv = m.mla() ? m.heads : m.kv_heads;
  const auto tps = detail::choices(
      fixed.tp, filtered([&](int d) { return m.heads % d == 0 && kv % d == 0 && m.seq % d == 0; }));
  const auto cps =
      detail::choices(fixed.cp, filtered([&](int d) { return d == 1 || m.seq % (2 * d) == 0; }));
  const auto pps = detail::choices(fixed.pp, filtered([&](int d) { return d <= m.layers; }));
  const auto eps = detail::choices(fixed.ep, filtered([&](int d) { return m.experts % d == 0; }));
  const auto etps = detail::choices(
      fixed.etp, filtered([&](int d) { return m.experts > 1 ? m.moe_ffn % d == 0 : true; }));
  std::vector<int> mbss;
  if (fixed.mbs) {
    mbss = {*fixed.mbs};
  } else {
    for (int b = 1; b <= m.gbs && b <= 64; b *= 2)
      if (m.gbs % b == 0) mbss.push_back(b);
  }
  const long long total =
      static_cast<long long>(tps.size()) * cps.size() * pps.size() * eps.size() * etps.size();
  search_result out;
  std::vector<plan_result> all;
  auto better = [](const plan_result& a, const plan_result& b) {
    if (a.feasible != b.feasible) return a.feasible;
    if (a.feasible) {
      if (a.step_time_s != b.step_time_s) return a.step_time_s < b.step_time_s;
    } else if (a.memory_gib != b.memory_gib) {
      return a.memory_gib < b.memory_gib;
    }
    // Ties: fewer GPUs per model replica, then the smaller sizes, for a stable order.
    const auto key = [](const mapping& x) {
      return std::make_tuple(x.tp * x.cp * x.pp, x.ep * x.etp, x.tp, x.cp, x.pp, x.vpp, x.ep, x.etp,
                             x.mbs);
    };
    return key(a.map) < key(b.map);
  };
  auto prune = [&](std::vector<plan_result>& v) {
    const std::size_t k = std::min(keep, v.size());
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end(), better);
    v.resize(k);
  };
  long long done = 0;
  std::optional<error> first_error;
  // Placements cached by the sizes that lay each mesh out (the order is fixed).
  std::map<std::tuple<int, int, int>, fold_placement> attn_cache, moe_cache;
  const int gpn = c.gpus_per_node;
  for (int tp : tps)
    for (int cp : cps)
      for (int pp : pps)
        for (int ep : eps)
          for (int etp : etps) {
            if (progress && (++done % 256 == 0 || done == total)) progress(done, total);
            if (m.experts == 1 && (ep != 1 || etp != tp)) continue;
            if (static_cast<long long>(tp) * cp * pp > w ||
                static_cast<long long>(etp) * ep * pp > w)
              continue;
            auto fold =
                make_folded({.world = w, .tp = tp, .cp = cp, .pp = pp, .ep = ep, .etp = etp});
            if (!fold) continue;
            std::optional<fold_placement> placed;
            std::vector<int> vpps;
            if (fixed.vpp) {
              vpps = {*fixed.vpp};
            } else {
              // Interleaving: virtual stages of equal size on the fullest stage.
              vpps = {1};
              const int per_stage = layers_per_stage(m, pp);
              if (pp > 1)
                for (int v = 2; v <= per_stage; ++v)
                  if (per_stage % v == 0) vpps.push_back(v);
            }
            for (int vpp : vpps)
              for (int mbs : mbss) {
                mapping map{
                    .tp = tp, .cp = cp, .ep = ep, .etp = etp, .pp = pp, .vpp = vpp, .mbs = mbs};
                auto ok = check_mapping(m, w, map);
                if (!ok) {
                  if (!first_error) first_error = ok.error();
                  continue;
                }
                if (!placed) {
                  fold_placement pl;
                  const auto ak = std::make_tuple(tp, cp, pp), mk = std::make_tuple(etp, ep, pp);
                  auto a = attn_cache.find(ak);
                  if (a == attn_cache.end())
                    a = attn_cache
                            .emplace(ak,
                                     [&] {
                                       fold_placement x;
                                       place_attention_groups(*ok, gpn, x);
                                       return x;
                                     }())
                            .first;
                  auto mo = moe_cache.find(mk);
                  if (mo == moe_cache.end())
                    mo = moe_cache
                             .emplace(mk,
                                      [&] {
                                        fold_placement x;
                                        place_moe_groups(*ok, gpn, x);
                                        return x;
                                      }())
                             .first;
                  pl.tp = a->second.tp;
                  pl.cp = a->second.cp;
                  pl.dp_cp = a->second.dp_cp;
                  pl.pp = a->second.pp;
                  pl.ep = mo->second.ep;
                  pl.etp = mo->second.etp;
                  pl.edp = mo->second.edp;
                  placed = pl;
                }
                ++out.legal;
                all.push_back(evaluate_placed(m, c, map, *placed, e));
                out.feasible += all.back().feasible ? 1 : 0;
                if (all.size() >= 4 * keep + 4096) prune(all);
              }
          }
  if (out.legal == 0) {
    std::string why = first_error ? " (for example: " + first_error->message + ")" : "";
    return make_error(errc::invalid_size, "no legal folded mapping of model '" + m.name + "' on " +
                                              std::to_string(w) + " GPUs with the sizes given" +
                                              why);
  }
  const std::size_t n = std::min(keep, all.size());
  std::partial_sort(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n), all.end(), better);
  all.resize(n);
  out.ranked = std::move(all);
  return out;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
