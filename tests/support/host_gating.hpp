//! @file host_gating.hpp
//! @brief The tests' host reference of the router's gating linear (logits = x W^T + b in the
//! router dtype) and its backward, as plain loops; the library's is router_gating
//! (routing/router_gating.hpp), through the grouped-GEMM seam.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include <moefold/core/error.hpp>
#include <moefold/core/expected.hpp>

namespace moefold {
inline namespace v0_1 {

//! Shapes of the gating linear: N tokens of hidden size H, E experts.
struct gating_shape {
  int num_tokens = 0;   //!< N
  int hidden = 0;       //!< H
  int num_experts = 0;  //!< E
};

namespace detail {
[[nodiscard]] inline status check_gating(const gating_shape& g, std::size_t x, std::size_t w,
                                         std::size_t b, std::size_t out) {
  if (g.num_tokens < 0 || g.hidden < 1 || g.num_experts < 1)
    return make_error(errc::invalid_size,
                      "gating: need num_tokens >= 0, hidden >= 1, num_experts >= 1 (got " +
                          to_decimal(g.num_tokens) + ", " + to_decimal(g.hidden) + ", " +
                          to_decimal(g.num_experts) + ")");
  const auto N = static_cast<std::size_t>(g.num_tokens), H = static_cast<std::size_t>(g.hidden),
             E = static_cast<std::size_t>(g.num_experts);
  if (x != N * H || w != E * H || (b != 0 && b != E) || out != N * E)
    return make_error(errc::shape_mismatch,
                      "gating: need x [N*H], weight [E*H], bias [E] or empty, logits [N*E] with "
                      "N=" +
                          to_decimal(g.num_tokens) + ", H=" + to_decimal(g.hidden) +
                          ", E=" + to_decimal(g.num_experts));
  return {};
}
}  // namespace detail

//! logits [N, E] = x [N, H] * weight [E, H]^T (+ bias [E]), accumulated in the router dtype T
//! (Megatron-Core `router_gating_linear`: inputs and weight are cast to the router dtype).
template <class T, class In, class W>
[[nodiscard]] status gating_forward(const gating_shape& g, std::span<const In> x,
                                    std::span<const W> weight, std::span<const W> bias,
                                    std::span<T> logits) {
  if (auto s = detail::check_gating(g, x.size(), weight.size(), bias.size(), logits.size()); !s)
    return s;
  const std::size_t H = static_cast<std::size_t>(g.hidden),
                    E = static_cast<std::size_t>(g.num_experts);
  for (std::size_t n = 0; n < static_cast<std::size_t>(g.num_tokens); ++n)
    for (std::size_t e = 0; e < E; ++e) {
      T acc = bias.empty() ? T(0) : static_cast<T>(bias[e]);
      for (std::size_t h = 0; h < H; ++h)
        acc += static_cast<T>(x[n * H + h]) * static_cast<T>(weight[e * H + h]);
      logits[n * E + e] = acc;
    }
  return {};
}

//! Backward of gating_forward: dx [N, H] = dlogits W, dweight [E, H] = dlogits^T x, dbias [E] =
//! column sums (empty: no bias). Outputs are overwritten, computed in T. An empty dweight skips
//! the weight gradient (add_gating_weight_grad accumulates it into a caller's buffer instead).
template <class T, class In, class W>
[[nodiscard]] status gating_backward(const gating_shape& g, std::span<const In> x,
                                     std::span<const W> weight, std::span<const T> dlogits,
                                     std::span<T> dx, std::span<T> dweight, std::span<T> dbias) {
  if (auto s = detail::check_gating(g, x.size(), weight.size(), dbias.size(), dlogits.size()); !s)
    return s;
  if (dx.size() != x.size() || (!dweight.empty() && dweight.size() != weight.size()))
    return make_error(errc::shape_mismatch,
                      "gating backward: dx must match x, and dweight weight (or be empty)");
  const std::size_t N = static_cast<std::size_t>(g.num_tokens),
                    H = static_cast<std::size_t>(g.hidden),
                    E = static_cast<std::size_t>(g.num_experts);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t h = 0; h < H; ++h) {
      T acc = 0;
      for (std::size_t e = 0; e < E; ++e)
        acc += dlogits[n * E + e] * static_cast<T>(weight[e * H + h]);
      dx[n * H + h] = acc;
    }
  for (std::size_t e = 0; e < E; ++e) {
    for (std::size_t h = 0; h < H && !dweight.empty(); ++h) {
      T acc = 0;
      for (std::size_t n = 0; n < N; ++n) acc += dlogits[n * E + e] * static_cast<T>(x[n * H + h]);
      dweight[e * H + h] = acc;
    }
    if (!dbias.empty()) {
      T acc = 0;
      for (std::size_t n = 0; n < N; ++n) acc += dlogits[n * E + e];
      dbias[e] = acc;
    }
  }
  return {};
}

//! dweight [E, H] += dlogits^T x: each element's sum formed in T as gating_backward forms it,
//! then added once into the caller's gradient buffer (beta = 1; G may be wider than T, as an fp32
//! main_grad is under a bf16 weight).
template <class T, class In, class G>
[[nodiscard]] status add_gating_weight_grad(const gating_shape& g, std::span<const In> x,
                                            std::span<const T> dlogits, std::span<G> dweight) {
  const std::size_t N = static_cast<std::size_t>(g.num_tokens),
                    H = static_cast<std::size_t>(g.hidden),
                    E = static_cast<std::size_t>(g.num_experts);
  if (auto s = detail::check_gating(g, x.size(), dweight.size(), 0, dlogits.size()); !s) return s;
  for (std::size_t e = 0; e < E; ++e)
    for (std::size_t h = 0; h < H; ++h) {
      T acc = 0;
      for (std::size_t n = 0; n < N; ++n) acc += dlogits[n * E + e] * static_cast<T>(x[n * H + h]);
      dweight[e * H + h] += static_cast<G>(acc);
    }
  return {};
}

}  // namespace v0_1
}  // namespace moefold
