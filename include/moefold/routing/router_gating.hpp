//! @file router_gating.hpp
//! @brief The router's gating linear on an execution context, through the grouped-GEMM seam (the
//! backend the Gemms policy names for gemm_kind::router): logits = x W^T in the router element
//! type R (Megatron-Core's router_gating_linear: tokens and weight read in T, accumulated in fp32,
//! or fp64 for fp64 operands), and its backward dx = dlogits W, dW += dlogits^T x (beta = 1 into
//! the caller's gradient buffer). topk_router runs it before its top-k, and a layer runs it for a
//! user router (routing::router routes logits): one gating for every router.
//!
//! The context is passed to every call; the workspace (workspace_bytes(), in the context's
//! memory) holds the GEMMs' row range. Shapes: x [N, H] (any row stride); weight and its gradient
//! [E, H], contiguous; logits and dlogits [N, E], contiguous; dx [N, H] (any row stride).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../exec/exec.hpp"
#include "../exec/gemm_notice.hpp"
#include "../exec/gemm_policy.hpp"
#include "../exec/grouped_gemm.hpp"
#include "router_args.hpp"

namespace moefold {
inline namespace v0_1 {

//! logits = x W^T.
template <class T, class R, class S>
struct gating_forward_args {
  row_view<const T, S> x{};       //!< [N, H]
  row_view<const T, S> weight{};  //!< [E, H]
  row_view<R, S> logits{};        //!< [N, E] written
};

//! dx = dlogits W and weight_grad += dlogits^T x.
template <class T, class R, class G, class S>
struct gating_backward_args {
  row_view<const T, S> x{};        //!< [N, H] the forward's
  row_view<const T, S> weight{};   //!< [E, H] the forward's
  row_view<const R, S> dlogits{};  //!< [N, E] (the router's and any loss's)
  row_view<R, S> dx{};             //!< [N, H] written
  row_view<G, S> weight_grad{};    //!< [E, H] accumulated (beta = 1)
};

template <class T, class Exec, class R = accumulator_t<T>, class Gemms = default_gemms<Exec>>
class router_gating {
  static_assert(router_dtype_check<R, Exec>::ok);

 public:
  using space = typename Exec::memory_space;

  //! E experts of hidden size H.
  [[nodiscard]] static expected<router_gating> make(int num_experts, int hidden) {
    if (num_experts < 1 || hidden < 1)
      return make_error(errc::invalid_size,
                        "router gating: num_experts and hidden must be >= 1 (got " +
                            detail::to_decimal(num_experts) + ", " + detail::to_decimal(hidden) +
                            ")");
    router_gating g;
    g.experts_ = num_experts;
    g.hidden_ = hidden;
    return g;
  }

  //! Where the gating tells, once each, that a GEMM's backend declined and another runs
  //! (exec/gemm_notice.hpp; stderr by default), and what it has told.
  void set_gemm_notice(gemm_notice_sink sink) { notices_.set_sink(std::move(sink)); }
  [[nodiscard]] const std::vector<std::string>& gemm_notices_said() const noexcept {
    return notices_.said();
  }

  //! Bytes of the context's memory each call takes as its workspace (the GEMMs' row range).
  [[nodiscard]] static std::size_t workspace_bytes() noexcept {
    const long long rows[2] = {0, 1};
    const std::span<const long long> one(rows);
    return std::max(
        {backend<T, T, R>::workspace_bytes({.groups = 1, .host_offsets = one}),
         backend<R, T, R>::workspace_bytes({.groups = 1, .host_offsets = one}),
         backend<R, T, main_grad_t<T>>::workspace_bytes({.groups = 1, .host_offsets = one})});
  }

  //! logits = x W^T: A (m = n, k = h) = x, B (k = h, n = e) = W[e][h], C (m = n, n = e).
  [[nodiscard]] status forward(Exec& exec, const gating_forward_args<T, R, space>& f,
                               std::span<std::byte> workspace) const {
    const int N = f.x.rows(), E = experts_;
    if (auto st = check_x(f.x); !st) return st;
    if (auto st = check(f.weight, E, hidden_, "weight"); !st) return st;
    if (auto st = check(f.logits, N, E, "logits"); !st) return st;
    if (N == 0) return {};
    const long long rows[2] = {0, N};
    backend<T, T, R> gemm;
    return run(exec, gemm,
               {.grouping = kernels::gemm_grouping::rows_are_m,
                .groups = 1,
                .n = E,
                .k = hidden_,
                .host_offsets = rows,
                .a = {f.x.data(), f.x.stride(), 1, 0},
                .b = {f.weight.data(), 1, hidden_, 0},
                .c = {f.logits.data(), E, 1, 0}},
               workspace, "logits");
  }

  //! dx = dlogits W; dW [e, h] += sum_n dlogits[n, e] x[n, h] (G: the gradient's element type,
  //! fp32 for bf16 weights as Megatron-Core's main_grad).
  template <class G>
  [[nodiscard]] status backward(Exec& exec, const gating_backward_args<T, R, G, space>& b,
                                std::span<std::byte> workspace) const {
    const int N = b.x.rows(), E = experts_;
    if (auto st = check_x(b.x); !st) return st;
    if (auto st = check(b.weight, E, hidden_, "weight"); !st) return st;
    if (auto st = check(b.weight_grad, E, hidden_, "weight_grad"); !st) return st;
    if (auto st = check(b.dlogits, N, E, "dlogits"); !st) return st;
    if (b.dx.rows() != N || b.dx.width() != hidden_)
      return error_of("dx must be [N, H] = [" + detail::to_decimal(N) + ", " +
                      detail::to_decimal(hidden_) + "]");
    if (N == 0) return {};
    const long long rows[2] = {0, N};
    // dx: A (m = n, k = e) = dlogits, B (k = e, n = h) = W[e][h].
    backend<R, T, R> dx;
    if (auto st = run(exec, dx,
                      {.grouping = kernels::gemm_grouping::rows_are_m,
                       .groups = 1,
                       .n = hidden_,
                       .k = E,
                       .host_offsets = rows,
                       .a = {b.dlogits.data(), E, 1, 0},
                       .b = {b.weight.data(), hidden_, 1, 0},
                       .c = {b.dx.data(), b.dx.stride(), 1, 0}},
                      workspace, "dx");
        !st)
      return st;
    // dW: A (m = e, k = n) = dlogits^T, B (k = n, n = h) = x; K = N.
    backend<R, T, G> dw;
    return run(exec, dw,
               {.grouping = kernels::gemm_grouping::rows_are_k,
                .groups = 1,
                .m = E,
                .n = hidden_,
                .host_offsets = rows,
                .a = {b.dlogits.data(), 1, E, 0},
                .b = {b.x.data(), b.x.stride(), 1, 0},
                .c = {b.weight_grad.data(), hidden_, 1, 0},
                .accumulate = true},
               workspace, "weight gradient");
  }

 private:
  template <class A, class B, class C>
  using backend = typename Gemms::template backend<gemm_kind::router, gemm_mode::dropless, A, B, C>;

  static status error_of(const std::string& what) {
    return make_error(errc::shape_mismatch, "router gating: " + what);
  }
  template <class V>
  status check_x(const V& x) const {
    if (x.width() != hidden_)
      return error_of("x must be [N, H] with H = " + detail::to_decimal(hidden_));
    return {};
  }
  template <class V>
  static status check(const V& v, int rows, int width, const char* what) {
    if (v.rows() != rows || v.width() != width || !v.contiguous())
      return error_of(std::string(what) + " must be contiguous [" + detail::to_decimal(rows) +
                      ", " + detail::to_decimal(width) + "]");
    return {};
  }
  // One GEMM through the seam: its rules, its workspace, then the run.
  template <class G>
  status run(Exec& exec, G& gemm, const typename G::args_type& args, std::span<std::byte> workspace,
             const char* what) const {
    if (auto st = G::can_implement(args); !st) return st;
    if (workspace.size() < G::workspace_bytes(args))
      return make_error(errc::workspace_too_small, "router gating: the workspace has " +
                                                       detail::to_decimal(workspace.size()) +
                                                       " bytes; workspace_bytes() asks for " +
                                                       detail::to_decimal(workspace_bytes()));
    if (auto st = gemm.initialize(exec, args, workspace); !st) return st;
    notices_.after_initialize(gemm, "router gating", what);
    return gemm.run(exec);
  }

  int experts_ = 0, hidden_ = 0;
  // The fallbacks taken, told once each (exec/gemm_notice.hpp).
  mutable gemm_notices notices_{};
};

}  // namespace v0_1
}  // namespace moefold
