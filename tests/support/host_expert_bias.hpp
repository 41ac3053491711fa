//! @file host_expert_bias.hpp
//! @brief The tests' host reference of auxiliary-loss-free load balancing (arXiv 2408.15664): the
//! per-expert bias that steers selection, the token counts it learns from, and its update over TP x
//! DP x CP.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <moefold/comm/communicator.hpp>
#include <moefold/core/error.hpp>
#include <moefold/core/expected.hpp>

namespace moefold {
inline namespace v0_1 {

//! Megatron-Core's `expert_bias` (persistent, fp32) and `local_tokens_per_expert` (transient).
struct expert_bias_state {
  std::vector<float> bias{};                     // [E]
  std::vector<float> local_tokens_per_expert{};  // [E]
  std::vector<float> reduce_scratch{};           // [E] update_expert_bias's work copy, reused

  [[nodiscard]] static expert_bias_state zeros(int num_experts) {
    const auto E = static_cast<std::size_t>(num_experts < 0 ? 0 : num_experts);
    return {.bias = std::vector<float>(E, 0.f),
            .local_tokens_per_expert = std::vector<float>(E, 0.f),
            .reduce_scratch = std::vector<float>(E, 0.f)};
  }
};

//! Adds the routed pairs of one forward pass to the local counts. `final_map` [N, E] is the map
//! after dropping (Megatron-Core counts what was dispatched); padding tokens (mask 1) are skipped.
//! Call it once per forward with gradients enabled, not in evaluation or activation recompute.
[[nodiscard]] inline status count_routed_tokens(expert_bias_state& st,
                                                std::span<const std::uint8_t> final_map,
                                                std::span<const std::uint8_t> padding = {}) {
  const std::size_t E = st.local_tokens_per_expert.size();
  if (E == 0 || final_map.size() % E != 0 ||
      (!padding.empty() && padding.size() != final_map.size() / E))
    return make_error(errc::shape_mismatch,
                      "expert bias: the map must be [N*E] and the padding mask [N] or empty");
  for (std::size_t i = 0; i < final_map.size(); ++i)
    if (final_map[i] && (padding.empty() || !padding[i / E]))
      st.local_tokens_per_expert[i % E] += 1.f;
  return {};
}

//! Once per global batch, after the backward pass (Megatron-Core `get_updated_expert_bias`):
//! c = counts summed over `tp_dp_cp`; bias += rate * sign(mean(c) - c); counts reset to 0.
template <communicator C>
[[nodiscard]] status update_expert_bias(C& tp_dp_cp, expert_bias_state& st, float rate) {
  const std::size_t E = st.bias.size();
  if (E == 0 || st.local_tokens_per_expert.size() != E)
    return make_error(errc::shape_mismatch,
                      "expert bias: bias and counts must both have num_experts > 0 entries");
  std::vector<float>& c = st.reduce_scratch;  // a copy, so a failed reduction keeps the counts
  c.assign(st.local_tokens_per_expert.begin(), st.local_tokens_per_expert.end());
  if (tp_dp_cp.size() > 1)
    if (auto s = tp_dp_cp.all_reduce(std::span<float>(c), reduce_op::sum); !s) return s;
  float sum = 0;
  for (float v : c) sum += v;
  const float avg = sum / static_cast<float>(E);
  for (std::size_t e = 0; e < E; ++e) {
    const float off = avg - c[e];
    const float sign = off > 0 ? 1.f : (off < 0 ? -1.f : 0.f);
    st.bias[e] = st.bias[e] + sign * rate;
    st.local_tokens_per_expert[e] = 0.f;
  }
  return {};
}

}  // namespace v0_1
}  // namespace moefold
