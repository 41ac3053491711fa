//! @file simt_router.hpp
//! @brief The router on an execution context that runs kernels (cpu_exec, cuda_exec): the
//! gating GEMM logits = x W^T (kernels/grouped_gemm.hpp, one group, one fma chain per logit in
//! fp32), the fused score function + top-k + normalisation (kernels/router.hpp: a warp per token
//! up to E = 256, kernels/router_block.hpp: a block per token up to E = 1,024), and the backward
//! in two steps, so that a layer can add the load-balancing losses' gradients in between:
//! backward_logits (dprobs -> dlogits) and backward_gating (dx = dlogits W, dW += dlogits^T x).
//! topk_router's options and rules (routing/topk_router.hpp: validate()), Megatron-Core's
//! router dtype fp32: logits, scores, probabilities and their gradients are fp32 for fp32 and
//! bf16 tokens alike. Host <-> device traffic per call: the GEMM's row range (two integers) to
//! the context, nothing back.
//!
//! Shapes: x [N, H] (any row stride); weight and its gradient [E, H], contiguous; logits,
//! dlogits [N, E], indices, probs, dprobs [N, k], contiguous; expert_bias [1, E] or empty;
//! dx [N, H] fp32 (any row stride).
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include <moefold/kernels/grouped_gemm.hpp>
#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_block.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"
#include "../exec/grouped_gemm_launch.hpp"
#include "topk_router.hpp"

