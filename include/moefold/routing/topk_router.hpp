//! @file topk_router.hpp
//! @brief Megatron-Core's TopKRouter on an execution context, one implementation for host_exec,
//! cpu_exec and cuda_exec: the gating GEMM logits = x W^T through the grouped-GEMM seam
//! (exec/grouped_gemm.hpp, the backend the Gemms policy names for the router), the fused score
//! function + top-k + normalisation (kernels/router.hpp: a warp per token up to E = 256,
//! kernels/router_block.hpp: a block per token up to E = 1,024; a thread per token on host_exec),
//! and the backward in two steps, so that a layer can add the load-balancing losses' gradients in
//! between: backward (dprobs -> dlogits, the routing::router concept's) and backward_gating
//! (dx = dlogits W, dW += dlogits^T x).
//!
//! Types: T is the tokens' and the weight's element type (bf16, float, double); R the router's
//! (Megatron-Core's moe_router_dtype): logits, scores, probabilities and their gradients, fp32 by
//! default for fp32 and bf16 tokens (accumulator_t<T>), fp64 for fp64. fp64 runs on the CPU
//! contexts (the finite-difference checks exercise these kernels); a GPU context refuses it at
//! compile time.
//!
//! The context is passed to every call and never kept; so are the weight and the workspace
//! (workspace_bytes(), in the context's memory: the GEMM's row ranges). Host <-> device traffic
//! per call: the GEMM's row range (two integers) to the context, nothing back.
//!
//! Shapes: x [N, H] (any row stride); weight [E, H] and its gradient [E, H], contiguous; logits,
//! dlogits [N, E], indices, probs, dprobs [N, k], contiguous; expert_bias [1, E] or empty;
//! dx [N, H] (any row stride).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_block.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../exec/exec.hpp"
#include "../exec/gemm_policy.hpp"
#include "router_args.hpp"
#include "router_gating.hpp"
#include "topk_router_options.hpp"

