//! @file memory.hpp
//! @brief Memory per GPU for a mapping: weights, gradients, distributed-optimizer states,
//! activations of the micro-batches in flight, and transient buffers, on the worst pipeline
//! stage. Byte counts follow Megatron-Core with bf16 training and its distributed optimizer:
//! bf16 weights (2 B), fp32 main gradients (4 B), fp32 master weights + Adam moments (12 B)
//! sharded over dp*cp for non-expert parameters and over edp for expert parameters.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>

#include "cluster.hpp"
#include "mapping.hpp"
#include "model.hpp"
#include "shapes.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

inline constexpr double gib = 1024.0 * 1024.0 * 1024.0;

//! Activation recomputation: none; the MoE layers only (Megatron --moe-layer-recompute); every
//! layer (--recompute-granularity full --recompute-method uniform, one layer per checkpoint).
enum class recompute : std::uint8_t { none, moe, full };

[[nodiscard]] inline std::string_view to_string(recompute r) noexcept {
  switch (r) {
    case recompute::none: return "none";
    case recompute::moe: return "moe";
    case recompute::full: return "full";
  }
  return "?";
}

//! Bytes per GPU, worst stage.
struct memory_breakdown {
  double weights = 0, grads = 0, optimizer = 0, activations = 0, transient = 0, reserved = 0;
  [[nodiscard]] double total() const noexcept {
    return weights + grads + optimizer + activations + transient + reserved;
  }
};

//! CUDA context, NCCL communicator buffers and cuBLAS workspaces: a fixed reserve per GPU.
inline constexpr double reserved_bytes = 3.0 * gib;

//! Parameters one rank holds on a stage with `layers` layers of which `moe` are MoE, split into
//! non-expert (sharded by tp) and expert (sharded by ep*etp) parameters.
struct stage_params {
  double dense = 0, expert = 0;
};

[[nodiscard]] inline stage_params params_on_stage(const model_config& m, const mapping& map,
                                                  int layers, int moe, bool first, bool last) {
  stage_params p;
  const double tp = map.tp;
  const int dense_layers = layers - moe;
  p.dense = layers * m.attention_params() / tp + dense_layers * m.dense_ffn_params() / tp +
            moe * m.moe_dense_params() / tp;
  p.expert = moe * m.expert_params() / (static_cast<double>(map.ep) * map.etp);
  if (first) p.dense += static_cast<double>(m.vocab) * m.hidden / tp;
  if (last) {
    p.dense += static_cast<double>(m.vocab) * m.hidden / tp + m.hidden;
    // MTP layers: an MoE layer plus the projection of [h; embedding] (Megatron puts them last).
    p.dense += m.mtp_layers * (m.attention_params() / tp + m.moe_dense_params() / tp +
                               2.0 * m.hidden * m.hidden / tp);
    p.expert += m.mtp_layers * m.expert_params() / (static_cast<double>(map.ep) * map.etp);
  }
  return p;
}

//! Activation bytes one rank keeps for one layer and one micro-batch.
struct layer_activations {
  double attention = 0, dense_ffn = 0, moe = 0;
};