namespace moefold {
inline namespace v0_1 {

//! One forward: the tokens in, the logits and the routing out (in the context's space S).
template <class T, class S>
struct simt_router_forward {
  row_view<const T, S> x{};                //!< [N, H]
  row_view<const float, S> expert_bias{};  //!< [1, E] with options.expert_bias, else empty
  row_view<float, S> logits{};             //!< [N, E]
  row_view<int, S> indices{};              //!< [N, k]
  row_view<float, S> probs{};              //!< [N, k]
};

//! The backward's first step: the probabilities' gradients to the logits'.
template <class S>
struct simt_router_logits_grad {
  row_view<const float, S> logits{};  //!< [N, E] the forward's
  row_view<const int, S> indices{};   //!< [N, k] the forward's
  row_view<const float, S> dprobs{};  //!< [N, k] (0 for a dropped pair)
  row_view<float, S> dlogits{};       //!< [N, E] written
};

//! The backward's second step: through the gating GEMM.
template <class T, class S>
struct simt_router_gating_grad {
  row_view<const T, S> x{};            //!< [N, H] the forward's
  row_view<const float, S> dlogits{};  //!< [N, E] (the router's and any loss's)
  row_view<float, S> dx{};             //!< [N, H] written: dlogits W
};

template <class T, execution_context Exec, class G = accumulator_t<T>>
class simt_router {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bfloat16>,
                "simt_router: tokens and weight are fp32 or bf16 (the router dtype is fp32)");

 public:
  using space = typename Exec::memory_space;
  using value_type = T;
  using grad_type = G;

  //! The most experts and selections the kernels take.
  static constexpr int max_experts = kernels::router_topk_block_kernel::max_experts;
  static constexpr int max_topk = kernels::router_topk_kernel::max_topk;
  static constexpr int max_groups = kernels::router_topk_kernel::max_groups;

  //! Checks the options (validate() and the kernels' limits) and the weight views; `exec`, the
  //! weight and its gradient buffer must outlive the router.
  [[nodiscard]] static expected<simt_router> make(Exec& exec, const topk_router_options& o,
                                                  int hidden, row_view<const T, space> weight,
                                                  row_view<G, space> grad) {
    using detail::to_decimal;
    if (auto st = validate(o); !st) return unexpected<error>(st.error());
    if (o.num_experts > max_experts || o.topk > max_topk || o.num_groups > max_groups)
      return unexpected<error>(make_error(
          errc::invalid_argument,
          "simt_router: the kernels take E <= " + to_decimal(max_experts) +
              ", k <= " + to_decimal(max_topk) + " and at most " + to_decimal(max_groups) +
              " groups (got E = " + to_decimal(o.num_experts) + ", k = " + to_decimal(o.topk) +
              ", " + to_decimal(o.num_groups) + " groups)"));
    if (hidden < 1)
      return unexpected<error>(make_error(errc::invalid_size, "simt_router: hidden must be >= 1"));
    const auto fits = [&](const auto& v) {
      return v.rows() == o.num_experts && v.width() == hidden && v.contiguous();
    };
    if (!fits(weight) || !fits(grad))
      return unexpected<error>(
          make_error(errc::shape_mismatch,
                     "simt_router: the weight and its gradient must be contiguous [E, H] = [" +
                         to_decimal(o.num_experts) + ", " + to_decimal(hidden) + "]"));
    simt_router r;
    r.x_ = &exec;
    r.o_ = o;
    r.hidden_ = hidden;
    r.w_ = weight;
    r.g_ = grad;
    return r;
  }

  [[nodiscard]] const topk_router_options& options() const noexcept { return o_; }
  [[nodiscard]] int hidden() const noexcept { return hidden_; }

  //! logits = x W^T, then the top-k routing.
  [[nodiscard]] status forward(const simt_router_forward<T, space>& f) {
    const int N = f.x.rows(), E = o_.num_experts, k = o_.topk;
    if (f.x.width() != hidden_)
      return shape_error("x must be [N, H] with H = " + detail::to_decimal(hidden_));
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
    if (auto st = set_rows(N); !st) return st;
    // logits = x W^T: A (m = n, k = h) = x, B (k = h, n = e) = W[e][h], C (m = n, n = e).
    if (auto st = gemm<T, T, float>(kernels::gemm_grouping::rows_are_m, 0, E, hidden_,
                                    {f.x.data(), f.x.stride(), 1, 0}, {w_.data(), 1, hidden_, 0},
                                    {f.logits.data(), E, 1, 0}, false);
        !st)
      return st;
    return E <= kernels::router_topk_kernel::max_experts
               ? topk<kernels::router_topk_kernel>(f, N, tokens_per_block_warp)
               : topk<kernels::router_topk_block_kernel>(f, N, 1);
  }

  //! dlogits from the probabilities' gradients (selection, group masks and bias carry none).
  [[nodiscard]] status backward_logits(const simt_router_logits_grad<space>& b) {
    const int N = b.logits.rows(), E = o_.num_experts, k = o_.topk;
    if (auto st = check(b.logits, N, E, "logits"); !st) return st;
    if (auto st = check(b.indices, N, k, "indices"); !st) return st;
    if (auto st = check(b.dprobs, N, k, "dprobs"); !st) return st;
    if (auto st = check(b.dlogits, N, E, "dlogits"); !st) return st;
    if (N == 0) return {};
    return E <= kernels::router_backward_kernel::max_experts
               ? logits_grad<kernels::router_backward_kernel>(b, N, tokens_per_block_warp)
               : logits_grad<kernels::router_backward_block_kernel>(b, N, 1);
  }

  //! dx = dlogits W, and the weight gradient += dlogits^T x.
  [[nodiscard]] status backward_gating(const simt_router_gating_grad<T, space>& b) {
    const int N = b.x.rows(), E = o_.num_experts;
    if (b.x.width() != hidden_)
      return shape_error("x must be [N, H] with H = " + detail::to_decimal(hidden_));
    if (auto st = check(b.dlogits, N, E, "dlogits"); !st) return st;
    if (b.dx.rows() != N || b.dx.width() != hidden_)
      return shape_error("dx must be [N, H] = [" + detail::to_decimal(N) + ", " +
                         detail::to_decimal(hidden_) + "]");
    if (N == 0) return {};
    if (auto st = set_rows(N); !st) return st;
    // dx = dlogits W: A (m = n, k = e) = dlogits, B (k = e, n = h) = W[e][h].
    if (auto st = gemm<float, T, float>(kernels::gemm_grouping::rows_are_m, 0, hidden_, E,
                                        {b.dlogits.data(), E, 1, 0}, {w_.data(), hidden_, 1, 0},
                                        {b.dx.data(), b.dx.stride(), 1, 0}, false);
        !st)
      return st;
    // dW [e, h] += sum_n dlogits[n, e] x[n, h]: A (m = e, k = n), B (k = n, n = h); K = N.
    return gemm<float, T, G>(kernels::gemm_grouping::rows_are_k, E, hidden_, 0,
                             {b.dlogits.data(), 1, E, 0}, {b.x.data(), b.x.stride(), 1, 0},
                             {g_.data(), hidden_, 1, 0}, true);
  }

 private:
  static constexpr int tokens_per_block_warp = kernels::router_topk_kernel::block_threads / 32;

  static status shape_error(const std::string& what) {
    return make_error(errc::shape_mismatch, "simt_router: " + what);
  }
  template <class V>
  static status check(const V& v, int rows, int width, const char* what) {
    if (v.rows() != rows || v.width() != width || !v.contiguous())
      return shape_error(std::string(what) + " must be contiguous [" + detail::to_decimal(rows) +
                         ", " + detail::to_decimal(width) + "]");
    return {};
  }

  // The GEMM's one group: rows [0, N) on the context.
  status set_rows(int n) {
    if (offsets_.view().data() == nullptr) {
      auto o = exec_buffer<long long, Exec>::make(*x_, 1, 2);
      if (!o) return unexpected<error>(o.error());
      offsets_ = std::move(*o);
    }
    host_offsets_[0] = 0;
    host_offsets_[1] = n;
    return x_->copy(row_view<const long long, host_space>(host_offsets_, 1, 2), offsets_.view());
  }

  template <class K>
  status topk(const simt_router_forward<T, space>& f, int N, int tokens_per_block) {
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
                   .scaling_factor = static_cast<float>(o_.scaling_factor.value_or(1.0)),
                   .indices = f.indices.data(),
                   .probs = f.probs.data()};
    return launch(*x_, capped_grid<Exec, K>(N, tokens_per_block), kernel);
  }
  template <class K>
  status logits_grad(const simt_router_logits_grad<space>& b, int N, int tokens_per_block) {
    const K kernel{.logits = b.logits.data(),
                   .indices = b.indices.data(),
                   .dprobs = b.dprobs.data(),
                   .num_tokens = N,
                   .num_experts = o_.num_experts,
                   .topk = o_.topk,
                   .score = o_.score,
                   .pre_softmax = o_.pre_softmax,
                   .scale = o_.scaling_factor.has_value(),
                   .scaling_factor = static_cast<float>(o_.scaling_factor.value_or(1.0)),
                   .dlogits = b.dlogits.data()};
    return launch(*x_, capped_grid<Exec, K>(N, tokens_per_block), kernel);
  }
  template <class TA, class TB, class TC>
  status gemm(kernels::gemm_grouping grouping, int m, int n, int k,
              kernels::gemm_operand<const TA> pa, kernels::gemm_operand<const TB> pb,
              kernels::gemm_operand<TC> pc, bool accumulate) {
    using K = kernels::grouped_gemm_kernel<TA, TB, TC>;
    const K kernel{.grouping = grouping,
                   .offsets = offsets_.view().data(),
                   .groups = 1,
                   .m = m,
                   .n = n,
                   .k = k,
                   .a = pa,
                   .b = pb,
                   .c = pc,
                   .accumulate = accumulate};
    return launch_grouped_gemm(*x_, kernel, std::span<const long long>(host_offsets_));
  }

  Exec* x_ = nullptr;
  topk_router_options o_{};
  int hidden_ = 0;
  row_view<const T, space> w_{};
  row_view<G, space> g_{};
  long long host_offsets_[2] = {0, 0};
  exec_buffer<long long, Exec> offsets_{};
};

}  // namespace v0_1
}  // namespace moefold
