//! @file step_time.hpp
//! @brief Time of one training step for a mapping. What runs on the critical path, per
//! micro-batch and pipeline stage:
//!   - GEMMs at a shape-dependent rate, flash attention at a sequence-dependent rate,
//!     memory-bound kernels (norms, activations, permutes) at a fraction of HBM bandwidth;
//!   - TP/SP all-gather and reduce-scatter around each attention block, dense FFN and shared
//!     expert: exposed (not overlapped);
//!   - CP: ring exchange of K and V, overlapped with the attention it feeds (only the excess
//!     is exposed);
//!   - EP all-to-all (dispatch, combine; forward and backward) and ETP all-gather /
//!     reduce-scatter: exposed, priced on the nodes the real EP/ETP groups span;
//!   - PP: send/receive of the activations, exposed with 1F1B, overlapped when interleaved
//!     (except in warm-up and cool-down); the bubble is (pp-1)/vpp stage-micro-batch times.
//! Per step: the DP (dp*cp group) and EDP gradient reduce-scatter overlaps the backward of the
//! last micro-batch and the parameter all-gather the forward of the first (Megatron-Core's
//! --overlap-grad-reduce / --overlap-param-gather); only the excess is exposed. Then the
//! optimizer step, memory-bound.
#pragma once

#include <algorithm>

#include "calibration.hpp"
#include "cluster.hpp"
#include "collectives.hpp"
#include "efficiency.hpp"
#include "mapping.hpp"
#include "memory.hpp"
#include "model.hpp"
#include "placement.hpp"
#include "shapes.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! Seconds per step on the critical path, by cause. They add up to the step time.
struct time_breakdown {
  double gemm = 0, attention = 0, elementwise = 0, tp_comm = 0, cp_comm = 0, ep_a2a = 0,
         etp_comm = 0, recompute = 0, pp_p2p = 0, bubble = 0, dp_comm = 0, optimizer = 0;
  [[nodiscard]] double total() const noexcept {
    return gemm + attention + elementwise + tp_comm + cp_comm + ep_a2a + etp_comm + recompute +
           pp_p2p + bubble + dp_comm + optimizer;
  }
};

//! The time of one pass (forward or backward) of some layers for one micro-batch.
struct pass_cost {
  double gemm = 0, attention = 0, elementwise = 0, tp = 0, cp = 0, ep = 0, etp = 0;
  [[nodiscard]] double sum() const noexcept {
    return gemm + attention + elementwise + tp + cp + ep + etp;
  }
  pass_cost& add(const pass_cost& o, double times = 1.0) noexcept {
    gemm += times * o.gemm;
    attention += times * o.attention;
    elementwise += times * o.elementwise;
    tp += times * o.tp;
    cp += times * o.cp;
    ep += times * o.ep;
    etp += times * o.etp;
    return *this;
  }
};

