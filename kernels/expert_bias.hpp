//! @file expert_bias.hpp
//! @brief Auxiliary-loss-free load balancing (routing/expert_bias.hpp) as device values: the
//! routed-token counts of a forward added to the running local counts, and the bias update once
//! per global batch from the counts summed over TP x DP x CP (the caller's all-reduce between the
//! two). Counts are whole numbers in fp32 (exact below 2^24 per expert and batch), so the sums
//! are the host's bits; the update runs the host's arithmetic in expert order on one thread.
//!
//! The forward's counts are the rows each expert received (add_dispatched_counts on the host:
//! routed - dropped + padded, as the keep kernels of capacity.hpp count them; without pad mode
//! also expert_histogram_kernel over the record with dropped and padding pairs -1).
#pragma once

#include <moefold/core/config.hpp>

#include "simt/math.hpp"

namespace moefold::kernels {

//! local[e] += counts[e] - dropped[e] + padded[e] (Megatron-Core's local_tokens_per_expert: the
//! rows each expert received; dropped and padded null when the counts are already those rows).
struct expert_counts_accumulate_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "expert_counts_accumulate";

  const int* counts;  //!< [E], one forward's routed pairs (or dispatched rows) per expert
  int num_experts;
  float* local;          //!< [E]
  const int* dropped{};  //!< [E] or null: routed pairs beyond capacity
  const int* padded{};   //!< [E] or null: pad-mode filler rows

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (int e = c.block() * block_threads + c.thread(); e < num_experts;
         e += c.grid_blocks() * block_threads) {
      int rows = counts[e];
      if (dropped != nullptr) rows -= dropped[e];
      if (padded != nullptr) rows += padded[e];
      local[e] = simt::add(local[e], static_cast<float>(rows));
    }
  }
};

//! bias += rate * sign(mean(c) - c), c the counts summed over the group; the local counts reset
//! to 0 (Megatron-Core `get_updated_expert_bias`).
struct expert_bias_update_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "expert_bias_update";

  const float* summed;  //!< [E] the local counts summed over TP x DP x CP
  int num_experts;
  float rate;
  float* bias;   //!< [E]
  float* local;  //!< [E] reset to 0

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() != 0 || c.thread() != 0) return;
    float sum = 0.0f;
    for (int e = 0; e < num_experts; ++e) sum = simt::add(sum, summed[e]);
    const float avg = simt::div(sum, static_cast<float>(num_experts));
    for (int e = 0; e < num_experts; ++e) {
      const float off = simt::add(avg, -summed[e]);
      const float sign = off > 0.0f ? 1.0f : (off < 0.0f ? -1.0f : 0.0f);
      bias[e] = simt::add(bias[e], simt::mul(sign, rate));
      local[e] = 0.0f;
    }
  }
};

}  // namespace moefold::kernels
