//! @file shared_expert.hpp
//! @brief The shared expert (host path): a dense MLP every token goes through, sharded over the
//! attention TP group like Megatron-Core's (sequence parallel: gather the sequence over TP, fc1
//! column-parallel, fc2 row-parallel, reduce-scatter back), with an optional sigmoid gate
//! out = sigmoid(x . w_g) * mlp(x), w_g of shape [H].
//!
//! Gradient reduction: the TP-sharded MLP weights see every token of their TP group, so they are
//! summed over the attention data groups (dp-cp); the gate weight is replicated over TP and sees
//! only this rank's tokens, so it is summed over tp-dp-cp (like the router weight).
//!
//! Parameters: the shared expert owns its weights and gradients (mlp(), gate_weight(),
//! gate_grad()) until bind() points it at a caller's (shared_expert_params): then it reads the
//! caller's weights and accumulates (beta = 1) into the caller's gradient buffers, and copies
//! nothing. The MLP's layout is the routed experts' (experts/mlp_params.hpp) for one expert with
//! the attention TP as its ETP: fc1 [2F/TP, H] (gate rows, then up rows), fc2 [H, F/TP].
//!
//! The MLP shard is mlp_experts<T, host_exec> (one expert, the gathered rows with probability 1):
//! its GEMMs go through the grouped-GEMM seam (gemm_kind::expert and expert_wgrad of host_gemms)
//! on the context each call passes (the layer's), its scratch is part of this object's scratch
//! part (scratch_bytes()).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/host_exec.hpp"
#include "mlp_experts.hpp"
#include "mlp_params.hpp"
#include "reference_mlp.hpp"

