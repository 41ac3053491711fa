//! @file router.hpp
//! @brief The router concept, moefold::routing::router (a topic namespace: the generic name stays
//! out of the flat one): what a layer needs from a router on an execution context, so that a user
//! can bring their own routing rule and keep the rest of the pipeline (the gating linear, the drop
//! policy, the dispatcher, the losses).
#pragma once

#include <concepts>

#include "../core/expected.hpp"
#include "../exec/exec.hpp"
#include "router_args.hpp"

namespace moefold {
inline namespace v0_1 {

//! A router maps logits [N, E] to a top-k routing (k experts and probabilities per token) and
//! back-propagates the gradient of those probabilities to the logits, on a context Exec over
//! views in its memory. topk_router<T, Exec, R> is one; a user type satisfies it with:
//!   value_type                 float or double (the router element type R)
//!   num_experts(), topk()      E and k
//!   route(exec, router_route_args<R, S>)        -> status: indices [N, k], probs [N, k]
//!   backward(exec, router_backward_args<R, S>)  -> status: dlogits [N, E] from dprobs [N, k]
//! (S = Exec::memory_space). The layer runs the gating linear (router_gating.hpp) before route()
//! and after backward(); the expert bias is topk_router's alone (a user router gets an empty view).
namespace routing {

template <class Rt, class Exec>
concept router = execution_context<Exec> && std::floating_point<typename Rt::value_type> &&
    requires(const Rt& r, Exec& x,
             const router_route_args<typename Rt::value_type, typename Exec::memory_space>& f,
             const router_backward_args<typename Rt::value_type, typename Exec::memory_space>& b) {
  { r.num_experts() } -> std::convertible_to<int>;
  { r.topk() } -> std::convertible_to<int>;
  { r.route(x, f) } -> std::same_as<status>;
  { r.backward(x, b) } -> std::same_as<status>;
};

}  // namespace routing

}  // namespace v0_1
}  // namespace moefold
