//! @file model_flops.hpp
//! @brief Model FLOPs of one training step, exactly as Megatron-Core's trainer counts them for
//! its reported TFLOP/s and MFU (megatron/training/training.py, num_floating_point_operations,
//! the standard-transformer branch): 3 (fwd + 2 bwd) x 2 (FMA) x GEMM sizes, causal attention
//! counted at half, no recomputation, logits included. The planner's MFU divides this by the
//! step time, the GPU count and the bf16 peak.
#pragma once

#include "model.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! FLOPs Megatron-Core counts for `sequences` sequences of the model's length.
[[nodiscard]] inline double megatron_model_flops(const model_config& m, double sequences) {
  const double h = m.hidden, s = m.seq, n = m.heads;
  const double fb = 3.0, fma = 2.0, ffn_x = m.gated ? 3.0 : 2.0;
  // MoE and dense layer counts; MTP layers count as the last layer's kind.
  int moe = m.moe_layers();
  int dense = m.layers - moe;
  const bool last_is_moe = m.is_moe_layer(m.layers - 1);
  moe += last_is_moe ? m.mtp_layers : 0;
  dense += last_is_moe ? 0 : m.mtp_layers;
  const double num_layers = m.layers + m.mtp_layers;
  const double routed = m.experts > 1 ? m.topk : 0.0;
  const double moe_ffn = m.moe_ffn > 0 ? m.moe_ffn : m.ffn;
  double attn = 0;
  if (m.mla()) {
    const double dq = m.head_size(), r = m.qk_rope_dim, v = m.v_head_dim;
    const double q_term =
        m.q_lora_rank == 0 ? h * n * (dq + r) : m.q_lora_rank * (h + n * (dq + r) + 1);
    attn = fb * fma *
           (q_term + m.kv_lora_rank * (h + n * (dq + v) + 1) + h * r + n * v * h +
            s * (n * (dq + r)) / 2 + s * n * v / 2);
  } else {
    const double q = static_cast<double>(m.head_size()) * n;
    const double kv = static_cast<double>(m.head_size()) * m.kv_heads;
    attn = fb * fma * (h * (q + 2 * kv) + q * s / 2 * 2 + q * h);
  }
  const double per_token =
      fb * fma * h *
          (m.ffn * ffn_x * dense + moe_ffn * routed * ffn_x * moe + m.shared_ffn * ffn_x * moe) +
      attn * num_layers + fb * fma * m.mtp_layers * (3 * h + 2 * h * h) +
      fb * fma * h * m.vocab * (m.mtp_layers + 1);
  return sequences * s * per_token;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