namespace moefold {
inline namespace v0_1 {

//! One forward: the tokens and the weight in, the logits and the routing out (space S).
template <class T, class R, class S>
struct topk_router_forward {
  row_view<const T, S> x{};                //!< [N, H]
  row_view<const T, S> weight{};           //!< [E, H]
  row_view<const float, S> expert_bias{};  //!< [1, E] with options.expert_bias, else empty
  row_view<R, S> logits{};                 //!< [N, E]
  row_view<int, S> indices{};              //!< [N, k]
  row_view<R, S> probs{};                  //!< [N, k]
};

template <class T, class Exec, class R = accumulator_t<T>, class Gemms = default_gemms<Exec>>
class topk_router {
  static_assert(router_dtype_check<R, Exec>::ok);
  static_assert(execution_context<Exec>,
                "topk_router: Exec must be an execution context (host_exec, cpu_exec, cuda_exec)");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bfloat16> ||
                    std::is_same_v<T, double>,
                "topk_router: tokens and weight are bf16, fp32 or fp64");

 public:
  using space = typename Exec::memory_space;
  using token_type = T;
  //! The router element type R (logits, scores, probabilities and their gradients).
  using value_type = R;
  //! The GEMM policy of its gating linear (a moe_layer runs its gating on it too).
  using gemms_type = Gemms;

  //! The most experts, selections and groups the kernels take.
  static constexpr int max_experts = kernels::router_topk_block_kernel::max_experts;
  static constexpr int max_topk = kernels::router_topk_kernel::max_topk;
  static constexpr int max_groups = kernels::router_topk_kernel::max_groups;

  //! Checks the options (validate() and the kernels' limits) and the hidden size.
  [[nodiscard]] static expected<topk_router> make(const topk_router_options& o, int hidden) {
    using detail::to_decimal;
    if (auto st = validate(o); !st) return unexpected<error>(st.error());
    if (o.num_experts > max_experts || o.topk > max_topk || o.num_groups > max_groups)
      return make_error(
          errc::invalid_argument,
          "topk_router: the kernels take E <= " + to_decimal(max_experts) +
              ", k <= " + to_decimal(max_topk) + " and at most " + to_decimal(max_groups) +
              " groups (got E = " + to_decimal(o.num_experts) + ", k = " + to_decimal(o.topk) +
              ", " + to_decimal(o.num_groups) + " groups)");
    if (hidden < 1) return make_error(errc::invalid_size, "topk_router: hidden must be >= 1");
    auto g = gating_type::make(o.num_experts, hidden);
    if (!g) return unexpected<error>(g.error());
    topk_router r;
    r.o_ = o;
    r.hidden_ = hidden;
    r.gating_ = *g;
    return r;
  }

  [[nodiscard]] const topk_router_options& options() const noexcept { return o_; }
  [[nodiscard]] int num_experts() const noexcept { return o_.num_experts; }
  [[nodiscard]] int topk() const noexcept { return o_.topk; }
  [[nodiscard]] int hidden() const noexcept { return hidden_; }

  //! Bytes of the context's memory forward() and backward_gating() take as their workspace.
  [[nodiscard]] static std::size_t workspace_bytes() noexcept {
    return gating_type::workspace_bytes();
  }

  //! logits = x W^T (router_gating), then the top-k routing (route()).
  [[nodiscard]] status forward(Exec& exec, const topk_router_forward<T, R, space>& f,
                               std::span<std::byte> workspace) const {
    if (auto st =
            gating_.forward(exec, {.x = f.x, .weight = f.weight, .logits = f.logits}, workspace);
        !st)
      return st;
    return route(
        exec,
        {.logits = f.logits, .expert_bias = f.expert_bias, .indices = f.indices, .probs = f.probs});
  }

  //! The top-k routing of logits [N, E] (the routing::router concept's step).
  [[nodiscard]] status route(Exec& exec, const router_route_args<R, space>& f) const {
    const int N = f.logits.rows(), E = o_.num_experts, k = o_.topk;
    if (auto st = check(f.logits, N, E, "logits"); !st) return st;
    if (auto st = check(f.indices, N, k, "indices"); !st) return st;
    if (auto st = check(f.probs, N, k, "probs"); !st) return st;
    const bool bias = !f.expert_bias.empty();
    if (bias != o_.expert_bias ||
        (bias &&
         (f.expert_bias.rows() != 1 || f.expert_bias.width() != E || !f.expert_bias.contiguous())))
      return shape_error(o_.expert_bias ? "expert_bias must be [1, E] (options.expert_bias)"
                                        : "expert_bias must be empty without options.expert_bias");
    if (N == 0) return {};
    return E <= kernels::router_topk_kernel::max_experts
               ? topk<kernels::basic_router_topk_kernel<warp_team, R>>(exec, f, N, warp_tokens)
               : topk<kernels::basic_router_topk_kernel<block_team, R>>(exec, f, N, 1);
  }

  //! dlogits from the probabilities' gradients (selection, group masks and bias carry none).
  [[nodiscard]] status backward(Exec& exec, const router_backward_args<R, space>& b) const {
    const int N = b.logits.rows(), E = o_.num_experts, k = o_.topk;
    if (auto st = check(b.logits, N, E, "logits"); !st) return st;
    if (auto st = check(b.indices, N, k, "indices"); !st) return st;
    if (auto st = check(b.dprobs, N, k, "dprobs"); !st) return st;
    if (auto st = check(b.dlogits, N, E, "dlogits"); !st) return st;
    if (N == 0) return {};
    return E <= kernels::router_backward_kernel::max_experts
               ? logits_grad<kernels::basic_router_backward_kernel<warp_team, R>>(exec, b, N,
                                                                                  warp_tokens)
               : logits_grad<kernels::basic_router_backward_kernel<block_team, R>>(exec, b, N, 1);
  }

  //! dx = dlogits W, and the weight gradient += dlogits^T x (router_gating's backward).
  template <class G>
  [[nodiscard]] status backward_gating(Exec& exec, const gating_backward_args<T, R, G, space>& b,
                                       std::span<std::byte> workspace) const {
    return gating_.backward(exec, b, workspace);
  }

  //! The gating linear this router runs.
  [[nodiscard]] const auto& gating() const noexcept { return gating_; }
  //! Where the router's GEMMs tell that a backend declined (router_gating::set_gemm_notice).
  void set_gemm_notice(gemm_notice_sink sink) { gating_.set_gemm_notice(std::move(sink)); }

 private:
  using warp_team = kernels::detail_router::warp_per_token;
  using block_team = kernels::detail_router::block_per_token;
  static constexpr int warp_tokens = kernels::router_topk_kernel::block_threads / 32;
  using gating_type = router_gating<T, Exec, R, Gemms>;

  static status shape_error(const std::string& what) {
    return make_error(errc::shape_mismatch, "topk_router: " + what);
  }
  template <class V>
  static status check(const V& v, int rows, int width, const char* what) {
    if (v.rows() != rows || v.width() != width || !v.contiguous())
      return shape_error(std::string(what) + " must be contiguous [" + detail::to_decimal(rows) +
                         ", " + detail::to_decimal(width) + "]");
    return {};
  }

  template <class K>
  status topk(Exec& exec, const router_route_args<R, space>& f, int N, int tokens_per_block) const {
    const K kernel{.logits = f.logits.data(),
                   .num_tokens = N,
                   .num_experts = o_.num_experts,
                   .topk = o_.topk,
                   .score = o_.score,
                   .pre_softmax = o_.pre_softmax,
                   .num_groups = o_.num_groups,
                   .group_topk = o_.group_topk,
                   .expert_bias = f.expert_bias.empty() ? nullptr : f.expert_bias.data(),
                   .scale = o_.scaling_factor.has_value(),
                   .scaling_factor = static_cast<R>(o_.scaling_factor.value_or(1.0)),
                   .indices = f.indices.data(),
                   .probs = f.probs.data()};
    return launch(exec, capped_grid<Exec, K>(N, tokens_per_block), kernel);
  }
  template <class K>
  status logits_grad(Exec& exec, const router_backward_args<R, space>& b, int N,
                     int tokens_per_block) const {
    const K kernel{.logits = b.logits.data(),
                   .indices = b.indices.data(),
                   .dprobs = b.dprobs.data(),
                   .num_tokens = N,
                   .num_experts = o_.num_experts,
                   .topk = o_.topk,
                   .score = o_.score,
                   .pre_softmax = o_.pre_softmax,
                   .scale = o_.scaling_factor.has_value(),
                   .scaling_factor = static_cast<R>(o_.scaling_factor.value_or(1.0)),
                   .dlogits = b.dlogits.data()};
    return launch(exec, capped_grid<Exec, K>(N, tokens_per_block), kernel);
  }

  topk_router_options o_{};
  int hidden_ = 0;
  gating_type gating_{};
};

//! True for moefold's topk_router (any element types, context and GEMM policy).
template <class X>
inline constexpr bool is_topk_router_v = false;
template <class T, class Exec, class R, class G>
inline constexpr bool is_topk_router_v<topk_router<T, Exec, R, G>> = true;

}  // namespace v0_1
}  // namespace moefold
