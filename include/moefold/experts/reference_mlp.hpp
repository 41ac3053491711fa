//! @file reference_mlp.hpp
//! @brief moefold's experts on the host that own their parameters: a thin owner over
//! mlp_experts<T, host_exec> (the experts over caller-owned views) holding the weights and
//! gradients in vectors of its own, for tests, examples and small programs. Trainers whose
//! optimizer owns the parameters use mlp_experts directly.
//!
//! It is an expert_fn on host_exec (forward and backward with the context and a workspace from
//! the caller, what a layer calls) that keeps nothing for its backward: its experts recompute fc1
//! (mlp_experts_options::recompute_fc1), so a backward needs no forward before it, as an oracle's
//! callers expect, and a layer over it runs the expert protocol's form without saved storage. It
//! has a host convenience besides: forward and backward over
//! spans, on a host_exec and a workspace of its own (grown to the largest batch it has seen: a
//! test oracle's comfort, not the hot path).
//!
//! Layouts: experts/mlp_params.hpp (Megatron-Core's TEGroupedMLP per local expert): fc1 of local
//! expert l is [F1, H] with F1 = (gated ? 2 : 1) * F / ETP (this shard's gate rows, then its up
//! rows); fc2 is [H, F / ETP]. Gradients have the same layouts, in G (by default T, fp32 for
//! bf16/fp16 weights), accumulated (+=). P is the probabilities' type (mlp_experts).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../exec/gemm_policy.hpp"
#include "../exec/host_exec.hpp"
#include "expert_fn.hpp"
#include "mlp_experts.hpp"
#include "mlp_params.hpp"