namespace detail {

//! A measured GEMM table and the bf16 peak of the GPU it was measured on (calibration.hpp).
struct gemm_table {
  const std::vector<gemm_rate>* rates = nullptr;
  double peak = 0;
};

//! Rate-limited GEMM: 2*M*N*K FLOPs at peak * gemm_max * s(M) s(N) s(K) (or, with a measured
//! table, that curve corrected by the nearest measured shape), plus one call cost.
inline double gemm_s(double m, double n, double k, double peak, const efficiency& e,
                     const gemm_table& t = {}) {
  if (m <= 0 || n <= 0 || k <= 0) return 0.0;
  if (t.rates == nullptr) return gemm_builtin_s(m, n, k, peak, e);
  return 2.0 * m * n * k / (peak * gemm_fraction(m, n, k, peak, e, *t.rates, t.peak));
}

//! The bandwidth memory-bound kernels reach: the measured fraction of HBM bandwidth when
//! calibrated, the built-in one otherwise.
inline double memory_bound_bw(const cluster_config& c, const efficiency& e) {
  const calibration* cal = e.measured;
  if (cal != nullptr && cal->copy_bw > 0)
    return c.memory_bw * cal->copy_bw /
           (cal->measured_memory_bw > 0 ? cal->measured_memory_bw : c.memory_bw);
  return c.memory_bw * e.mem;
}

struct layer_passes {
  pass_cost attn_fwd, attn_bwd, dense_fwd, dense_bwd, moe_fwd, moe_bwd, head_fwd, head_bwd;
};

inline layer_passes layer_costs(const model_config& m, const mapping& map, const step_shapes& s,
                                const cluster_config& c, const fold_placement& pl,
                                const efficiency& e) {
  layer_passes r;
  const double ta = s.attn_tokens, tm = s.moe_tokens, tp = map.tp, h = m.hidden;
  const double n = m.heads, d = m.head_size(), g = m.gated ? 2.0 : 1.0;
  const double peak = m.dtype == precision::fp8 && c.peak_fp8_flops > 0
                          ? c.peak_fp8_flops * e.fp8_vs_bf16
                          : c.peak_bf16_flops;
  const double mem_bw = memory_bound_bw(c, e);
  // Measured GEMM tables (calibration.hpp), as fractions of the measured GPU's bf16 peak.
  const calibration* cal = e.measured;
  const double cal_peak =
      cal != nullptr && cal->measured_peak_flops > 0 ? cal->measured_peak_flops : c.peak_bf16_flops;
  const gemm_table dt{cal != nullptr && !cal->gemm.empty() ? &cal->gemm : nullptr, cal_peak};
  const gemm_table et{cal != nullptr && !cal->expert_gemm.empty() ? &cal->expert_gemm : dt.rates,
                      cal_peak};
  // Sequence-parallel all-gather before and reduce-scatter after a TP block: T_a x H, bf16.
  const double tp_block = 2.0 * ring_time(2.0 * ta * h, pl.tp, c, e);

  // --- attention block
  {
    pass_cost f;
    double core_flops = 0, kv_bytes = 0;
    if (m.mla()) {
      const double r = m.qk_rope_dim, v = m.v_head_dim;
      f.gemm += gemm_s(ta, (m.q_lora_rank > 0 ? m.q_lora_rank : 0) + m.kv_lora_rank + r, h, peak, e,
                       dt);  // down projections (replicated over TP)
      if (m.q_lora_rank > 0)
        f.gemm += gemm_s(ta, n * (d + r) / tp, m.q_lora_rank, peak, e, dt);
      else
        f.gemm += gemm_s(ta, n * (d + r) / tp, h, peak, e, dt);
      f.gemm += gemm_s(ta, n * (d + v) / tp, m.kv_lora_rank, peak, e, dt);  // kv up projection
      f.gemm += gemm_s(ta, h, n * v / tp, peak, e, dt);                     // output projection
      core_flops = 2.0 * map.mbs * (static_cast<double>(m.seq) * m.seq / 2) / map.cp * (n / tp) *
                   (d + r + v);
      kv_bytes = 2.0 * ta * n * (d + r + v) / tp;
    } else {
      const double q = n * d, kv = static_cast<double>(m.kv_heads) * d;
      f.gemm += gemm_s(ta, (q + 2 * kv) / tp, h, peak, e, dt);
      f.gemm += gemm_s(ta, h, q / tp, peak, e, dt);
      core_flops = 4.0 * map.mbs * (static_cast<double>(m.seq) * m.seq / 2) / map.cp * (n / tp) * d;
      kv_bytes = 2.0 * ta * 2 * kv / tp;
    }
    // The kernel's rate follows the query length it sees: seq / cp with context parallelism.
    const double q_len = static_cast<double>(m.seq) / map.cp;
    const double attn_rate =
        cal != nullptr && !cal->attention.empty()
            ? c.peak_bf16_flops * interpolate_log(cal->attention, q_len) / cal_peak
            : c.peak_bf16_flops * e.attn_max * (q_len / (q_len + e.attn_half));
    f.attention = core_flops / attn_rate;
    // Norm, residual, rotary embedding, bias-free: about 10 reads/writes of T_a/tp x H and
    // 4 of the q/k/v tensors, bf16.
    f.elementwise = (10.0 * (ta / tp) * h * 2 + 4.0 * ta * n * d / tp * 2) / mem_bw;
    f.tp = tp_block;
    // CP ring: each rank passes its K,V chunk cp-1 times; the transfer hides behind the
    // attention on the chunk already there.
    const double cp_f = ring_time(kv_bytes * map.cp, pl.cp, c, e);  // (cp-1) chunks of K,V
    f.cp = std::max(0.0, cp_f - f.attention);
    r.attn_fwd = f;
    pass_cost b;
    b.gemm = 2.0 * f.gemm;            // dgrad + wgrad
    b.attention = 2.5 * f.attention;  // flash-attention backward: 5 GEMMs against 2
    b.elementwise = 2.0 * f.elementwise;
    b.tp = tp_block;
    b.cp = std::max(0.0, 2.0 * cp_f - b.attention);  // K,V again and their gradients back
    r.attn_bwd = b;
  }
  // --- dense FFN
  if (m.ffn > 0) {
    pass_cost f;
    f.gemm = gemm_s(ta, g * m.ffn / tp, h, peak, e, dt) + gemm_s(ta, h, m.ffn / tp, peak, e, dt);
    f.elementwise = (8.0 * (ta / tp) * h * 2 + ta * (g + 1) * m.ffn / tp * 2) / mem_bw;
    f.tp = tp_block;
    r.dense_fwd = f;
    r.dense_bwd = f;
    r.dense_bwd.gemm *= 2.0;
    r.dense_bwd.elementwise *= 2.0;
  }
  // --- MoE block
  if (m.experts > 1) {
    pass_cost f;
    const double rows = s.expert_rows, le = s.local_experts;
    const double per_expert = rows / le, fe = static_cast<double>(m.moe_ffn) / map.etp;
    f.gemm += gemm_s(tm, m.experts, h, peak, e, dt);  // router
    f.gemm +=
        le * (gemm_s(per_expert, g * fe, h, peak, e, et) + gemm_s(per_expert, h, fe, peak, e, et));
    if (m.shared_ffn > 0) {
      f.gemm += gemm_s(ta, g * m.shared_ffn / tp, h, peak, e, dt) +
                gemm_s(ta, h, m.shared_ffn / tp, peak, e, dt);
      f.tp += tp_block;
    }
    // Norm and residual on T_m x H; permute and un-permute read and write each routed row
    // (twice with the all-to-all staging); the activation reads g*F/etp and writes F/etp per row.
    f.elementwise = (8.0 * tm * h * 2 + 4.0 * tm * m.topk * h * 2 * 2 + rows * (g + 1) * fe * 2 +
                     (m.shared_ffn > 0 ? ta * (g + 1) * m.shared_ffn / tp * 2 : 0.0)) /
                    mem_bw;
    // Dispatch and combine: each routed token copy (T_m * topk rows of H, bf16) crosses the EP
    // group once each way; with ETP the rows are all-gathered and reduce-scattered over ETP.
    const double routed_bytes = 2.0 * tm * m.topk * h;
    f.ep = 2.0 * a2a_time(routed_bytes, pl.ep, c, e);
    f.etp = 2.0 * ring_time(routed_bytes * map.etp, pl.etp, c, e);
    r.moe_fwd = f;
    pass_cost b = f;
    b.gemm *= 2.0;
    b.elementwise *= 2.0;
    r.moe_bwd = b;
  }
  // --- output layer and loss on the last stage (plus MTP layers there)
  {
    pass_cost f;
    f.gemm = gemm_s(ta, static_cast<double>(m.vocab) / tp, h, peak, e, dt);
    f.elementwise = 3.0 * ta * static_cast<double>(m.vocab) / tp * 4 / mem_bw;  // fp32 softmax
    f.tp = tp_block / 2;
    r.head_fwd = f;
    r.head_bwd = f;
    r.head_bwd.gemm *= 2.0;
  }
  return r;
}

}  // namespace detail

