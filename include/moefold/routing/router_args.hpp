//! @file router_args.hpp
//! @brief The views a router's two steps take on an execution context (the routing::router
//! concept's arguments): the routing of logits, and its backward to the logits' gradient. Space S
//! is the context's memory space; R the router element type (fp32, or fp64 on CPU contexts).
#pragma once

#include <type_traits>

#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"

namespace moefold {
inline namespace v0_1 {

//! The router element type R on context Exec: fp32 everywhere, fp64 on the CPU contexts only.
//! Instantiated by every router object (the router, its losses, the expert bias), so the refusal
//! reads the same wherever it is met.
template <class R, class Exec>
struct router_dtype_check {
  static_assert(std::is_same_v<R, float> || std::is_same_v<R, double>,
                "the router element type R is fp32 or fp64");
  static_assert(!(std::is_same_v<R, double> &&
                  std::is_same_v<typename Exec::memory_space, device_space>),
                "an fp64 router (R = double) runs on the CPU contexts only (host_exec, cpu_exec): "
                "a GPU runs fp64 at a small fraction of its fp32 rate and Megatron-Core's router "
                "dtype is at most fp32 there; use R = float");
  static constexpr bool ok = true;
};

//! logits [N, E] -> indices [N, k] (each token's experts, in selection order) and probs [N, k].
template <class R, class S>
struct router_route_args {
  row_view<const R, S> logits{};           //!< [N, E]
  row_view<const float, S> expert_bias{};  //!< [1, E] when the router takes one, else empty
  row_view<int, S> indices{};              //!< [N, k] written
  row_view<R, S> probs{};                  //!< [N, k] written
};

//! dprobs [N, k] (0 for a dropped pair) -> dlogits [N, E] (every element written).
template <class R, class S>
struct router_backward_args {
  row_view<const R, S> logits{};     //!< [N, E] the forward's
  row_view<const int, S> indices{};  //!< [N, k] the forward's
  row_view<const R, S> dprobs{};     //!< [N, k]
  row_view<R, S> dlogits{};          //!< [N, E] written
};

}  // namespace v0_1
}  // namespace moefold
