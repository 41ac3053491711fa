//! @file moe_layer_params.hpp
//! @brief The parameters of an MoE layer that the caller owns (a distributed optimizer, FSDP, a
//! checkpoint loader): views of the router weight, the shared expert's weights and their gradient
//! buffers. The routed experts' parameters live in the expert functor (mlp_experts is the one over
//! caller-owned views), so they are not repeated here.
//!
//! Weights are read, never written, by the layer (the spans are mutable because the owning form's
//! accessors hand out the same views to initialise them). Gradients are accumulated (beta = 1) in
//! G, fp32 for bf16 weights as Megatron-Core's main_grad: a trainer zeroes them when it wants to.
//! Nothing is copied: the layer keeps the views, so every step reads what the optimizer last wrote.
#pragma once

#include <span>

#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../experts/mlp_params.hpp"
#include "../experts/shared_expert.hpp"

namespace moefold {
inline namespace v0_1 {

//! The element counts a layer's caller-owned buffers must have (moe_layer::param_sizes).
struct moe_layer_param_sizes {
  std::size_t router = 0;       //!< E * H
  mlp_param_sizes shared{};     //!< the shared expert's TP shard (zeros without one)
  std::size_t shared_gate = 0;  //!< H with a gated shared expert, else 0
};

//! Views of a layer's caller-owned parameters and gradients. `shared` stays empty without a
//! shared expert.
template <class T, class G = main_grad_t<T>>
struct moe_layer_params {
  std::span<T> router_weight{};         //!< [E, H], logits = x W^T (Megatron's router.weight)
  std::span<G> router_grad{};           //!< [E, H]
  shared_expert_params<T, G> shared{};  //!< see shared_expert_params
};

//! The same parameters as views in a context's memory space S (bind_parameters on any context):
//! the router weight [E, H] and its gradient, contiguous; the shared expert's (empty without one).
template <class T, memory_space S, class G = main_grad_t<T>>
struct moe_layer_param_views {
  row_view<T, S> router_weight{};         //!< [E, H]
  row_view<G, S> router_grad{};           //!< [E, H]
  shared_expert_views<T, S, G> shared{};  //!< see shared_expert_views
};

}  // namespace v0_1
}  // namespace moefold
