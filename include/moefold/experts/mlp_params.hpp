//! @file mlp_params.hpp
//! @brief The layout of an MLP's parameters and the caller-owned views of them: the shape of one
//! rank's expert shards, the element counts of each tensor, and the weight and gradient views
//! mlp_experts and the shared expert run on (host spans, or row views in a context's memory).
//!
//! Layout (row-major, Megatron-Core's TEGroupedMLP per local expert, torch.nn.Linear's
//! [out_features, in_features]), for L local experts, hidden size H, expert FFN size F, ETP shards:
//!   fc1 of local expert l: [F1, H], F1 = (gated ? 2 : 1) * F / ETP; under GLU the rows are this
//!       shard's gate rows, then its up rows (gate rows [r*F/ETP, (r+1)*F/ETP) of the full
//!       [gate; up] matrix, then the same up rows);
//!   fc2 of local expert l: [H, F / ETP], this shard's columns of the full [H, F].
//! The L experts follow each other: fc1 is [L, F1, H], fc2 is [L, H, F / ETP]. A Hugging Face
//! checkpoint's gate_proj [F, H], up_proj [F, H] and down_proj [H, F] slice into it directly, as
//! does Megatron-Core's linear_fc1.weight{l} / linear_fc2.weight{l}.
//!
//! Gradients have the weights' layouts, in their own element type G (fp32 for bf16 weights, as
//! Megatron-Core's main_grad), and are accumulated: backward adds (beta = 1) and never zeroes, so
//! micro-batches sum into the caller's buffer until the caller zeroes it.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "activation.hpp"

namespace moefold {
inline namespace v0_1 {

//! The shape of one rank's expert shards.
struct mlp_shape {
  int hidden = 0;             //!< H
  int ffn = 0;                //!< F, the full (unsharded) expert FFN size
  int num_local_experts = 1;  //!< L
  int etp = 1;                //!< ETP
  int etp_rank = 0;           //!< this shard's index in [0, ETP)
  activation act = activation::swiglu;
};

//! Element counts of one rank's shards (all local experts), for sizing a caller's buffers.
struct mlp_param_sizes {
  std::size_t fc1 = 0;  //!< L * F1 * H
  std::size_t fc2 = 0;  //!< L * H * F / ETP
  [[nodiscard]] std::size_t total() const noexcept { return fc1 + fc2; }
};

//! The element counts of shape `s` (the shape must be valid: ETP divides F).
[[nodiscard]] inline mlp_param_sizes mlp_sizes(const mlp_shape& s) noexcept {
  const std::size_t fs = detail::uz(s.etp > 0 ? s.ffn / s.etp : 0);
  const std::size_t f1 = (is_gated(s.act) ? 2 : 1) * fs;
  const std::size_t l = detail::uz(s.num_local_experts), h = detail::uz(s.hidden);
  return {.fc1 = l * f1 * h, .fc2 = l * h * fs};
}

//! The shape rules every MLP of moefold checks, in one place, `who` naming the MLP in the
//! message: sizes >= 1 (L >= 0), ETP divides F, etp_rank in [0, ETP).
[[nodiscard]] inline status check_mlp_shape(const mlp_shape& s, const char* who) {
  using detail::to_decimal;
  if (s.hidden < 1 || s.ffn < 1 || s.num_local_experts < 0 || s.etp < 1)
    return make_error(errc::invalid_size, std::string(who) +
                                              ": hidden, ffn and etp must be >= 1 and "
                                              "num_local_experts >= 0");
  if (s.ffn % s.etp != 0)
    return make_error(errc::invalid_argument,
                      std::string(who) + ": ffn = " + to_decimal(s.ffn) +
                          " is not divisible by etp = " + to_decimal(s.etp) +
                          " (each ETP rank holds ffn / etp rows of fc1 and columns of fc2)");
  if (s.etp_rank < 0 || s.etp_rank >= s.etp)
    return make_error(errc::rank_out_of_range, std::string(who) + ": etp_rank outside [0, etp)");
  return {};
}

//! Views of a caller's weights: fc1 [L, F1, H], fc2 [L, H, F / ETP] (read, never written).
template <class T>
struct mlp_weights {
  std::span<const T> fc1{};
  std::span<const T> fc2{};
};

//! Views of a caller's gradient buffers, the weights' layouts, accumulated into (beta = 1).
template <class G>
struct mlp_grads {
  std::span<G> fc1{};
  std::span<G> fc2{};
};

//! The weights as row views in memory space S (a context's: what mlp_experts runs on), the L
//! experts stacked: fc1 [L F1, H], fc2 [L H, F / ETP], contiguous (read, never written).
template <class T, memory_space S = host_space>
struct mlp_weight_views {
  row_view<const T, S> fc1{};
  row_view<const T, S> fc2{};
};
//! Their gradient buffers in S, the same shapes, accumulated into (beta = 1).
template <class G, memory_space S = host_space>
struct mlp_grad_views {
  row_view<G, S> fc1{};
  row_view<G, S> fc2{};
};

}  // namespace v0_1
}  // namespace moefold
