//! @file upcycle_scale.hpp
//! @brief The weight scale s of upcycling (docs/upcycling.md): every expert's fc1 and fc2 are the
//! dense slices times s, so that the probability-weighted sum of the experts reproduces the dense
//! FFN where the activation allows it.
//!
//! With granularity G and E experts (expansion R = E / G), a token's output is
//! sum_j p_j * expert_j(x). After top-k softmax (probabilities summing to 1 over the k chosen):
//! G = 1 needs no scale; with k = G choosing one whole virtual group, each slice gets p = 1/G and
//! the output is (1/G) * s^d * dense(x) for an activation homogeneous of degree d in the weights
//! (d = 2 for ReLU and other one-layer activations, 3 for GLU units and squared ReLU, where gate,
//! up and fc2 all scale), so s^d = G. Softmax before top-k spreads probability over all E experts:
//! for a near-uniform router each of the k chosen gets about 1/E and they cover each of the G
//! slices about k / G times, so the output is (k / (G E)) s^d dense(x) and s^d = E G / k =
//! R G^2 / k. Hence A = G (after top-k) or R G^2 / k (before), and
//! s = A^(1/3) for gated units and squared ReLU, A^(1/2) otherwise. Exact only for positively
//! homogeneous activations (ReLU family) and, before top-k, only on average.
#pragma once

#include <cmath>

#include "../core/expected.hpp"
#include "upcycle_options.hpp"

namespace moefold {
inline namespace v0_1 {

//! The exponent's denominator d: 3 when gate, up and fc2 all scale (gated units) or the
//! activation is squared ReLU, 2 otherwise.
[[nodiscard]] constexpr int upcycle_scale_degree(activation a) noexcept {
  return is_gated(a) || a == activation::squared_relu ? 3 : 2;
}

//! The scale s for options `o` (checked against the dense shape first), in fp64.
[[nodiscard]] inline expected<double> upcycle_weight_scale(const dense_ffn_shape& d,
                                                           const upcycle_options& o) {
  if (auto st = detail::check_upcycle(d, o); !st) return unexpected<error>(st.error());
  const double G = o.granularity, R = static_cast<double>(o.num_experts) / o.granularity;
  const double A = o.pre_softmax ? R * G * G / o.topk : G;
  return std::pow(A, 1.0 / upcycle_scale_degree(o.act));
}

}  // namespace v0_1
}  // namespace moefold
