//! @file step_time.hpp
//! @brief Time of one training step for a mapping. What runs on the critical path, per
//! micro-batch and pipeline stage:
//!   - GEMMs at a shape-dependent rate, flash attention at a sequence-dependent rate,
//!     memory-bound kernels (norms, activations, permutes) at a fraction of HBM bandwidth;
//!   - TP/SP all-gather and reduce-scatter around each attention block, dense FFN and shared
//!     expert: exposed (not overlapped);
//!   - CP: ring exchange of K and V, overlapped with the attention it feeds (only the excess
//!     is exposed);
//!   - EP dispatch and combine (forward and backward), priced by the dispatcher's traffic on the
//!     nodes the real EP group spans (collectives.hpp): exposed, or with EP overlap hidden
//!     behind the other micro-batch's compute outside warm-up and cool-down; ETP all-gather /
//!     reduce-scatter: exposed;
//!   - the GPU's idle time at each MoE layer forward's host synchronisation (the dispatch sizes
//!     the experts' inputs on the host): exposed, or filled by the other micro-batch's work
//!     under the EP overlap;
//!   - the host: without CUDA graphs a stage's micro-batch takes at least its MoE layers times
//!     the host time of one (efficiency::host_moe_layer_s); what the GPU work falls short of
//!     that is exposed (`host`), and the bubble's slots are that long too;
//!   - fp8 models: each GEMM operand cast to fp8 (memory-bound);
//!   - PP: send/receive of the activations, exposed with 1F1B, overlapped when interleaved
//!     (except in warm-up and cool-down); the bubble is (pp-1)/vpp stage-micro-batch times.
//! Per step: the DP (dp*cp group) and EDP gradient reduce-scatter overlaps the last backward of
//! each virtual stage and what follows it, the parameter all-gather the first forwards
//! (Megatron-Core's --overlap-grad-reduce / --overlap-param-gather); only the excess is exposed,
//! plus the SMs the overlapped part takes. Then the optimizer step, memory-bound.
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
         etp_comm = 0, sync_idle = 0, host = 0, recompute = 0, pp_p2p = 0, bubble = 0, dp_comm = 0,
         optimizer = 0;
  [[nodiscard]] double total() const noexcept {
    return gemm + attention + elementwise + tp_comm + cp_comm + ep_a2a + etp_comm + sync_idle +
           host + recompute + pp_p2p + bubble + dp_comm + optimizer;
  }
};

//! The time of one pass (forward or backward) of some layers for one micro-batch.
struct pass_cost {
  //! sync: the GPU idle at the dispatch's host synchronisation (efficiency::dispatch_sync_s).
  double gemm = 0, attention = 0, elementwise = 0, tp = 0, cp = 0, ep = 0, etp = 0, sync = 0;
  [[nodiscard]] double sum() const noexcept {
    return gemm + attention + elementwise + tp + cp + ep + etp + sync;
  }
  pass_cost& add(const pass_cost& o, double times = 1.0) noexcept {
    gemm += times * o.gemm;
    attention += times * o.attention;
    elementwise += times * o.elementwise;
    tp += times * o.tp;
    cp += times * o.cp;
    ep += times * o.ep;
    etp += times * o.etp;
    sync += times * o.sync;
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
  //! One forward dispatch and one bf16 exchange (a combine, or either backward transfer).
  double ep_dispatch = 0, ep_exchange = 0;
};

//! The compute of a pass: what the EP overlap can hide communication behind.
[[nodiscard]] inline double compute_of(const pass_cost& p) noexcept {
  return p.gemm + p.attention + p.elementwise;
}

//! EP time exposed by one pair of MoE layers under Megatron-Core's EP overlap: the layer's
//! forward (micro-batch F) and backward (micro-batch B) run as sub-modules side by side,
//!   B's combine backward beside F's attention,  F's dispatch beside B's expert MLP,
//!   B's dispatch backward beside F's expert MLP,  F's combine beside B's attention,
//! each transfer hidden by its partner's compute only; while both run, the communication
//! kernels hold `sm_share` of the SMs.
[[nodiscard]] inline double overlapped_moe_layer(const layer_passes& lc, double sm_share) {
  const double pairs[4][2] = {{lc.ep_exchange, compute_of(lc.attn_fwd)},
                              {lc.ep_dispatch, compute_of(lc.moe_bwd)},
                              {lc.ep_exchange, compute_of(lc.moe_fwd)},
                              {lc.ep_exchange, compute_of(lc.attn_bwd)}};
  double exposed = 0;
  for (const auto& [comm, work] : pairs)
    exposed += std::max(0.0, comm - work) + sm_share * std::min(comm, work);
  return exposed;
}

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
  // FP8 GEMMs take their inputs (forward) and their output gradients (backward) in fp8: a cast
  // kernel reads each bf16 element and writes its fp8 copies; seconds per element (efficiency.hpp).
  const double cast = m.dtype == precision::fp8 ? e.fp8_cast_bytes / mem_bw : 0.0;
  // Sequence-parallel all-gather before and reduce-scatter after a TP block: T_a x H, bf16.
  const double tp_block = 2.0 * ring_time(2.0 * ta * h, pl.tp, c, e);

