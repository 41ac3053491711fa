//! @file mlp_params.hpp
//! @brief The layout of an MLP's parameters and the caller-owned views of them: the shape of one
//! rank's expert shards, the element counts of each tensor, and the weight and gradient views an
//! expert functor or a shared expert runs on.
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

#include "../core/dtype.hpp"
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

}  // namespace v0_1
}  // namespace moefold