namespace moefold {
inline namespace v0_1 {

struct shared_expert_shape {
  int max_tokens = 0;  //!< upper bound of N on every rank of the TP group
  int hidden = 0;      //!< H
  int ffn = 0;         //!< F, the full shared-expert FFN size
  int tp = 1;          //!< attention TP
  int tp_rank = 0;     //!< this rank's index in the TP group
  activation act = activation::swiglu;
  bool gate = false;  //!< multiply by sigmoid(x . w_g)
};

//! A caller's parameters of one rank's shared expert: the TP shard of its MLP, the gate weight
//! [H] (empty without a gate) and their gradient buffers, accumulated into.
template <class T, class Grad = main_grad_t<T>>
struct shared_expert_params {
  mlp_weights<T> mlp{};         //!< fc1 [F1, H], fc2 [H, F/TP]
  mlp_grads<Grad> mlp_grad{};   //!< the same layouts
  std::span<T> gate{};          //!< [H], read only (mutable so the owning form can hand it out)
  std::span<Grad> gate_grad{};  //!< [H]
};

template <class T, communicator Comm, class Grad = main_grad_t<T>>
class shared_expert {
 public:
  using value_type = T;
  using grad_type = Grad;

  [[nodiscard]] static expected<shared_expert> make(const shared_expert_shape& s) {
    if (s.max_tokens < 0)
      return make_error(errc::invalid_size, "shared_expert: max_tokens must be >= 0");
    if (static_cast<long long>(s.max_tokens) * s.tp * s.hidden > max_int)
      return make_error(errc::overflow, "shared_expert: max_tokens * tp * hidden exceeds 2^31-1");
    auto mlp = reference_mlp<T, Grad>::make(mlp_shape_of(s));
    if (!mlp) return unexpected<error>(mlp.error());
    shared_expert e;
    e.s_ = s;
    e.own_mlp_ = std::move(*mlp);
    e.own_gate_w_.assign(static_cast<std::size_t>(s.hidden), T(0));
    e.own_gate_g_.assign(static_cast<std::size_t>(s.hidden), Grad(0));
    e.gate_w_ = e.own_gate_w_;
    e.gate_g_ = e.own_gate_g_;
    return e;
  }

  // Views point into this object's own buffers (whose storage a move keeps): no copies.
  shared_expert() = default;
  shared_expert(const shared_expert&) = delete;
  shared_expert& operator=(const shared_expert&) = delete;
  shared_expert(shared_expert&&) noexcept = default;
  shared_expert& operator=(shared_expert&&) noexcept = default;
  ~shared_expert() = default;

  //! The element counts a caller's buffers need: the MLP's (mlp_sizes) and the gate's (H, or 0
  //! without a gate).
  [[nodiscard]] mlp_param_sizes mlp_sizes_needed() const noexcept {
    return mlp_sizes(mlp_shape_of(s_));
  }

  //! Runs on the caller's parameters from now on (checked: sizes; a refused binding changes
  //! nothing); the owning buffers are released.
  [[nodiscard]] status bind(const shared_expert_params<T, Grad>& p) {
    const std::size_t gate_n = s_.gate ? detail::uz(s_.hidden) : 0;
    if (p.gate.size() != gate_n || p.gate_grad.size() != gate_n)
      return make_error(errc::shape_mismatch,
                        "shared_expert: the gate weight and its gradient must have " +
                            detail::to_decimal(gate_n) + " elements (H with a gate, else 0)");
    auto v = mlp_type::make(mlp_shape_of(s_), p.mlp, p.mlp_grad);
    if (!v) return unexpected<error>(v.error());
    bound_.emplace(std::move(*v));
    gate_w_ = p.gate;
    gate_g_ = p.gate_grad;
    own_mlp_ = reference_mlp<T, Grad>{};
    own_gate_w_ = {};
    own_gate_g_ = {};
    return {};
  }
  //! Whether bind() gave it a caller's parameters.
  [[nodiscard]] bool bound() const noexcept { return bound_.has_value(); }

  //! The owning form's TP shard of the MLP (load it with mlp().load_full(0, fc1, fc2)); empty
  //! after bind().
  [[nodiscard]] reference_mlp<T, Grad>& mlp() noexcept { return own_mlp_; }
  //! The gate weight [H] and its gradient (the caller's after bind(); unused without a gate).
  [[nodiscard]] std::span<T> gate_weight() noexcept { return gate_w_; }
  [[nodiscard]] std::span<Grad> gate_grad() noexcept { return gate_g_; }
  //! The MLP's gradient buffers, whoever owns them (for the reduction over dp-cp).
  [[nodiscard]] mlp_grads<Grad> mlp_grad() noexcept {
    const auto& g = functor().grads();
    return {g.fc1.flat(), g.fc2.flat()};
  }

  //! Bytes a forward keeps for its backward (the gathered input, the ungated output, the gates,
  //! the TP group's token counts): one such part per forward in flight.
  [[nodiscard]] std::size_t saved_bytes() const {
    workspace_carver c;
    (void)carve_saved(c);
    return c.required();
  }
  //! Bytes of scratch each call needs (dead after it; forwards in flight may share one).
  [[nodiscard]] std::size_t scratch_bytes() const {
    workspace_carver c;
    (void)carve_scratch(c);
    return c.required();
  }
  //! Bytes of the one-buffer form: its saved part, then its scratch part.
  [[nodiscard]] std::size_t workspace_bytes() const { return saved_bytes() + scratch_bytes(); }

  //! out [N, H] = gate * mlp(x) for x [N, H] on context `ex`; `tp` is this rank's attention TP
  //! communicator.
  //! `saved` (saved_bytes()) must stay intact until this forward's backward; `scratch`
  //! (scratch_bytes()) is free after the call.
  [[nodiscard]] status forward(host_exec& ex, int n, std::span<const T> x, Comm& tp,
                               std::span<T> out, std::span<std::byte> saved,
                               std::span<std::byte> scratch) {
    if (auto st = check(n, x.size(), out.size(), tp); !st) return st;
    const auto parts = carve_parts(saved, scratch);
    if (!parts) return unexpected<error>(parts.error());
    const auto& [sv, sc] = *parts;
    const auto H = detail::uz(s_.hidden);
    if (auto st = tp.template all_gather<int>(std::span<const int>(&n, 1), sv.tokens); !st)
      return st;
    const int gathered = gathered_of(sv);
    const auto G = detail::uz(gathered);
    auto xg = sv.x_gathered.first(G * H);
    if (auto st = tp.template all_gather_v<T>(x, xg, elements(sv, sc, s_.hidden)); !st) return st;
    auto yp = sc.y_partial.first(G * H);
    int count = gathered;
    if (auto st = functor().forward(ex, batch(sv, sc, count), rows_of(yp, s_.hidden), sc.mlp); !st)
      return st;
    auto y = sv.y.first(detail::uz(n) * H);  // the ungated output, kept for the gate's gradient
    if (auto st = tp.template reduce_scatter_v<T>(std::span<const T>(yp),
                                                  elements(sv, sc, s_.hidden), y, reduce_op::sum);
        !st)
      return st;
    for (std::size_t t = 0; t < detail::uz(n); ++t) {
      const T g = s_.gate ? sigmoid(t, x) : T(1);
      sv.gates[t] = g;
      for (std::size_t h = 0; h < H; ++h)
        out[t * H + h] = detail::narrow<T>(w(g) * w(y[t * H + h]));
    }
    return {};
  }

  //! dx [N, H] from dout [N, H] of the forward that filled `saved`; adds the MLP weight gradients
  //! (this TP shard's) and the gate's.
  [[nodiscard]] status backward(host_exec& ex, std::span<const T> dout, Comm& tp, std::span<T> dx,
                                std::span<std::byte> saved, std::span<std::byte> scratch) {
    const auto parts = carve_parts(saved, scratch);  // saved is only read
    if (!parts) return unexpected<error>(parts.error());
    const auto& [sv, sc] = *parts;
    if (tp.size() != s_.tp)
      return make_error(errc::shape_mismatch, "shared_expert: the TP communicator has " +
                                                  detail::to_decimal(tp.size()) +
                                                  " ranks, the shape " + detail::to_decimal(s_.tp));
    // This rank's token count and its rows inside the gathered input, from the saved counts.
    const int n = sv.tokens[detail::uz(tp.rank())];
    if (auto st = check(n, dout.size(), dx.size(), tp); !st) return st;
    const int gathered = gathered_of(sv);
    std::size_t mine = 0;
    for (int r = 0; r < tp.rank(); ++r) mine += detail::uz(sv.tokens[detail::uz(r)]);
    const auto H = detail::uz(s_.hidden), N = detail::uz(n), G = detail::uz(gathered);
    auto dy = sc.y_partial.first(N * H);  // gradient at the ungated output
    for (std::size_t t = 0; t < N; ++t) {
      const A g = w(sv.gates[t]);
      A dg = A(0);
      for (std::size_t h = 0; h < H; ++h) {
        dy[t * H + h] = detail::narrow<T>(g * w(dout[t * H + h]));
        dg += w(dout[t * H + h]) * w(sv.y[t * H + h]);
      }
      if (s_.gate) {
        const A dpre = dg * g * (A(1) - g);
        for (std::size_t h = 0; h < H; ++h)
          gate_g_[h] += static_cast<Grad>(dpre * w(sv.x_gathered[(mine + t) * H + h]));
        sc.gate_dpre[t] = detail::narrow<T>(dpre);
      }
    }
    // Reduce-scatter backward = all-gather; then the shard's backward; then the all-gather's
    // backward = reduce-scatter (sums the column-parallel partials of dx).
    auto dyg = sc.dy_gathered.first(G * H);
    if (auto st =
            tp.template all_gather_v<T>(std::span<const T>(dy), dyg, elements(sv, sc, s_.hidden));
        !st)
      return st;
    auto dxg = sc.dx_gathered.first(G * H);
    auto dprobs = sc.dprobs.first(G);
    int count = gathered;
    if (auto st = functor().backward(ex, batch(sv, sc, count), rows_of(dyg, s_.hidden),
                                     rows_of(dxg, s_.hidden), rows_of(dprobs, 1), sc.mlp);
        !st)
      return st;
    if (auto st = tp.template reduce_scatter_v<T>(std::span<const T>(dxg),
                                                  elements(sv, sc, s_.hidden), dx, reduce_op::sum);
        !st)
      return st;
    if (s_.gate)
      for (std::size_t t = 0; t < N; ++t)
        for (std::size_t h = 0; h < H; ++h)
          dx[t * H + h] = detail::narrow<T>(w(dx[t * H + h]) + w(sc.gate_dpre[t]) * w(gate_w_[h]));
    return {};
  }

  //! The one-buffer form: `workspace` (workspace_bytes()) holds the saved part, then the
  //! scratch; it must stay intact until the backward, which then takes the last forward's.
  [[nodiscard]] status forward(host_exec& ex, int n, std::span<const T> x, Comm& tp,
                               std::span<T> out, std::span<std::byte> workspace) {
    last_ws_ = {};
    const std::size_t sb = saved_bytes();
    if (workspace.size() < workspace_bytes())
      return make_error(errc::workspace_too_small,
                        "shared_expert: workspace smaller than "
                        "workspace_bytes()");
    if (auto st = forward(ex, n, x, tp, out, workspace.first(sb), workspace.subspan(sb)); !st)
      return st;
    last_ws_ = workspace;
    return {};
  }
  //! dx [N, H] from dout [N, H] of the last one-buffer forward (its workspace must be intact).
  [[nodiscard]] status backward(host_exec& ex, std::span<const T> dout, Comm& tp, std::span<T> dx) {
    if (last_ws_.empty())
      return make_error(errc::invalid_argument, "shared_expert: backward before forward");
    const std::size_t sb = saved_bytes();
    return backward(ex, dout, tp, dx, last_ws_.first(sb), last_ws_.subspan(sb));
  }

 private:
  static mlp_shape mlp_shape_of(const shared_expert_shape& s) noexcept {
    return {.hidden = s.hidden,
            .ffn = s.ffn,
            .num_local_experts = 1,
            .etp = s.tp,
            .etp_rank = s.tp_rank,
            .act = s.act};
  }
  using mlp_type = mlp_experts<T, host_exec, host_gemms, Grad>;
  mlp_type& functor() noexcept { return bound_ ? *bound_ : own_mlp_.view(); }
  // A span of rows of `width` values as a host row view.
  template <class U>
  static row_view<U> rows_of(std::span<U> v, int width) noexcept {
    return row_view<U>(v.data(), static_cast<int>(v.size() / detail::uz(width)), width);
  }

  struct saved_buffers {
    std::span<int> tokens;  // [TP] every TP rank's N
    std::span<T> x_gathered, y, gates;
  };
  struct scratch_buffers {
    std::span<int> counts;
    std::span<T> y_partial, gate_dpre, ones, dy_gathered, dx_gathered, dprobs;
    std::span<std::byte> mlp;  // the MLP shard's workspace, for the TP group's rows
  };

  saved_buffers carve_saved(workspace_carver& c) const {
    saved_buffers b;
    const auto P = detail::uz(s_.tp), N = detail::uz(s_.max_tokens), H = detail::uz(s_.hidden);
    b.tokens = c.take<int>(P);
    b.x_gathered = c.take<T>(P * N * H);
    b.y = c.take<T>(N * H);
    b.gates = c.take<T>(N);
    return b;
  }
  scratch_buffers carve_scratch(workspace_carver& c) const {
    scratch_buffers b;
    const auto P = detail::uz(s_.tp), N = detail::uz(s_.max_tokens), H = detail::uz(s_.hidden);
    b.counts = c.take<int>(P);
    b.y_partial = c.take<T>(P * N * H);
    b.gate_dpre = c.take<T>(N);
    b.ones = c.take<T>(P * N);
    b.dy_gathered = c.take<T>(P * N * H);
    b.dx_gathered = c.take<T>(P * N * H);
    b.dprobs = c.take<T>(P * N);
    b.mlp = c.take<std::byte>(mlp_workspace_bytes());
    return b;
  }
  // Both parts carved from the caller's buffers, or the error naming the one too small.
  expected<std::pair<saved_buffers, scratch_buffers>> carve_parts(
      std::span<std::byte> saved, std::span<std::byte> scratch) const {
    workspace_carver cs(saved), cx(scratch);
    std::pair<saved_buffers, scratch_buffers> p{carve_saved(cs), carve_scratch(cx)};
    if (!cs.fits() || !cx.fits())
      return make_error(errc::workspace_too_small,
                        "shared_expert: saved part smaller than saved_bytes() or scratch smaller "
                        "than scratch_bytes()");
    return p;
  }
  static int gathered_of(const saved_buffers& sv) {
    long long total = 0;
    for (int v : sv.tokens) total += v;
    return static_cast<int>(total);
  }
  // The gathered rows as one expert's batch of probability 1 (`count` holds its row count).
  expert_batch<T> batch(const saved_buffers& sv, const scratch_buffers& sc,
                        const int& count) const {
    const auto G = detail::uz(count);
    for (auto& v : sc.ones.first(G)) v = T(1);
    const expert_batch<T> b{.counts = std::span<const int>(&count, 1),
                            .x = row_view<const T>(sv.x_gathered.data(), count, s_.hidden),
                            .probs = row_view<const T>(sc.ones.data(), count, 1)};
    return b;
  }
  // The MLP shard's workspace for the most rows it sees (tp max_tokens), whoever owns its
  // parameters (the same shape either way).
  std::size_t mlp_workspace_bytes() const {
    return own_or_bound_workspace(static_cast<int>(static_cast<long long>(s_.tp) * s_.max_tokens));
  }
  std::size_t own_or_bound_workspace(int rows) const {
    return bound_ ? bound_->workspace_bytes(rows) : own_mlp_.workspace_bytes(rows);
  }
  static std::span<const int> elements(const saved_buffers& sv, const scratch_buffers& sc,
                                       int width) {
    for (std::size_t i = 0; i < sv.tokens.size(); ++i) sc.counts[i] = sv.tokens[i] * width;
    return sc.counts;
  }
  // 16-bit values compute in fp32 (accumulator_t), rounded once where they are stored.
  using A = accumulator_t<T>;
  static A w(const T& v) noexcept { return detail::widen(v); }
  T sigmoid(std::size_t t, std::span<const T> x) const {
    A z = A(0);
    for (std::size_t h = 0; h < detail::uz(s_.hidden); ++h)
      z += w(x[t * detail::uz(s_.hidden) + h]) * w(gate_w_[h]);
    return detail::narrow<T>(A(1) / (A(1) + std::exp(-z)));
  }
  status check(int n, std::size_t in, std::size_t out, const Comm& tp) const {
    using detail::to_decimal;
    if (tp.size() != s_.tp)
      return make_error(errc::shape_mismatch, "shared_expert: the TP communicator has " +
                                                  to_decimal(tp.size()) + " ranks, the shape " +
                                                  to_decimal(s_.tp));
    if (n < 0 || n > s_.max_tokens)
      return make_error(errc::invalid_size,
                        "shared_expert: N = " + to_decimal(n) + " outside [0, max_tokens]");
    const auto want = detail::uz(n) * detail::uz(s_.hidden);
    if (in != want || out != want)
      return make_error(errc::shape_mismatch, "shared_expert: buffers must be [N, H]");
    return {};
  }

  shared_expert_shape s_{};
  reference_mlp<T, Grad> own_mlp_{};  // the owning form's parameters
  std::vector<T> own_gate_w_;
  std::vector<Grad> own_gate_g_;
  std::optional<mlp_type> bound_{};  // the caller's MLP parameters after bind()
  std::span<T> gate_w_{};            // [H] the own or the caller's
  std::span<Grad> gate_g_{};
  std::span<std::byte> last_ws_{};  // the one-buffer form's last forward
};

}  // namespace v0_1
}  // namespace moefold