  // --- attention block
  {
    pass_cost f;
    double core_flops = 0, kv_bytes = 0;
    double gemm_in = 0, gemm_out = 0;  // elements of the GEMM inputs and outputs (fp8 casts)
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
      const double ql = m.q_lora_rank > 0 ? m.q_lora_rank : 0;
      gemm_in = ta * (h + (ql > 0 ? ql : h) + m.kv_lora_rank + n * v / tp);
      gemm_out = ta * (ql + m.kv_lora_rank + r + n * (d + r) / tp + n * (d + v) / tp + h);
      core_flops = 2.0 * map.mbs * (static_cast<double>(m.seq) * m.seq / 2) / map.cp * (n / tp) *
                   (d + r + v);
      kv_bytes = 2.0 * ta * n * (d + r + v) / tp;
    } else {
      const double q = n * d, kv = static_cast<double>(m.kv_heads) * d;
      f.gemm += gemm_s(ta, (q + 2 * kv) / tp, h, peak, e, dt);
      f.gemm += gemm_s(ta, h, q / tp, peak, e, dt);
      gemm_in = ta * (h + q / tp);
      gemm_out = ta * ((q + 2 * kv) / tp + h);
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
    const double fwd_elementwise = f.elementwise;
    f.elementwise += cast * gemm_in;
    f.tp = tp_block;
    // CP ring: each rank passes its K,V chunk cp-1 times; the transfer hides behind the
    // attention on the chunk already there.
    const double cp_f = ring_time(kv_bytes * map.cp, pl.cp, c, e);  // (cp-1) chunks of K,V
    f.cp = std::max(0.0, cp_f - f.attention);
    r.attn_fwd = f;
    pass_cost b;
    b.gemm = 2.0 * f.gemm;            // dgrad + wgrad
    b.attention = 2.5 * f.attention;  // flash-attention backward: 5 GEMMs against 2
    b.elementwise = 2.0 * fwd_elementwise + cast * gemm_out;
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
    r.dense_fwd.elementwise += cast * ta * (h + m.ffn / tp);
    r.dense_bwd.elementwise += cast * ta * ((g * m.ffn) / tp + h);
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
    // Dispatch and combine of the T_m tokens a rank routes (collectives.hpp: the traffic each
    // dispatcher makes of them); the forward dispatch may travel in fp8 (1 byte per element and
    // a 4-byte scale per 128), everything else in bf16. With ETP the routed rows (T_m * topk of
    // H) are all-gathered and reduce-scattered over ETP.
    const double row = 2.0 * h, dispatch_row = e.stack.fp8_dispatch ? h * (1.0 + 4.0 / 128) : row;
    const double routed_bytes = 2.0 * tm * m.topk * h;
    r.ep_dispatch = ep_exchange_time(tm, dispatch_row, m, pl.ep, c, e);
    r.ep_exchange = ep_exchange_time(tm, row, m, pl.ep, c, e);
    f.ep = r.ep_dispatch + r.ep_exchange;
    f.etp = 2.0 * ring_time(routed_bytes * map.etp, pl.etp, c, e);
    pass_cost b = f;
    // The forward waits on the host once, for the received counts; the backward reuses them.
    f.sync = e.dispatch_sync_s;
    b.sync = 0;
    b.gemm *= 2.0;
    b.elementwise *= 2.0;
    // fp8 casts: expert GEMM inputs (rows x H, rows x F/etp) and output gradients (rows x g*F/etp,
    // rows x H); the shared expert's likewise. The router stays in higher precision.
    const double sh = m.shared_ffn > 0 ? ta * (h + m.shared_ffn / tp) : 0.0;
    const double sh_out = m.shared_ffn > 0 ? ta * (g * m.shared_ffn / tp + h) : 0.0;
    f.elementwise += cast * (rows * (h + fe) + sh);
    b.elementwise += cast * (rows * (g * fe + h) + sh_out);
    r.moe_fwd = f;
    b.ep = 2.0 * r.ep_exchange;  // gradients travel in bf16
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

namespace detail {

//! Exposed time of the gradient reduce-scatter `rs` (one stage's gradients) under
//! --overlap-grad-reduce: each virtual stage's gradients are reduced once its last backward has
//! run, behind the backward units still to come. In Megatron-Core's interleaved schedule the last
//! pp micro-batches go backward one virtual stage at a time, so virtual stage j (in the order
//! they finish) starts its last backward j*pp units (of stage_bwd / vpp) into that cool-down, and
//! the backward ends at ((vpp-1)*pp + 1) units. The reductions run one after another; what is
//! left after the backward ends is exposed. With vpp = 1: max(0, rs - stage_bwd).
[[nodiscard]] inline double exposed_grad_reduce(double rs, double stage_bwd, int pp, int vpp) {
  if (rs <= 0) return 0.0;
  const double unit = stage_bwd / vpp, end = ((vpp - 1.0) * pp + 1.0) * unit;
  double t = 0;
  for (int j = 0; j < vpp; ++j) t = std::max(t, j * static_cast<double>(pp) * unit) + rs / vpp;
  return std::max(0.0, t - end);
}

//! Exposed time of the parameter all-gather `ag` under --overlap-param-gather: virtual stage j's
//! parameters are gathered, one virtual stage after another from the start, and are needed by
//! the end of its first forward unit, (j*pp + 1) units (of stage_fwd / vpp) in. With vpp = 1:
//! max(0, ag - stage_fwd).
[[nodiscard]] inline double exposed_param_gather(double ag, double stage_fwd, int pp, int vpp) {
  if (ag <= 0) return 0.0;
  const double unit = stage_fwd / vpp;
  double late = 0;
  for (int j = 0; j < vpp; ++j)
    late = std::max(late, (j + 1.0) * ag / vpp - (j * static_cast<double>(pp) + 1.0) * unit);
  return late;
}

}  // namespace detail

//! The timed result of one mapping, with the chosen recomputation.
struct step_time_result {
  time_breakdown time;
  double stage_fwd_s = 0, stage_bwd_s = 0;  //!< one micro-batch, slowest stage, GPU time
  double step_s = 0;                        //!< the step: `time` adds up to it
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

  // MoE layers of the slowest stage (the last one holds the MTP layers too).
  const int stage_moe = last_slower   ? s.last_stage_moe + m.mtp_layers
                        : map.pp == 1 ? s.stage_moe_layers + m.mtp_layers
                                      : s.stage_moe_layers;
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
  t.sync_idle = steady.sync;
  t.recompute = micro * again.sum();
  // EP overlap (Megatron-Core's --overlap-moe-expert-parallel-comm): outside warm-up and
  // cool-down the forward of one micro-batch runs beside the backward of another, each MoE
  // layer's transfers beside the other micro-batch's sub-modules (detail::overlapped_moe_layer);
  // the recomputed forward's transfers stay exposed. Warm-up forwards (and as many cool-down
  // backwards) run alone: on the first rank Megatron-Core's interleaved schedule warms up with
  // 2*(pp-1) + (vpp-1)*pp (virtual stage, micro-batch) units of micro*vpp.
  const bool overlapped =
      e.stack.ep_overlap && map.ep > 1 && (map.pp == 1 || map.vpp > 1) && rc != recompute::full;
  if (overlapped) {
    const double units = micro * map.vpp;
    const double warm =
        map.pp == 1 ? 1.0 : std::min(units, 2.0 * (map.pp - 1) + (map.vpp - 1.0) * map.pp);
    const double paired = (units - warm) / units;
    const double comm = fwd.ep + bwd.ep + again.ep;
    const double exposed =
        stage_moe * detail::overlapped_moe_layer(lc, comm_sm_fraction(e)) + again.ep;
    // The recomputed forward's EP traffic was counted under recompute; it is part of `comm`.
    t.ep_a2a = micro * ((1.0 - paired) * comm + paired * exposed);
    t.recompute -= micro * again.ep;
    // While one micro-batch's forward waits on the host, the GPU runs the other's backward,
    // already issued: only the unpaired forwards leave the GPU idle.
    t.sync_idle = micro * (1.0 - paired) * fwd.sync;
  }
  r.stage_fwd_s = fwd.sum();
  r.stage_bwd_s = bwd.sum() + again.sum();
  // Host floor: eager Megatron-Core issues each MoE layer's kernels from one host thread, which
  // the GPU cannot outrun. The host issues a third of a layer's work in the forward and two
  // thirds in the backward (assumed as the GPU's: each GEMM has a data and a weight gradient);
  // each MoE layer's forward waits for the GPU at the dispatch, so a micro-batch's forward and
  // backward each last the longer of the GPU's time and the host's. CUDA graphs lift the floor.
  const double host_per_micro =
      e.stack.cuda_graphs || m.experts <= 1 ? 0.0 : stage_moe * e.host_moe_layer_s;
  const double host_fwd = host_per_micro / 3.0, host_bwd = 2.0 * host_per_micro / 3.0;
  const double fwd_window = std::max(r.stage_fwd_s, host_fwd);
  const double bwd_window = std::max(r.stage_bwd_s, host_bwd);
  // A pipeline slot (warm-up and cool-down run alone, whatever the overlap).
  const double per_micro = fwd_window + bwd_window;
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
  // The traffic hides behind a forward window (`f_win`) and a backward window (`b_win`) of the
  // stage; what runs beside compute still takes NCCL's SMs from it while it runs.
  const auto dp_exposed = [&](double f_win, double b_win) {
    const double rs_exposed = detail::exposed_grad_reduce(rs, b_win, map.pp, map.vpp);
    const double ag_exposed = detail::exposed_param_gather(ag, f_win, map.pp, map.vpp);
    return rs_exposed + ag_exposed +
           e.nccl_sms / e.sm_count * ((rs - rs_exposed) + (ag - ag_exposed));
  };
  const double gpu_steady = t.gemm + t.attention + t.elementwise + t.tp_comm + t.cp_comm +
                            t.ep_a2a + t.etp_comm + t.sync_idle + t.recompute;
  // GPU-bound: the steady state is the GPU's work, the traffic hides behind its windows.
  t.dp_comm = dp_exposed(r.stage_fwd_s, r.stage_bwd_s);
  const double gpu_bound = gpu_steady + t.dp_comm;
  double bound = gpu_bound;  // the steady state and the exposed DP traffic
  if (host_per_micro > 0) {
    // Host-bound. Under the EP overlap one micro-batch's forward runs beside another's
    // backward: the host issues both, one after the other, in its own time (the windows are
    // then the host's alone, whatever the GPU's).
    const double dp_host =
        overlapped ? dp_exposed(host_fwd, host_bwd) : dp_exposed(fwd_window, bwd_window);
    const double host_bound = (overlapped ? micro * host_per_micro : micro * per_micro) + dp_host;
    if (host_bound > gpu_bound) {
      // The components still add up to the bound: the traffic exposed behind the host's
      // windows (less, where the GPU's own work is the longer part), and what the GPU waits for.
      bound = host_bound;
      t.dp_comm = std::min(dp_host, bound - gpu_steady);
      t.host = bound - gpu_steady - t.dp_comm;
    }
  }
  // Adam on the local shard: read grad (4) + master and moments (12), write them (12) and the
  // bf16 weights (2): 30 bytes per parameter of the shard.
  const double shard = p.dense / (static_cast<double>(map.dp) * map.cp) + p.expert / map.edp;
  t.optimizer = 30.0 * shard / detail::memory_bound_bw(c, e);
  // Summed from the bounds, not from the components, so that a cheaper component never makes
  // a host-bound step longer by a rounding.
  r.step_s = bound + t.bubble + t.pp_p2p + t.optimizer;
  return r;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