//! The timed result of one mapping, with the chosen recomputation.
struct step_time_result {
  time_breakdown time;
  double stage_fwd_s = 0, stage_bwd_s = 0;  //!< one micro-batch, slowest stage
};

[[nodiscard]] inline step_time_result step_time(const model_config& m, const mapping& map,
                                                const step_shapes& s, const cluster_config& c,
                                                const fold_placement& pl, recompute rc,
                                                const efficiency& e) {
  const auto lc = detail::layer_costs(m, map, s, c, pl, e);
  // Slowest stage: the fullest middle stage or the last one (which adds the output layer and
  // the MTP layers).
  auto stage = [&](int layers, int moe, bool last, pass_cost& fwd, pass_cost& bwd,
                   pass_cost& again) {
    const int dense = layers - moe;
    fwd.add(lc.attn_fwd, layers).add(lc.dense_fwd, dense).add(lc.moe_fwd, moe);
    bwd.add(lc.attn_bwd, layers).add(lc.dense_bwd, dense).add(lc.moe_bwd, moe);
    if (last) {
      fwd.add(lc.head_fwd, 1.0 + m.mtp_layers).add(lc.attn_fwd, m.mtp_layers);
      fwd.add(lc.moe_fwd, m.mtp_layers);
      bwd.add(lc.head_bwd, 1.0 + m.mtp_layers).add(lc.attn_bwd, m.mtp_layers);
      bwd.add(lc.moe_bwd, m.mtp_layers);
    }
    const int all_moe = moe + (last ? m.mtp_layers : 0);
    if (rc == recompute::full) again = fwd;
    if (rc == recompute::moe) again.add(lc.moe_fwd, all_moe);
  };
  pass_cost f1, b1, a1, f2, b2, a2;
  stage(s.stage_layers, s.stage_moe_layers, map.pp == 1, f1, b1, a1);
  if (map.pp > 1) stage(s.last_stage_layers, s.last_stage_moe, true, f2, b2, a2);
  const bool last_slower =
      map.pp > 1 && f2.sum() + b2.sum() + a2.sum() > f1.sum() + b1.sum() + a1.sum();
  const pass_cost& fwd = last_slower ? f2 : f1;
  const pass_cost& bwd = last_slower ? b2 : b1;
  const pass_cost& again = last_slower ? a2 : a1;

  step_time_result r;
  const double micro = static_cast<double>(s.micro);
  pass_cost steady;
  steady.add(fwd, micro).add(bwd, micro);
  time_breakdown& t = r.time;
  t.gemm = steady.gemm;
  t.attention = steady.attention;
  t.elementwise = steady.elementwise;
  t.tp_comm = steady.tp;
  t.cp_comm = steady.cp;
  t.ep_a2a = steady.ep;
  t.etp_comm = steady.etp;
  t.recompute = micro * again.sum();
  r.stage_fwd_s = fwd.sum();
  r.stage_bwd_s = bwd.sum() + again.sum();
  const double per_micro = r.stage_fwd_s + r.stage_bwd_s;
  // Pipeline: activations forward and their gradients back, T_m x H bf16 per message.
  const double p2p = p2p_time(2.0 * s.moe_tokens * m.hidden, pl.pp, c, e);
  if (map.pp > 1) {
    t.bubble = static_cast<double>(map.pp - 1) / map.vpp * per_micro;
    t.pp_p2p = map.vpp == 1 ? 2.0 * p2p * (micro + map.pp - 1) : 2.0 * p2p * (map.pp - 1);
  }
  // Data parallel: fp32 gradient reduce-scatter, bf16 parameter all-gather, on the fullest stage.
  const auto p = params_on_stage(m, map, s.stage_layers, s.stage_moe_layers, map.pp == 1, true);
  const double rs =
      ring_time(4.0 * p.dense, pl.dp_cp, c, e) + ring_time(4.0 * p.expert, pl.edp, c, e);
  const double ag =
      ring_time(2.0 * p.dense, pl.dp_cp, c, e) + ring_time(2.0 * p.expert, pl.edp, c, e);
  t.dp_comm = std::max(0.0, rs - r.stage_bwd_s) + std::max(0.0, ag - r.stage_fwd_s);
  // Adam on the local shard: read grad (4) + master and moments (12), write them (12) and the
  // bf16 weights (2): 30 bytes per parameter of the shard.
  const double shard = p.dense / (static_cast<double>(map.dp) * map.cp) + p.expert / map.edp;
  t.optimizer = 30.0 * shard / detail::memory_bound_bw(c, e);
  return r;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
