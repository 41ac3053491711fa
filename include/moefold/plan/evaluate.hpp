//! @file evaluate.hpp
//! @brief One mapping, evaluated: legal or not, fits in memory or not (and why), step time,
//! MFU. Recomputation is chosen, not searched: the least recomputation that fits.
#pragma once

#include <cstdio>
#include <string>

#include "../core/expected.hpp"
#include "cluster.hpp"
#include "efficiency.hpp"
#include "mapping.hpp"
#include "memory.hpp"
#include "model.hpp"
#include "model_flops.hpp"
#include "placement.hpp"
#include "shapes.hpp"
#include "step_time.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

struct plan_result {
  mapping map;
  bool feasible = false;
  std::string reason;  //!< why it does not fit, or which recomputation makes it fit
  double mfu = 0;      //!< model FLOPs / (step time * GPUs * bf16 peak)
  double step_time_s = 0;
  double memory_gib = 0;
  double tflops_per_gpu = 0;  //!< model TFLOP/s per GPU (Megatron-Core's reported number)
  long long microbatches = 0;
  recompute rc = recompute::none;
  time_breakdown time;
  memory_breakdown memory;
  fold_placement placement;
};

namespace detail {
inline std::string gib_text(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", bytes / gib);
  return b;
}
}  // namespace detail

//! Evaluates a mapping whose fold has already been checked and placed (the search reuses the
//! placement of a fold across vpp and micro-batch sizes).
[[nodiscard]] inline plan_result evaluate_placed(const model_config& m, const cluster_config& c,
                                                 const mapping& map, const fold_placement& pl,
                                                 const efficiency& e = {}) {
  plan_result r;
  r.map = map;
  r.placement = pl;
  const auto s = make_shapes(m, map);
  r.microbatches = s.micro;
  const double capacity = c.memory_gib * gib;
  const recompute options[3] = {recompute::none, recompute::moe, recompute::full};
  r.rc = recompute::full;
  r.memory = memory_for(m, map, s, recompute::full);
  r.feasible = false;
  for (recompute rc : options) {
    if (rc == recompute::moe && m.experts <= 1) continue;
    const auto mem = memory_for(m, map, s, rc);
    if (mem.total() <= capacity) {
      r.rc = rc;
      r.memory = mem;
      r.feasible = true;
      break;
    }
  }
  if (r.feasible) {
    r.reason = r.rc == recompute::none
                   ? "fits without recomputation"
                   : "fits with " + std::string(to_string(r.rc)) + " recomputation";
  } else {
    const auto& b = r.memory;
    r.reason = "out of memory: needs " + detail::gib_text(b.total()) +
               " GiB with full "
               "recomputation, the GPU has " +
               detail::gib_text(capacity) + " GiB (weights " + detail::gib_text(b.weights) +
               ", grads " + detail::gib_text(b.grads) + ", optimizer " +
               detail::gib_text(b.optimizer) + ", activations " + detail::gib_text(b.activations) +
               ", buffers " + detail::gib_text(b.transient + b.reserved) + ")";
  }
  r.memory_gib = r.memory.total() / gib;
  const auto t = step_time(m, map, s, c, pl, r.rc, e);
  r.time = t.time;
  r.step_time_s = t.step_s;
  const double flops = megatron_model_flops(m, m.gbs);
  r.tflops_per_gpu = flops / r.step_time_s / c.gpus / 1e12;
  r.mfu = flops / (r.step_time_s * c.gpus * c.peak_bf16_flops);
  return r;
}

//! Checks and evaluates one mapping (dp and edp are derived). Illegal mappings are errors.
[[nodiscard]] inline expected<plan_result> evaluate(const model_config& m, const cluster_config& c,
                                                    mapping map, const efficiency& e = {}) {
  if (auto ok = validate(m); !ok) return unexpected<error>(ok.error());
  if (auto ok = validate(c); !ok) return unexpected<error>(ok.error());
  auto fold = check_mapping(m, c.gpus, map);
  if (!fold) return unexpected<error>(fold.error());
  return evaluate_placed(m, c, map, place_groups(*fold, c.gpus_per_node), e);
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
