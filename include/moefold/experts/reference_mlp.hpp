//! @file reference_mlp.hpp
//! @brief moefold's reference experts on the CPU: per local expert an MLP fc1 -> activation
//! (-> * prob) -> fc2, with weights sharded over expert tensor parallelism the way Megatron-Core
//! shards them: fc1 column-parallel (under GLU the local shard is [gate shard | up shard]), fc2
//! row-parallel, so each ETP rank produces a partial output that the dispatcher sums.
//!
//! Layouts (row-major): fc1 of local expert l is [H, F1] with F1 = (gated ? 2 : 1) * F / ETP;
//! fc2 is [F / ETP, H]. Gradients have the same layouts and are accumulated (+=) by backward().
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "activation.hpp"
#include "expert_fn.hpp"

namespace moefold {
inline namespace v0_1 {

//! The shape of one rank's expert shards.
struct mlp_shape {
  int hidden = 0;             //!< H
  int ffn = 0;                //!< F, the full (unsharded) expert FFN size
  int num_local_experts = 1;  //!< L
  int etp = 1;                //!< ETP
  int etp_rank = 0;           //!< this shard's index in [0, ETP)
  activation act = activation::swiglu;
};

template <class T>
class reference_mlp {
 public:
  //! Zero-initialised shards of the given shape (checked: sizes >= 1, ETP divides F).
  [[nodiscard]] static expected<reference_mlp> make(const mlp_shape& s) {
    using detail::to_decimal;
    if (s.hidden < 1 || s.ffn < 1 || s.num_local_experts < 0 || s.etp < 1)
      return make_error(errc::invalid_size,
                        "reference_mlp: hidden, ffn and etp must be >= 1 and "
                        "num_local_experts >= 0");
    if (s.ffn % s.etp != 0)
      return make_error(errc::invalid_argument,
                        "reference_mlp: ffn = " + to_decimal(s.ffn) +
                            " is not divisible by etp = " + to_decimal(s.etp) +
                            " (each ETP rank holds ffn / etp columns of fc1 and rows of fc2)");
    if (s.etp_rank < 0 || s.etp_rank >= s.etp)
      return make_error(errc::rank_out_of_range, "reference_mlp: etp_rank outside [0, etp)");
    reference_mlp m;
    m.s_ = s;
    m.fs_ = s.ffn / s.etp;
    m.f1_ = (is_gated(s.act) ? 2 : 1) * m.fs_;
    const auto l = static_cast<std::size_t>(s.num_local_experts);
    m.fc1_.assign(l * static_cast<std::size_t>(s.hidden) * static_cast<std::size_t>(m.f1_), T(0));
    m.fc2_.assign(l * static_cast<std::size_t>(m.fs_) * static_cast<std::size_t>(s.hidden), T(0));
    m.g1_.assign(m.fc1_.size(), T(0));
    m.g2_.assign(m.fc2_.size(), T(0));
    return m;
  }

  [[nodiscard]] int num_local_experts() const noexcept { return s_.num_local_experts; }
  [[nodiscard]] int hidden() const noexcept { return s_.hidden; }
  [[nodiscard]] const mlp_shape& shape() const noexcept { return s_; }
  //! fc1 of local expert l: [H, F1] with F1 = (gated ? 2 : 1) * F / ETP.
  [[nodiscard]] std::span<T> fc1(int l) noexcept { return slice(fc1_, l, s_.hidden * f1_); }
  //! fc2 of local expert l: [F / ETP, H].
  [[nodiscard]] std::span<T> fc2(int l) noexcept { return slice(fc2_, l, fs_ * s_.hidden); }
  [[nodiscard]] std::span<T> fc1_grad(int l) noexcept { return slice(g1_, l, s_.hidden * f1_); }
  [[nodiscard]] std::span<T> fc2_grad(int l) noexcept { return slice(g2_, l, fs_ * s_.hidden); }
  //! All weights and all gradients (for gradient reduction over EDP and for optimizers).
  [[nodiscard]] std::span<T> weights_fc1() noexcept { return fc1_; }
  [[nodiscard]] std::span<T> weights_fc2() noexcept { return fc2_; }
  [[nodiscard]] std::span<T> grads_fc1() noexcept { return g1_; }
  [[nodiscard]] std::span<T> grads_fc2() noexcept { return g2_; }
  void zero_grad() noexcept {
    for (auto& v : g1_) v = T(0);
    for (auto& v : g2_) v = T(0);
  }

  //! Loads this rank's shard of local expert l from the full (unsharded) weights, laid out as in
  //! Megatron-Core: full fc1 [H, (gated ? 2F : F)] with columns [gate | up], full fc2 [F, H].
  [[nodiscard]] status load_full(int l, std::span<const T> full_fc1, std::span<const T> full_fc2) {
    const int H = s_.hidden, F = s_.ffn, G = is_gated(s_.act) ? 2 : 1;
    if (l < 0 || l >= s_.num_local_experts)
      return make_error(errc::rank_out_of_range,
                        "reference_mlp: no local expert " + detail::to_decimal(l));
    if (full_fc1.size() != static_cast<std::size_t>(H) * static_cast<std::size_t>(G * F) ||
        full_fc2.size() != static_cast<std::size_t>(F) * static_cast<std::size_t>(H))
      return make_error(errc::shape_mismatch, "reference_mlp: full weights must be [H, " +
                                                  std::string(G == 2 ? "2F" : "F") +
                                                  "] and [F, H]");
    auto w1 = fc1(l);
    auto w2 = fc2(l);
    const int c0 = s_.etp_rank * fs_;
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < G; ++g)  // gate shard, then up shard
        for (int c = 0; c < fs_; ++c)
          w1[idx(h, g * fs_ + c, f1_)] = full_fc1[idx(h, g * F + c0 + c, G * F)];
    for (int r = 0; r < fs_; ++r)
      for (int h = 0; h < H; ++h) w2[idx(r, h, H)] = full_fc2[idx(c0 + r, h, H)];
    return {};
  }

  //! y = fc2(act(fc1 x) * p) for every row of the batch (a partial sum under ETP).  [M,H]->[M,H]
  //! Not const: it works in the functor's own row scratch (no allocation per call).
  [[nodiscard]] status forward(const expert_batch<T>& b, std::span<T> y) {
    const std::size_t outs_h[] = {y.size()};
    if (auto st = check_expert_batch<T>(b, s_.num_local_experts, s_.hidden, outs_h, {}); !st)
      return st;
    std::vector<T>&a = a_, &h = h_;
    a.resize(detail::uz(f1_));
    h.resize(detail::uz(fs_));
    for_each_row(b, [&](int l, std::size_t r) {
      fc1_row(l, b, r, a);
      for (int c = 0; c < fs_; ++c) h[detail::uz(c)] = act_out(a, c) * b.probs[r];
      fc2_row(l, h, y, r);
    });
    return {};
  }

  //! From dy [M,H]: dx [M,H], dprobs [M] (ETP partials), and += the weight gradients. Recomputes
  //! the activations from x (a reference, not a memory-saving design).
  [[nodiscard]] status backward(const expert_batch<T>& b, std::span<const T> dy, std::span<T> dx,
                                std::span<T> dprobs) {
    const std::size_t outs_h[] = {dy.size(), dx.size()};
    const std::size_t outs[] = {dprobs.size()};
    if (auto st = check_expert_batch<T>(b, s_.num_local_experts, s_.hidden, outs_h, outs); !st)
      return st;
    const int H = s_.hidden;
    std::vector<T>&a = a_, &da = da_;
    a.resize(detail::uz(f1_));
    da.resize(detail::uz(f1_));
    for_each_row(b, [&](int l, std::size_t r) {
      fc1_row(l, b, r, a);
      const auto w1 = cslice(fc1_, l, H * f1_);
      const auto w2 = cslice(fc2_, l, fs_ * H);
      auto g1 = slice(g1_, l, H * f1_);
      auto g2 = slice(g2_, l, fs_ * H);
      const T p = b.probs[r];
      T dp = T(0);
      for (int c = 0; c < fs_; ++c) {
        // dh = dy . fc2^T; fc2 grad += (act * p)^T dy.
        T s = T(0);
        const T out = act_out(a, c);
        for (int h = 0; h < H; ++h) {
          const T g = dy[r * detail::uz(H) + detail::uz(h)];
          s += g * w2[idx(c, h, H)];
          g2[idx(c, h, H)] += out * p * g;
        }
        dp += out * s;
        const T d = p * s;  // gradient at act_out
        if (is_gated(s_.act)) {
          const T gate = a[detail::uz(c)], up = a[detail::uz(fs_ + c)];
          da[detail::uz(c)] = d * up * activate_derivative(s_.act, gate);
          da[detail::uz(fs_ + c)] = d * activate(s_.act, gate);
        } else {
          da[detail::uz(c)] = d * activate_derivative(s_.act, a[detail::uz(c)]);
        }
      }
      dprobs[r] = dp;
      for (int h = 0; h < H; ++h) {
        const T xv = b.x[r * detail::uz(H) + detail::uz(h)];
        T s = T(0);
        for (int c = 0; c < f1_; ++c) {
          s += da[detail::uz(c)] * w1[idx(h, c, f1_)];
          g1[idx(h, c, f1_)] += xv * da[detail::uz(c)];
        }
        dx[r * detail::uz(H) + detail::uz(h)] = s;
      }
    });
    return {};
  }

 private:
  static constexpr std::size_t idx(int r, int c, int cols) noexcept {
    return detail::uz(r) * detail::uz(cols) + detail::uz(c);
  }
  static std::span<T> slice(std::vector<T>& v, int l, int n) noexcept {
    return std::span<T>(v).subspan(detail::uz(l) * detail::uz(n), detail::uz(n));
  }
  static std::span<const T> cslice(const std::vector<T>& v, int l, int n) noexcept {
    return std::span<const T>(v).subspan(detail::uz(l) * detail::uz(n), detail::uz(n));
  }
  // Calls f(local expert, row) for every row, experts in order.
  template <class F>
  static void for_each_row(const expert_batch<T>& b, F&& f) {
    std::size_t r = 0;
    for (std::size_t l = 0; l < b.counts.size(); ++l)
      for (int i = 0; i < b.counts[l]; ++i) f(static_cast<int>(l), r++);
  }
  // a = x[r] . fc1(l)   [F1]
  void fc1_row(int l, const expert_batch<T>& b, std::size_t r, std::vector<T>& a) const {
    const auto w1 = cslice(fc1_, l, s_.hidden * f1_);
    for (auto& v : a) v = T(0);
    for (int h = 0; h < s_.hidden; ++h) {
      const T xv = b.x[r * detail::uz(s_.hidden) + detail::uz(h)];
      for (int c = 0; c < f1_; ++c) a[detail::uz(c)] += xv * w1[idx(h, c, f1_)];
    }
  }
  // The activation output of column c (gated: act(gate) * up).
  T act_out(const std::vector<T>& a, int c) const {
    return is_gated(s_.act) ? activate(s_.act, a[detail::uz(c)]) * a[detail::uz(fs_ + c)]
                            : activate(s_.act, a[detail::uz(c)]);
  }
  // y[r] = h . fc2(l)   [H]
  void fc2_row(int l, const std::vector<T>& h, std::span<T> y, std::size_t r) const {
    const auto w2 = cslice(fc2_, l, fs_ * s_.hidden);
    for (int o = 0; o < s_.hidden; ++o) {
      T s = T(0);
      for (int c = 0; c < fs_; ++c) s += h[detail::uz(c)] * w2[idx(c, o, s_.hidden)];
      y[r * detail::uz(s_.hidden) + detail::uz(o)] = s;
    }
  }

  mlp_shape s_{};
  int fs_ = 0;  // F / ETP
  int f1_ = 0;  // fc1 columns of this shard
  std::vector<T> fc1_, fc2_, g1_, g2_;
  std::vector<T> a_, h_, da_;  // one row's fc1 output, activation, and fc1 gradient
};

}  // namespace v0_1
}  // namespace moefold