[[nodiscard]] inline layer_activations activations_per_layer(const model_config& m,
                                                             const mapping& map,
                                                             const step_shapes& s) {
  const double ta = s.attn_tokens, tm = s.moe_tokens, tp = map.tp, h = m.hidden;
  const double n = m.heads, d = m.head_size(), g = m.gated ? 2.0 : 1.0;
  layer_activations a;
  // Attention: layer-norm input and output (sequence-parallel shards), q, k, v and the output
  // of flash attention (no S^2 term: flash attention keeps only its log-sum-exp, in fp32).
  double qkv = 0, out = 0, latents = 0;
  if (m.mla()) {
    const double r = m.qk_rope_dim, v = m.v_head_dim;
    qkv = n * (d + r) * 2 + n * v;
    out = n * v;
    latents = m.q_lora_rank + m.kv_lora_rank + r;
  } else {
    qkv = n * d + 2.0 * m.kv_heads * d;
    out = n * d;
  }
  a.attention = 2.0 * (ta / tp) * (2 * h) + 2.0 * ta * (qkv + out) / tp + 2.0 * ta * latents +
                4.0 * ta * n / tp;
  // Dense FFN: norm in/out shards, fc1 output (g * ffn / tp), activation output (ffn / tp).
  a.dense_ffn = 2.0 * (ta / tp) * (2 * h) + 2.0 * ta * (g + 1) * m.ffn / tp;
  if (m.experts > 1) {
    const double rows = s.expert_rows, f = static_cast<double>(m.moe_ffn) / map.etp;
    a.moe = 2.0 * tm * (2 * h)                             // norm input and output
            + 2.0 * 4.0 * tm * m.experts                   // router logits and probabilities, fp32
            + 2.0 * rows * h                               // dispatched tokens (expert input)
            + 2.0 * rows * (g + 1) * f                     // fc1 output and activation output
            + 2.0 * rows * h                               // expert output (un-permute weighs it)
            + (map.etp > 1 ? 2.0 * tm * m.topk * h : 0.0)  // all-to-all output before ETP gather
            + 2.0 * ta * (g + 1) * m.shared_ffn / tp;      // shared expert fc1 and activation
  }
  return a;
}

//! Micro-batches whose activations the first stage holds at the peak: pp for 1F1B (at most the
//! number of micro-batches), times Megatron-Core's interleaving penalty 1 + (pp-1)/(pp*vpp).
[[nodiscard]] inline double in_flight_microbatches(const mapping& map, long long micro) {
  const double base = static_cast<double>(std::min<long long>(micro, map.pp));
  if (map.vpp == 1) return base;
  return base * (1.0 + static_cast<double>(map.pp - 1) / (map.pp * map.vpp));
}

[[nodiscard]] inline memory_breakdown memory_for(const model_config& m, const mapping& map,
                                                 const step_shapes& s, recompute rc) {
  const auto act = activations_per_layer(m, map, s);
  const double layer_input = 2.0 * s.moe_tokens * m.hidden;
  auto stage_acts = [&](int layers, int moe) {
    const double dense = layers - moe;
    switch (rc) {
      case recompute::none: return layers * act.attention + dense * act.dense_ffn + moe * act.moe;
      case recompute::moe:
        return layers * act.attention + dense * act.dense_ffn + moe * layer_input;
      case recompute::full: return layers * layer_input;
    }
    return 0.0;
  };
  // The largest single-layer working set recomputation brings back during backward.
  const double recomputed =
      rc == recompute::none
          ? 0.0
          : (rc == recompute::moe ? act.moe : act.attention + std::max(act.moe, act.dense_ffn));
  const double dp_cp = static_cast<double>(map.dp) * map.cp;
  auto stage = [&](int layers, int moe, bool first, bool last, double in_flight) {
    memory_breakdown b;
    const auto p = params_on_stage(m, map, layers, moe, first, last);
    b.weights = 2.0 * (p.dense + p.expert);
    b.grads = 4.0 * (p.dense + p.expert);
    b.optimizer = 12.0 * (p.dense / dp_cp + p.expert / map.edp);
    b.activations = stage_acts(layers, moe) * in_flight;
    const double a2a = 2.0 * 2.0 * s.expert_rows * m.hidden;  // send and receive buffers
    const double logits = last ? 2.0 * 4.0 * s.attn_tokens * m.vocab / map.tp : 0.0;
    b.transient = std::max({a2a, logits, recomputed});
    b.reserved = reserved_bytes;
    return b;
  };
  const double first_in_flight = in_flight_microbatches(map, s.micro);
  const auto first =
      stage(s.first_stage_layers, s.first_stage_moe, true, map.pp == 1, first_in_flight);
  if (map.pp == 1) return first;
  // The last stage holds one micro-batch in 1F1B; interleaving adds (pp-1)/vpp chunks' worth.
  const double last_in_flight =
      map.vpp == 1 ? 1.0
                   : std::min<double>(static_cast<double>(s.micro),
                                      1.0 + static_cast<double>(map.pp - 1) / map.vpp);
  const auto last = stage(s.last_stage_layers, s.last_stage_moe, false, true, last_in_flight);
  return last.total() > first.total() ? last : first;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
