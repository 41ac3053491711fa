//! @file grouped_mlp.hpp
//! @brief moefold's reference experts on the CPU over caller-owned parameters: per local expert
//! an MLP fc1 -> activation (-> * prob) -> fc2 on weights the caller owns (FSDP, a distributed
//! optimizer, a checkpoint loader), writing the weight gradients into gradient buffers the caller
//! owns (accumulating, beta = 1, in their own element type: fp32 main_grad for bf16 weights).
//! Nothing parameter-sized is held or copied: the functor is a view plus one row of scratch.
//!
//! Layouts: experts/mlp_params.hpp (Megatron-Core's TEGroupedMLP per local expert). Under ETP,
//! fc1 is column-parallel and fc2 row-parallel, so each ETP rank's output is a partial sum that
//! the dispatcher's ReduceScatter completes.
//!
//! Arithmetic: sums and activations in accumulator_t<T> (fp32 for bf16/fp16), outputs rounded to T
//! once; in that type the sums run over h, then c, in index order (so any two functors over equal
//! weights agree bitwise, whichever owns them).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "activation.hpp"
#include "expert_fn.hpp"
#include "mlp_params.hpp"

namespace moefold {
inline namespace v0_1 {

//! The expert functor over views. `T` is the element type of the weights and the rows, `G` the
//! gradients', `P` the probabilities' (T, or fp32 with bf16 rows as an fp32 router gives them:
//! the product act * p is then taken in fp32 and rounded once, and dprobs is written in P). The
//! arithmetic is accumulator_t<T>: a P wider than that (fp64 with fp32 rows) is narrowed to it.
template <class T, class G = main_grad_t<T>, class P = T>
class grouped_mlp {
 public:
  using value_type = T;
  using grad_type = G;
  using prob_type = P;

  //! Checks the shape (sizes >= 1, ETP divides F) and that the views hold exactly
  //! mlp_sizes(s) elements each.
  [[nodiscard]] static expected<grouped_mlp> make(const mlp_shape& s, mlp_weights<T> w,
                                                  mlp_grads<G> g) {
    if (auto st = check_shape(s, "grouped_mlp"); !st) return unexpected<error>(st.error());
    grouped_mlp m;
    m.s_ = s;
    m.fs_ = s.ffn / s.etp;
    m.f1_ = (is_gated(s.act) ? 2 : 1) * m.fs_;
    if (auto st = m.bind(w, g); !st) return unexpected<error>(st.error());
    m.a_.resize(detail::uz(m.f1_));
    m.h_.resize(detail::uz(m.fs_));
    m.da_.resize(detail::uz(m.f1_));
    return m;
  }

  //! The shape rules every MLP of moefold checks, in one place.
  [[nodiscard]] static status check_shape(const mlp_shape& s, const char* who) {
    using detail::to_decimal;
    if (s.hidden < 1 || s.ffn < 1 || s.num_local_experts < 0 || s.etp < 1)
      return make_error(errc::invalid_size, std::string(who) +
                                                ": hidden, ffn and etp must be >= 1 and "
                                                "num_local_experts >= 0");
    if (s.ffn % s.etp != 0)
      return make_error(errc::invalid_argument,
                        std::string(who) + ": ffn = " + to_decimal(s.ffn) +
                            " is not divisible by etp = " + to_decimal(s.etp) +
                            " (each ETP rank holds ffn / etp rows of fc1 and columns of fc2)");
    if (s.etp_rank < 0 || s.etp_rank >= s.etp)
      return make_error(errc::rank_out_of_range, std::string(who) + ": etp_rank outside [0, etp)");
    return {};
  }

  //! Points the functor at other buffers of the same shape (a trainer that swaps parameter
  //! storage, e.g. after an FSDP gather into a new buffer). Checked; a refused binding keeps the
  //! old one.
  [[nodiscard]] status bind(mlp_weights<T> w, mlp_grads<G> g) {
    const mlp_param_sizes n = mlp_sizes(s_);
    if (w.fc1.size() != n.fc1 || w.fc2.size() != n.fc2 || g.fc1.size() != n.fc1 ||
        g.fc2.size() != n.fc2)
      return make_error(
          errc::shape_mismatch,
          "grouped_mlp: weights and gradients must hold fc1 [L, F1, H] = " +
              detail::to_decimal(n.fc1) + " and fc2 [L, H, F/ETP] = " + detail::to_decimal(n.fc2) +
              " elements; got " + detail::to_decimal(w.fc1.size()) + ", " +
              detail::to_decimal(w.fc2.size()) + " and gradients " +
              detail::to_decimal(g.fc1.size()) + ", " + detail::to_decimal(g.fc2.size()));
    w_ = w;
    g_ = g;
    return {};
  }

  [[nodiscard]] int num_local_experts() const noexcept { return s_.num_local_experts; }
  [[nodiscard]] int hidden() const noexcept { return s_.hidden; }
  [[nodiscard]] const mlp_shape& shape() const noexcept { return s_; }
  [[nodiscard]] const mlp_weights<T>& weights() const noexcept { return w_; }
  [[nodiscard]] const mlp_grads<G>& grads() const noexcept { return g_; }

  //! y = fc2(act(fc1 x) * p) for every row of the batch (a partial sum under ETP).  [M,H]->[M,H]
  //! Not const: it works in the functor's own row scratch (no allocation per call).
  [[nodiscard]] status forward(const expert_batch<T, P>& b, std::span<T> y) {
    const std::size_t outs_h[] = {y.size()};
    if (auto st = check_expert_batch(b, s_.num_local_experts, s_.hidden, outs_h, {}); !st)
      return st;
    for_each_row(b, [&](int l, std::size_t r) {
      fc1_row(l, b, r);
      const A p = prob(b, r);
      for (int c = 0; c < fs_; ++c) h_[detail::uz(c)] = act_out(c) * p;
      fc2_row(l, y, r);
    });
    return {};
  }

  //! From dy [M,H]: dx [M,H], dprobs [M] (ETP partials), and += the weight gradients. Recomputes
  //! the activations from x (a reference, not a memory-saving design).
  [[nodiscard]] status backward(const expert_batch<T, P>& b, std::span<const T> dy, std::span<T> dx,
                                std::span<P> dprobs) {
    const std::size_t outs_h[] = {dy.size(), dx.size()};
    const std::size_t outs[] = {dprobs.size()};
    if (auto st = check_expert_batch(b, s_.num_local_experts, s_.hidden, outs_h, outs); !st)
      return st;
    const int H = s_.hidden;
    for_each_row(b, [&](int l, std::size_t r) {
      fc1_row(l, b, r);
      const auto w1 = expert(w_.fc1, l, f1_ * H);  // [F1, H]
      const auto w2 = expert(w_.fc2, l, H * fs_);  // [H, Fs]
      const auto g1 = expert(g_.fc1, l, f1_ * H);
      const auto g2 = expert(g_.fc2, l, H * fs_);
      const A p = prob(b, r);
      A dp = A(0);
      for (int c = 0; c < fs_; ++c) {
        // dh = dy . fc2 (column c); fc2 grad [h, c] += (act * p) dy[h].
        A s = A(0);
        const A out = act_out(c);
        for (int h = 0; h < H; ++h) {
          const A g = detail::widen(dy[r * detail::uz(H) + detail::uz(h)]);
          s += g * detail::widen(w2[idx(h, c, fs_)]);
          g2[idx(h, c, fs_)] += static_cast<G>(out * p * g);
        }
        dp += out * s;
        const A d = p * s;  // gradient at act_out
        if (is_gated(s_.act)) {
          const A gate = a_[detail::uz(c)], up = a_[detail::uz(fs_ + c)];
          da_[detail::uz(c)] = d * up * activate_derivative(s_.act, gate);
          da_[detail::uz(fs_ + c)] = d * activate(s_.act, gate);
        } else {
          da_[detail::uz(c)] = d * activate_derivative(s_.act, a_[detail::uz(c)]);
        }
      }
      dprobs[r] = static_cast<P>(dp);
      for (int h = 0; h < H; ++h) {
        const A xv = detail::widen(b.x[r * detail::uz(H) + detail::uz(h)]);
        A s = A(0);
        for (int c = 0; c < f1_; ++c) {
          s += da_[detail::uz(c)] * detail::widen(w1[idx(c, h, H)]);
          g1[idx(c, h, H)] += static_cast<G>(xv * da_[detail::uz(c)]);
        }
        dx[r * detail::uz(H) + detail::uz(h)] = detail::narrow<T>(s);
      }
    });
    return {};
  }

 private:
  using A = accumulator_t<T>;

  static constexpr std::size_t idx(int r, int c, int cols) noexcept {
    return detail::uz(r) * detail::uz(cols) + detail::uz(c);
  }
  template <class U>
  static std::span<U> expert(std::span<U> v, int l, int n) noexcept {
    return v.subspan(detail::uz(l) * detail::uz(n), detail::uz(n));
  }
  // The probability of row r in the arithmetic type.
  static A prob(const expert_batch<T, P>& b, std::size_t r) noexcept {
    return static_cast<A>(detail::widen(b.probs[r]));
  }
  // Calls f(local expert, row) for every row, experts in order.
  template <class F>
  static void for_each_row(const expert_batch<T, P>& b, F&& f) {
    std::size_t r = 0;
    for (std::size_t l = 0; l < b.counts.size(); ++l)
      for (int i = 0; i < b.counts[l]; ++i) f(static_cast<int>(l), r++);
  }
  // a_ = fc1(l) x[r]   [F1]
  void fc1_row(int l, const expert_batch<T, P>& b, std::size_t r) {
    const int H = s_.hidden;
    const auto w1 = expert(w_.fc1, l, f1_ * H);
    for (auto& v : a_) v = A(0);
    for (int h = 0; h < H; ++h) {
      const A xv = detail::widen(b.x[r * detail::uz(H) + detail::uz(h)]);
      for (int c = 0; c < f1_; ++c) a_[detail::uz(c)] += xv * detail::widen(w1[idx(c, h, H)]);
    }
  }
  // The activation output of column c (gated: act(gate) * up).
  A act_out(int c) const {
    return is_gated(s_.act) ? activate(s_.act, a_[detail::uz(c)]) * a_[detail::uz(fs_ + c)]
                            : activate(s_.act, a_[detail::uz(c)]);
  }
  // y[r] = fc2(l) h_   [H]
  void fc2_row(int l, std::span<T> y, std::size_t r) const {
    const int H = s_.hidden;
    const auto w2 = expert(w_.fc2, l, H * fs_);
    for (int o = 0; o < H; ++o) {
      A s = A(0);
      for (int c = 0; c < fs_; ++c) s += h_[detail::uz(c)] * detail::widen(w2[idx(o, c, fs_)]);
      y[r * detail::uz(H) + detail::uz(o)] = detail::narrow<T>(s);
    }
  }

  mlp_shape s_{};
  int fs_ = 0;  // F / ETP
  int f1_ = 0;  // fc1 rows of this shard
  mlp_weights<T> w_{};
  mlp_grads<G> g_{};
  std::vector<A> a_, h_, da_;  // one row's fc1 output, activation, and fc1 gradient
};

}  // namespace v0_1
}  // namespace moefold
