//! @file host_topk_router.hpp
//! @brief The tests' fp64 (and fp32) host reference of Megatron-Core's TopKRouter routing step:
//! score function, top-k before or after softmax, renormalisation, scaling, group limits and the
//! expert bias, and its backward from the gradient of the routed probabilities to the logits, as
//! plain loops over std::vector records in the C library's arithmetic. The library's router is
//! topk_router (routing/topk_router.hpp); this is what tests compare it with.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <moefold/core/error.hpp>
#include <moefold/core/expected.hpp>
#include <moefold/routing/topk_router_options.hpp>
#include <moefold/routing/topk_routing.hpp>

#include "host_score_function.hpp"
#include "host_topk.hpp"

namespace moefold {
inline namespace v0_1 {

//! What the router works in during route() and backward(), kept by the caller across calls: the
//! steady state allocates nothing. Contents are dead between calls.
template <class T>
struct topk_router_scratch {
  std::vector<T> s{}, sel{}, ds{}, g{}, sk{};  // [E] or [k] rows
  group_topk_scratch<T> topk{};
};

//! Megatron-Core's top-k routing (`topk_routing_with_score_function`, unfused path) as a value:
//! make() validates the options once; route() and backward() are const and thread-safe.
//! All intermediates are computed in T (Megatron-Core computes scores in fp32 even for an fp64
//! router; moefold's double reference stays in double throughout).
template <class T>
class host_topk_router {
 public:
  using value_type = T;

  [[nodiscard]] static expected<host_topk_router> make(const topk_router_options& o) {
    if (auto s = validate(o); !s) return unexpected<error>(s.error());
    return host_topk_router(o);
  }

  [[nodiscard]] const topk_router_options& options() const noexcept { return o_; }
  [[nodiscard]] int num_experts() const noexcept { return o_.num_experts; }
  [[nodiscard]] int topk() const noexcept { return o_.topk; }

  //! logits [N, E] (N = logits.size() / E) -> routing. `expert_bias` [E] is required when the
  //! options enable it and must be empty otherwise; it changes the selection, never the probs.
  [[nodiscard]] status route(std::span<const T> logits, topk_routing<T>& out,
                             std::span<const float> expert_bias = {}) const {
    topk_router_scratch<T> ws;
    return route(logits, out, expert_bias, ws);
  }
  //! route() with the caller's scratch.
  [[nodiscard]] status route(std::span<const T> logits, topk_routing<T>& out,
                             std::span<const float> expert_bias, topk_router_scratch<T>& ws) const {
    const int E = o_.num_experts, k = o_.topk;
    if (logits.size() % static_cast<std::size_t>(E) != 0)
      return make_error(errc::shape_mismatch,
                        "router: logits size " +
                            detail::to_decimal(static_cast<long long>(logits.size())) +
                            " is not a multiple of num_experts=" + detail::to_decimal(E));
    const int N = static_cast<int>(logits.size() / static_cast<std::size_t>(E));
    if (auto s = detail::check_finite(logits, "router logits"); !s) return s;
    if (o_.expert_bias && expert_bias.size() != static_cast<std::size_t>(E))
      return make_error(errc::shape_mismatch,
                        "router: expert_bias must have num_experts=" + detail::to_decimal(E) +
                            " elements (got " +
                            detail::to_decimal(static_cast<long long>(expert_bias.size())) + ")");
    if (!o_.expert_bias && !expert_bias.empty())
      return make_error(errc::invalid_argument,
                        "router: an expert_bias was given but the options do not enable it");
    if (auto s = detail::check_finite(expert_bias, "router expert_bias"); !s) return s;

    out.num_tokens = N;
    out.num_experts = E;
    out.topk = k;
    out.indices.assign(static_cast<std::size_t>(N) * static_cast<std::size_t>(k), 0);
    out.probs.assign(static_cast<std::size_t>(N) * static_cast<std::size_t>(k), T(0));
    ws.s.resize(static_cast<std::size_t>(E));
    ws.sel.resize(static_cast<std::size_t>(E));
    std::vector<T>& s = ws.s;
    std::vector<T>& sel = ws.sel;
    for (int t = 0; t < N; ++t) {
      const auto row = logits.subspan(static_cast<std::size_t>(t) * static_cast<std::size_t>(E),
                                      static_cast<std::size_t>(E));
      const std::span<int> idx(out.indices.data() + static_cast<std::size_t>(t) * k,
                               static_cast<std::size_t>(k));
      const std::span<T> p(out.probs.data() + static_cast<std::size_t>(t) * k,
                           static_cast<std::size_t>(k));
      if (o_.score == score_function::softmax) {
        if (o_.pre_softmax) {
          detail::softmax(row, std::span<T>(s));
          select(std::span<const T>(s), idx, ws.topk);
          for (int i = 0; i < k; ++i) p[i] = s[static_cast<std::size_t>(idx[i])];
        } else {
          select(row, idx, ws.topk);
          for (int i = 0; i < k; ++i) p[i] = row[static_cast<std::size_t>(idx[i])];
          detail::softmax(std::span<const T>(p), p);
        }
      } else {
        for (int e = 0; e < E; ++e) {
          s[e] = detail::elementwise_score(o_.score, row[e]);
          sel[e] = o_.expert_bias ? s[e] + static_cast<T>(expert_bias[e]) : s[e];
        }
        select(std::span<const T>(sel), idx, ws.topk);
        T sum = 0;
        for (int i = 0; i < k; ++i) {
          p[i] = s[static_cast<std::size_t>(idx[i])];
          sum += p[i];
        }
        if (k > 1)
          for (int i = 0; i < k; ++i) p[i] = p[i] / (sum + norm_eps);
      }
      if (o_.scaling_factor)
        for (int i = 0; i < k; ++i) p[i] *= static_cast<T>(*o_.scaling_factor);
    }
    return {};
  }

  //! Backward of route(): dprobs [N, k] is the gradient of the loss with respect to r.probs
  //! (after any drop mask; see drop_result::mask_gradient); writes dlogits [N, E]. Top-k
  //! indices, group masks and the expert bias carry no gradient.
  [[nodiscard]] status backward(std::span<const T> logits, const topk_routing<T>& r,
                                std::span<const T> dprobs, std::span<T> dlogits) const {
    topk_router_scratch<T> ws;
    return backward(logits, r, dprobs, dlogits, ws);
  }
  //! backward() with the caller's scratch.
  [[nodiscard]] status backward(std::span<const T> logits, const topk_routing<T>& r,
                                std::span<const T> dprobs, std::span<T> dlogits,
                                topk_router_scratch<T>& ws) const {
    const int E = o_.num_experts, k = o_.topk, N = r.num_tokens;
    if (r.num_experts != E || r.topk != k)
      return make_error(
          errc::shape_mismatch,
          "router backward: the routing has num_experts=" + detail::to_decimal(r.num_experts) +
              ", topk=" + detail::to_decimal(r.topk) + "; the router " + detail::to_decimal(E) +
              ", " + detail::to_decimal(k));
    if (auto s = detail::check_logits_shape(logits, N, E); !s) return s;
    if (dlogits.size() != logits.size() ||
        dprobs.size() != static_cast<std::size_t>(N) * static_cast<std::size_t>(k) ||
        r.indices.size() != dprobs.size() || r.probs.size() != dprobs.size())
      return make_error(errc::shape_mismatch,
                        "router backward: need dprobs [N*k], dlogits [N*E] and a routing of N "
                        "tokens (N=" +
                            detail::to_decimal(N) + ")");
    const T scale = o_.scaling_factor ? static_cast<T>(*o_.scaling_factor) : T(1);
    ws.s.resize(static_cast<std::size_t>(E));
    ws.ds.resize(static_cast<std::size_t>(E));
    ws.g.resize(static_cast<std::size_t>(k));
    ws.sk.resize(static_cast<std::size_t>(k));
    std::vector<T>&s = ws.s, &ds = ws.ds, &g = ws.g, &sk = ws.sk;
    for (int t = 0; t < N; ++t) {
      const auto row = logits.subspan(static_cast<std::size_t>(t) * E, static_cast<std::size_t>(E));
      const auto drow =
          dlogits.subspan(static_cast<std::size_t>(t) * E, static_cast<std::size_t>(E));
      std::fill(drow.begin(), drow.end(), T(0));
      const int* idx = r.indices.data() + static_cast<std::size_t>(t) * k;
      for (int i = 0; i < k; ++i) g[i] = dprobs[static_cast<std::size_t>(t) * k + i] * scale;
      if (o_.score == score_function::softmax) {
        if (o_.pre_softmax) {
          detail::softmax(row, std::span<T>(s));
          std::fill(ds.begin(), ds.end(), T(0));
          for (int i = 0; i < k; ++i) ds[static_cast<std::size_t>(idx[i])] += g[i];
          detail::softmax_backward(std::span<const T>(s), std::span<const T>(ds), drow);
        } else {
          for (int i = 0; i < k; ++i) sk[i] = row[static_cast<std::size_t>(idx[i])];
          detail::softmax(std::span<const T>(sk), std::span<T>(sk));
          detail::softmax_backward(std::span<const T>(sk), std::span<const T>(g), std::span<T>(g));
          for (int i = 0; i < k; ++i) drow[static_cast<std::size_t>(idx[i])] = g[i];
        }
      } else {
        T sum = 0;
        for (int i = 0; i < k; ++i) {
          sk[i] = detail::elementwise_score(o_.score, row[static_cast<std::size_t>(idx[i])]);
          sum += sk[i];
        }
        if (k > 1) {
          // p_i = s_i / D, D = sum s + eps: ds_j = g_j / D - <g, s> / D^2.
          const T D = sum + norm_eps;
          T gs = 0;
          for (int i = 0; i < k; ++i) gs += g[i] * sk[i];
          for (int i = 0; i < k; ++i) g[i] = g[i] / D - gs / (D * D);
        }
        for (int i = 0; i < k; ++i) {
          const T x = row[static_cast<std::size_t>(idx[i])];
          drow[static_cast<std::size_t>(idx[i])] =
              g[i] * detail::elementwise_score_grad(o_.score, x, sk[i]);
        }
      }
    }
    return {};
  }

 private:
  explicit host_topk_router(const topk_router_options& o) : o_(o) {}

  // Megatron-Core's renormalisation guard: p / (sum p + 1e-20).
  static constexpr T norm_eps = T(1e-20);

  void select(std::span<const T> x, std::span<int> idx, group_topk_scratch<T>& ws) const {
    if (o_.num_groups > 0)
      group_limited_topk_indices(x, o_.topk, o_.num_groups, o_.group_topk, idx, ws);
    else
      topk_indices(x, o_.topk, idx, ws.order);
  }

  topk_router_options o_;
};

}  // namespace v0_1
}  // namespace moefold