namespace moefold {
inline namespace v0_1 {

template <class T, class Grad = main_grad_t<T>, class P = T>
class reference_mlp {
 public:
  using value_type = T;
  using grad_type = Grad;
  using prob_type = P;
  //! The experts it owns the parameters of (the host GEMM: host_exec's default).
  using experts_type = mlp_experts<T, host_exec, host_gemms, Grad, P>;

  //! Zero-initialised shards of the given shape (checked: sizes >= 1, ETP divides F).
  [[nodiscard]] static expected<reference_mlp> make(const mlp_shape& s) {
    if (auto st = check_mlp_shape(s, "reference_mlp"); !st) return unexpected<error>(st.error());
    reference_mlp m;
    const mlp_param_sizes n = mlp_sizes(s);
    m.fc1_.assign(n.fc1, T(0));
    m.fc2_.assign(n.fc2, T(0));
    m.g1_.assign(n.fc1, Grad(0));
    m.g2_.assign(n.fc2, Grad(0));
    auto v = experts_type::make(s, mlp_weights<T>{m.fc1_, m.fc2_}, mlp_grads<Grad>{m.g1_, m.g2_},
                                {.recompute_fc1 = true});
    if (!v) return unexpected<error>(v.error());
    m.view_ = std::move(*v);
    return m;
  }

  // The view points into this object's vectors: a copy or move points it at the new owner's.
  reference_mlp() = default;
  reference_mlp(const reference_mlp& o)
      : fc1_(o.fc1_), fc2_(o.fc2_), g1_(o.g1_), g2_(o.g2_), view_(o.view_) {
    rebind();
  }
  reference_mlp(reference_mlp&& o) noexcept
      : fc1_(std::move(o.fc1_)),
        fc2_(std::move(o.fc2_)),
        g1_(std::move(o.g1_)),
        g2_(std::move(o.g2_)),
        view_(std::move(o.view_)),
        ws_(std::move(o.ws_)) {
    rebind();
  }
  reference_mlp& operator=(reference_mlp o) noexcept {
    fc1_ = std::move(o.fc1_);
    fc2_ = std::move(o.fc2_);
    g1_ = std::move(o.g1_);
    g2_ = std::move(o.g2_);
    view_ = std::move(o.view_);
    ws_ = std::move(o.ws_);
    rebind();
    return *this;
  }
  ~reference_mlp() = default;

  [[nodiscard]] int num_local_experts() const noexcept { return view_.num_local_experts(); }
  [[nodiscard]] int hidden() const noexcept { return view_.hidden(); }
  [[nodiscard]] const mlp_shape& shape() const noexcept { return view_.shape(); }
  //! fc1 of local expert l: [F1, H] with F1 = (gated ? 2 : 1) * F / ETP.
  [[nodiscard]] std::span<T> fc1(int l) noexcept { return slice(fc1_, l, f1() * hid()); }
  //! fc2 of local expert l: [H, F / ETP].
  [[nodiscard]] std::span<T> fc2(int l) noexcept { return slice(fc2_, l, hid() * fs()); }
  [[nodiscard]] std::span<Grad> fc1_grad(int l) noexcept { return slice(g1_, l, f1() * hid()); }
  [[nodiscard]] std::span<Grad> fc2_grad(int l) noexcept { return slice(g2_, l, hid() * fs()); }
  //! All weights and all gradients (for gradient reduction over EDP and for optimizers).
  [[nodiscard]] std::span<T> weights_fc1() noexcept { return fc1_; }
  [[nodiscard]] std::span<T> weights_fc2() noexcept { return fc2_; }
  [[nodiscard]] std::span<Grad> grads_fc1() noexcept { return g1_; }
  [[nodiscard]] std::span<Grad> grads_fc2() noexcept { return g2_; }
  //! The gradient views (experts_type::grads()), as mlp_experts exposes them.
  [[nodiscard]] const typename experts_type::grads_type& grads() const noexcept {
    return view_.grads();
  }
  //! The experts over this object's buffers.
  [[nodiscard]] experts_type& view() noexcept { return view_; }
  void zero_grad() noexcept {
    for (auto& v : g1_) v = Grad(0);
    for (auto& v : g2_) v = Grad(0);
  }

  //! Loads this rank's shard of local expert l from the full (unsharded) weights in Megatron-Core's
  //! (and Hugging Face's) layout: full fc1 [(gated ? 2F : F), H] with rows [gate; up]
  //! (gate_proj stacked on up_proj), full fc2 [H, F] (down_proj).
  [[nodiscard]] status load_full(int l, std::span<const T> full_fc1, std::span<const T> full_fc2) {
    const mlp_shape& s = shape();
    const int H = s.hidden, F = s.ffn, G = is_gated(s.act) ? 2 : 1, Fs = fs();
    if (l < 0 || l >= s.num_local_experts)
      return make_error(errc::rank_out_of_range,
                        "reference_mlp: no local expert " + detail::to_decimal(l));
    if (full_fc1.size() != detail::uz(G * F) * detail::uz(H) ||
        full_fc2.size() != detail::uz(H) * detail::uz(F))
      return make_error(errc::shape_mismatch, "reference_mlp: full weights must be [" +
                                                  std::string(G == 2 ? "2F" : "F") +
                                                  ", H] and [H, F]");
    auto w1 = fc1(l);
    auto w2 = fc2(l);
    const int c0 = s.etp_rank * Fs;
    for (int g = 0; g < G; ++g)  // gate shard rows, then up shard rows
      for (int c = 0; c < Fs; ++c)
        for (int h = 0; h < H; ++h) w1[idx(g * Fs + c, h, H)] = full_fc1[idx(g * F + c0 + c, h, H)];
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < Fs; ++c) w2[idx(h, c, Fs)] = full_fc2[idx(h, c0 + c, F)];
    return {};
  }

  // --- the expert_fn protocol on host_exec (what a layer calls) --------------------------------

  //! See mlp_experts::workspace_bytes.
  [[nodiscard]] std::size_t workspace_bytes(int rows) const { return view_.workspace_bytes(rows); }
  //! See mlp_experts::forward.  [M, H] -> [M, H]
  [[nodiscard]] status forward(host_exec& x, const expert_batch<T, P>& b, row_view<T> y,
                               std::span<std::byte> workspace) {
    return view_.forward(x, b, y, {}, workspace);
  }
  //! See mlp_experts::backward: dx [M, H], dprobs [M, 1], and += the weight gradients.
  [[nodiscard]] status backward(host_exec& x, const expert_batch<T, P>& b, row_view<const T> dy,
                                row_view<T> dx, row_view<P> dprobs,
                                std::span<std::byte> workspace) {
    return view_.backward(x, b, dy, dx, dprobs, {}, workspace);
  }

  // --- the host convenience: spans, its own context and workspace -----------------------------

  //! y [M H] for the batch (a partial sum under ETP).
  [[nodiscard]] status forward(const expert_batch<T, P>& b, std::span<T> y) {
    if (auto st = check_span(y.size(), b.rows(), hid(), "y"); !st) return st;
    host_exec x;
    return view_.forward(x, b, row_view<T>(y.data(), b.rows(), hid()), {}, workspace(b.rows()));
  }
  //! dx [M H] and dprobs [M] from dy [M H], and += the weight gradients.
  [[nodiscard]] status backward(const expert_batch<T, P>& b, std::span<const T> dy, std::span<T> dx,
                                std::span<P> dprobs) {
    const int M = b.rows();
    if (auto st = check_span(dy.size(), M, hid(), "dy"); !st) return st;
    if (auto st = check_span(dx.size(), M, hid(), "dx"); !st) return st;
    if (auto st = check_span(dprobs.size(), M, 1, "dprobs"); !st) return st;
    host_exec x;
    return view_.backward(x, b, row_view<const T>(dy.data(), M, hid()),
                          row_view<T>(dx.data(), M, hid()), row_view<P>(dprobs.data(), M, 1), {},
                          workspace(M));
  }

 private:
  static constexpr std::size_t idx(int r, int c, int cols) noexcept {
    return detail::uz(r) * detail::uz(cols) + detail::uz(c);
  }
  template <class U>
  static std::span<U> slice(std::vector<U>& v, int l, int n) noexcept {
    return std::span<U>(v).subspan(detail::uz(l) * detail::uz(n), detail::uz(n));
  }
  static status check_span(std::size_t size, int rows, int width, const char* what) {
    if (rows >= 0 && size == detail::uz(rows) * detail::uz(width)) return {};
    return make_error(errc::shape_mismatch,
                      std::string("reference_mlp: ") + what + " must hold [M, " +
                          (width == 1 ? std::string("1") : std::string("H")) +
                          "] = " + detail::to_decimal(static_cast<long long>(rows) * width) +
                          " values, M = the batch's rows (got " +
                          detail::to_decimal(static_cast<long long>(size)) + ")");
  }
  // The convenience's workspace for `rows` rows (grown, never shrunk).
  std::span<std::byte> workspace(int rows) {
    const std::size_t need = view_.workspace_bytes(rows < 0 ? 0 : rows);
    if (ws_.size() < need) ws_.resize(need);
    return ws_;
  }
  int hid() const noexcept { return shape().hidden; }
  int fs() const noexcept { return shape().etp > 0 ? shape().ffn / shape().etp : 0; }
  int f1() const noexcept { return (is_gated(shape().act) ? 2 : 1) * fs(); }
  // The vectors have the view's sizes (make sized them), so the binding cannot be refused.
  void rebind() noexcept {
    (void)view_.bind(mlp_weights<T>{fc1_, fc2_}, mlp_grads<Grad>{g1_, g2_});
  }

  std::vector<T> fc1_, fc2_;
  std::vector<Grad> g1_, g2_;
  experts_type view_{};
  std::vector<std::byte> ws_;  // the host convenience's workspace
};

}  // namespace v0_1
}  // namespace moefold
