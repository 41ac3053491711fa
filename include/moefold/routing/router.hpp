//! @file router.hpp
//! @brief The router concept, moefold::routing::router (a topic namespace: the generic name stays
//! out of the flat one): what moefold's drop policies and dispatcher need from a router, so that a
//! user can bring their own routing rule and keep the rest of the pipeline.
#pragma once

#include <concepts>
#include <span>

#include "../core/expected.hpp"
#include "topk_router.hpp"

namespace moefold {
inline namespace v0_1 {

//! A router maps logits [N, E] to a top-k routing (k experts and probabilities per token) and
//! back-propagates the gradient of those probabilities to the logits. topk_router<T> is one;
//! a user type satisfies it by providing the same four members:
//!   value_type                 float or double (the router dtype)
//!   num_experts(), topk()      E and k
//!   route(logits, routing&)    -> status; fills routing with N = logits.size() / E tokens
//!   backward(logits, routing, dprobs [N*k], dlogits [N*E]) -> status
namespace routing {

template <class R>
concept router = std::floating_point<typename R::value_type> &&
    requires(const R& r, std::span<const typename R::value_type> logits,
             topk_routing<typename R::value_type>& out,
             const topk_routing<typename R::value_type>& in,
             std::span<const typename R::value_type> dprobs,
             std::span<typename R::value_type> dlogits) {
  { r.num_experts() } -> std::convertible_to<int>;
  { r.topk() } -> std::convertible_to<int>;
  { r.route(logits, out) } -> std::same_as<status>;
  { r.backward(logits, in, dprobs, dlogits) } -> std::same_as<status>;
};

static_assert(router<topk_router<float>> && router<topk_router<double>>);

}  // namespace routing

namespace detail {
//! A router's forward and backward as the layer calls them: moefold's top-k router with the
//! expert bias and the caller's scratch (no allocation per step); any other router in the
//! concept's form (it takes no bias: the layer refuses the bias option for it).
template <class P>
[[nodiscard]] status route_with(const topk_router<P>& r, std::span<const P> logits,
                                topk_routing<P>& out, std::span<const float> bias,
                                topk_router_scratch<P>& ws) {
  return r.route(logits, out, bias, ws);
}
template <routing::router R>
[[nodiscard]] status route_with(const R& r, std::span<const typename R::value_type> logits,
                                topk_routing<typename R::value_type>& out,
                                std::span<const float> /*bias*/,
                                topk_router_scratch<typename R::value_type>& /*ws*/) {
  return r.route(logits, out);
}
template <class P>
[[nodiscard]] status router_backward_with(const topk_router<P>& r, std::span<const P> logits,
                                          const topk_routing<P>& in, std::span<const P> dprobs,
                                          std::span<P> dlogits, topk_router_scratch<P>& ws) {
  return r.backward(logits, in, dprobs, dlogits, ws);
}
template <routing::router R>
[[nodiscard]] status router_backward_with(const R& r,
                                          std::span<const typename R::value_type> logits,
                                          const topk_routing<typename R::value_type>& in,
                                          std::span<const typename R::value_type> dprobs,
                                          std::span<typename R::value_type> dlogits,
                                          topk_router_scratch<typename R::value_type>& /*ws*/) {
  return r.backward(logits, in, dprobs, dlogits);
}
}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
