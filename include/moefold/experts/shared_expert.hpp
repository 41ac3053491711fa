//! @file shared_expert.hpp
//! @brief The shared expert on any execution context: a dense MLP every token goes through,
//! sharded over the attention TP group like Megatron-Core's (sequence parallel: gather the
//! sequence over TP, fc1 column-parallel, fc2 row-parallel, reduce-scatter back), with an optional
//! sigmoid gate, out += sigmoid(x . w_g) * mlp(x), w_g of shape [1, H]. One implementation for
//! host_exec, cpu_exec and cuda_exec: the MLP shard is mlp_experts (its GEMMs through the
//! grouped-GEMM seam, the context's default backends), the gate and the sum are the kernels of
//! kernels/shared_gate.hpp, the collectives the communicator's view forms.
//!
//! Sequence parallel: every rank of the TP group forwards the same N (equal shards of the
//! sequence); a rank with another N fails the all-gather's count check.
//!
//! Gradient reduction: the TP-sharded MLP weights see every token of their TP group, so they are
//! summed over the attention data groups (dp-cp); the gate weight is replicated over TP and sees
//! only this rank's tokens, so it is summed over tp-dp-cp (like the router weight).
//!
//! Parameters: made with a context, the shared expert owns zeroed weights and gradients in that
//! context's memory (own() to write them, load_full() on host memory) until bind() points it at a
//! caller's (shared_expert_views, or host spans in shared_expert_params): then it reads the
//! caller's weights and accumulates (beta = 1) into the caller's gradient buffers, and copies
//! nothing. The MLP's layout is the routed experts' (experts/mlp_params.hpp) for one expert with
//! the attention TP as its ETP: fc1 [F1 / TP, H] (gate rows, then up rows), fc2 [H, F / TP].
//!
//! Memory: what a forward keeps for its backward (saved_bytes(): the gathered input, the ungated
//! output, the gates, the MLP's pre-activation) and each call's scratch (scratch_bytes(): dead
//! after the call, shared by forwards in flight) are byte spans of the context's memory the caller
//! gives.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <moefold/kernels/shared_gate.hpp>

#include "../comm/communicator.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"
#include "../exec/gemm_policy.hpp"
#include "mlp_experts.hpp"
#include "mlp_params.hpp"

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

//! One rank's shared-expert parameters in memory space S: the TP shard of its MLP (fc1
//! [F1 / TP, H], fc2 [H, F / TP]), the gate weight [1, H] (empty without a gate) and their
//! gradient buffers (accumulated into), all contiguous.
template <class T, memory_space S = host_space, class G = main_grad_t<T>>
struct shared_expert_views {
  mlp_weight_views<T, S> mlp{};
  mlp_grad_views<G, S> grads{};
  row_view<const T, S> gate{};
  row_view<G, S> gate_grad{};
};

//! The same parameters as host spans (host memory contexts; moe_layer_params holds this form).
template <class T, class Grad = main_grad_t<T>>
struct shared_expert_params {
  mlp_weights<T> mlp{};         //!< fc1 [F1, H], fc2 [H, F/TP]
  mlp_grads<Grad> mlp_grad{};   //!< the same layouts
  std::span<T> gate{};          //!< [H], read only (mutable so the owning form can hand it out)
  std::span<Grad> gate_grad{};  //!< [H]
};

template <class T, execution_context Exec, communicator Comm, class Grad = main_grad_t<T>,
          class Gemms = default_gemms<Exec>>
class shared_expert {
 public:
  using value_type = T;
  using grad_type = Grad;
  using exec_type = Exec;
  using space = typename Exec::memory_space;
  using views_type = shared_expert_views<T, space, Grad>;
  //! The MLP shard: one expert whose rows all have probability 1 (exact in T), on the backends
  //! the policy names for gemm_kind::shared.
  using mlp_type = mlp_experts<T, Exec, shared_gemms<Gemms>, Grad, T>;

  //! The owning form: zeroed weights and gradients in `exec`'s memory (exec outlives it).
  [[nodiscard]] static expected<shared_expert> make(Exec& exec, const shared_expert_shape& s) {
    if (auto st = check_shape(s); !st) return unexpected<error>(st.error());
    const mlp_shape ms = mlp_shape_of(s);
    const auto f1 = static_cast<std::int64_t>(mlp_sizes(ms).fc1) / s.hidden;
    const std::int64_t fs = s.ffn / s.tp, gw = s.gate ? s.hidden : 0;
    shared_expert e;
    e.s_ = s;
    owned& o = e.own_.emplace();
    for (status st : {alloc(exec, o.fc1, f1, s.hidden), alloc(exec, o.fc2, s.hidden, fs),
                      alloc(exec, o.gate, s.gate ? 1 : 0, gw), alloc(exec, o.g1, f1, s.hidden),
                      alloc(exec, o.g2, s.hidden, fs), alloc(exec, o.gg, s.gate ? 1 : 0, gw)})
      if (!st) return unexpected<error>(st.error());
    for (status st : {zero(exec, o.fc1), zero(exec, o.fc2), zero(exec, o.gate), zero(exec, o.g1),
                      zero(exec, o.g2), zero(exec, o.gg)})
      if (!st) return unexpected<error>(st.error());
    const views_type v{.mlp = {o.fc1.cview(), o.fc2.cview()},
                       .grads = {o.g1.view(), o.g2.view()},
                       .gate = o.gate.cview(),
                       .gate_grad = o.gg.view()};
    if (auto st = e.bind_views(v); !st) return unexpected<error>(st.error());
    e.tp_rows_.assign(static_cast<std::size_t>(s.tp), 0);
    return e;
  }
  //! On a caller's parameters from the start (nothing owned).
  [[nodiscard]] static expected<shared_expert> make(const shared_expert_shape& s,
                                                    const views_type& p) {
    if (auto st = check_shape(s); !st) return unexpected<error>(st.error());
    shared_expert e;
    e.s_ = s;
    if (auto st = e.bind_views(p); !st) return unexpected<error>(st.error());
    e.tp_rows_.assign(static_cast<std::size_t>(s.tp), 0);
    return e;
  }

  shared_expert() = default;
  shared_expert(const shared_expert&) = delete;
  shared_expert& operator=(const shared_expert&) = delete;
  shared_expert(shared_expert&&) noexcept = default;
  shared_expert& operator=(shared_expert&&) noexcept = default;
  ~shared_expert() = default;

  [[nodiscard]] const shared_expert_shape& shape() const noexcept { return s_; }
  //! The element counts a caller's buffers need: the MLP's (mlp_sizes); the gate's is H with a
  //! gate, else 0.
  [[nodiscard]] mlp_param_sizes mlp_sizes_needed() const noexcept {
    return mlp_sizes(mlp_shape_of(s_));
  }

  //! Runs on the caller's parameters from now on (checked: shapes; a refused binding changes
  //! nothing); the owned buffers are released.
  [[nodiscard]] status bind(const views_type& p) {
    if (auto st = bind_views(p); !st) return st;
    own_.reset();
    return {};
  }
  //! The same over host spans (host memory contexts).
  [[nodiscard]] status bind(const shared_expert_params<T, Grad>& p) requires
      host_accessible_v<space> {
    const std::size_t gate_n = s_.gate ? detail::uz(s_.hidden) : 0;
    if (p.gate.size() != gate_n || p.gate_grad.size() != gate_n)
      return make_error(errc::shape_mismatch,
                        "shared_expert: the gate weight and its gradient must have " +
                            detail::to_decimal(gate_n) + " elements (H with a gate, else 0)");
    const mlp_param_sizes n = mlp_sizes_needed();
    if (p.mlp.fc1.size() != n.fc1 || p.mlp.fc2.size() != n.fc2 || p.mlp_grad.fc1.size() != n.fc1 ||
        p.mlp_grad.fc2.size() != n.fc2)
      return make_error(errc::shape_mismatch,
                        "shared_expert: the MLP's weights and gradients must hold fc1 = " +
                            detail::to_decimal(n.fc1) + " and fc2 = " + detail::to_decimal(n.fc2) +
                            " elements (one expert's TP shard)");
    const int H = s_.hidden, f1 = static_cast<int>(n.fc1 / detail::uz(H)), fs = s_.ffn / s_.tp;
    const int gr = s_.gate ? 1 : 0, gw = s_.gate ? H : 0;
    return bind(views_type{.mlp = {row_view<const T, space>(p.mlp.fc1.data(), f1, H),
                                   row_view<const T, space>(p.mlp.fc2.data(), H, fs)},
                           .grads = {row_view<Grad, space>(p.mlp_grad.fc1.data(), f1, H),
                                     row_view<Grad, space>(p.mlp_grad.fc2.data(), H, fs)},
                           .gate = row_view<const T, space>(p.gate.data(), gr, gw),
                           .gate_grad = row_view<Grad, space>(p.gate_grad.data(), gr, gw)});
  }
  //! Whether bind() gave it a caller's parameters.
  [[nodiscard]] bool bound() const noexcept { return !own_.has_value(); }

  //! The parameters it runs on (its own or the caller's): what a trainer reduces and steps.
  [[nodiscard]] const views_type& params() const noexcept { return p_; }
  //! The owning form's weights, writable (fc1 [F1, H], fc2 [H, F / TP], gate [1, H]): empty
  //! views after bind().
  struct owned_weights {
    row_view<T, space> fc1{}, fc2{}, gate{};
  };
  [[nodiscard]] owned_weights own() const noexcept {
    if (!own_) return {};
    return {own_->fc1.view(), own_->fc2.view(), own_->gate.view()};
  }
  //! Loads the owning form's TP shard from the full (unsharded) weights in Megatron-Core's (and
  //! Hugging Face's) layout: fc1 [(gated ? 2F : F), H] with rows [gate; up], fc2 [H, F]; and the
  //! gate weight [H] (empty: left as it is).
  [[nodiscard]] status load_full(std::span<const T> full_fc1, std::span<const T> full_fc2,
                                 std::span<const T> gate = {}) requires host_accessible_v<space> {
    if (!own_)
      return make_error(errc::invalid_argument,
                        "shared_expert: load_full writes the owning form's weights; this one "
                        "runs on a caller's (bind)");
    const int H = s_.hidden, F = s_.ffn, G = is_gated(s_.act) ? 2 : 1, Fs = F / s_.tp;
    if (full_fc1.size() != detail::uz(G * F) * detail::uz(H) ||
        full_fc2.size() != detail::uz(H) * detail::uz(F))
      return make_error(errc::shape_mismatch, std::string("shared_expert: full weights must be [") +
                                                  (G == 2 ? "2F" : "F") + ", H] and [H, F]");
    if (!gate.empty() && (!s_.gate || gate.size() != detail::uz(H)))
      return make_error(
          errc::shape_mismatch,
          "shared_expert: a gate weight must be [H], for a shared expert with a gate");
    const auto w1 = own_->fc1.view(), w2 = own_->fc2.view();
    const int c0 = s_.tp_rank * Fs;
    for (int g = 0; g < G; ++g)  // gate shard rows, then up shard rows
      for (int c = 0; c < Fs; ++c)
        for (int h = 0; h < H; ++h) w1(g * Fs + c, h) = full_fc1[at(g * F + c0 + c, h, H)];
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < Fs; ++c) w2(h, c) = full_fc2[at(h, c0 + c, F)];
    if (!gate.empty()) std::copy(gate.begin(), gate.end(), own_->gate.view().flat().begin());
    return {};
  }

  //! Bytes a forward keeps for its backward (the gathered input, the ungated output, the gates,
  //! the MLP's pre-activation [tp N, F1 / TP]):
  //! one such part per forward in flight, in the context's memory.
  [[nodiscard]] std::size_t saved_bytes() const {
    workspace_carver c;
    (void)carve_saved(c, s_.max_tokens);
    return c.required();
  }
  //! Bytes of scratch each call needs (dead after it; forwards in flight may share one).
  [[nodiscard]] std::size_t scratch_bytes() const {
    workspace_carver c;
    (void)carve_scratch(c, s_.max_tokens);
    return c.required();
  }

  //! out [N, H] += gate * mlp(x) for x [N, H] on context `ex`; `tp` is this rank's attention TP
  //! communicator. `saved` (saved_bytes()) must stay intact until this forward's backward;
  //! `scratch` (scratch_bytes()) is free after the call.
  [[nodiscard]] status forward(Exec& ex, row_view<const T, space> x, Comm& tp,
                               row_view<T, space> out, std::span<std::byte> saved,
                               std::span<std::byte> scratch) {
    const int n = x.rows();
    if (auto st = check(n, x, out, tp); !st) return st;
    const auto parts = carve_parts(saved, scratch, n);
    if (!parts) return unexpected<error>(parts.error());
    const auto& [sv, sc] = *parts;
    const int G = s_.tp * n;
    // The sequence gathered over TP [tp N, H] (kept: the MLP's and the gate's backward read it).
    if (s_.tp > 1) {
      if (auto st = ex.copy(x, sc.x_in); !st) return st;
      if (auto st = tp.all_gather(ex, row_view<const T, space>(sc.x_in), sv.xg); !st) return st;
    } else if (auto st = ex.copy(x, sv.xg); !st) {
      return st;
    }
    if (n == 0) return {};
    if (auto st = ex.template fill<T>(sc.ones, T(1)); !st) return st;
    // The MLP shard (a partial sum over TP when tp > 1), reduce-scattered back to [N, H].
    const int rows = G;
    if (auto st = mlp().forward(ex, batch(sv, sc, rows), s_.tp > 1 ? sc.yp : sv.y, sv.mlp, sc.mlp);
        !st)
      return st;
    if (s_.tp > 1)
      if (auto st = tp.reduce_scatter_v(ex, row_view<const T, space>(sc.yp), rows_of(n), sv.y,
                                        reduce_op::sum);
          !st)
        return st;
    const kernels::shared_gate_forward_kernel<T> k{.x = {x.data(), x.stride()},
                                                   .gate = s_.gate ? p_.gate.data() : nullptr,
                                                   .y = {sv.y.data(), sv.y.stride()},
                                                   .num_tokens = n,
                                                   .hidden = s_.hidden,
                                                   .gates = sv.gates.data(),
                                                   .out = {out.data(), out.stride()}};
    return launch(ex, launch_grid{.blocks = capped_blocks<Exec>(n, k.block_threads)}, k);
  }

  //! dx [N, H] += the input gradient from dout [N, H] of the forward that filled `saved` (the
  //! same N); adds the MLP weight gradients (this TP shard's) and the gate's. The forward's steps
  //! reversed: the gate's (dy = gate dout, the gate weight's gradient), an all-gather (the
  //! reduce-scatter's backward), the MLP shard's backward, a reduce-scatter (the all-gather's
  //! backward), the gate's part of dx.
  [[nodiscard]] status backward(Exec& ex, row_view<const T, space> dout, Comm& tp,
                                row_view<T, space> dx, std::span<std::byte> saved,
                                std::span<std::byte> scratch) {
    const int n = dout.rows();
    if (auto st = check(n, dout, dx, tp); !st) return st;
    const auto parts = carve_parts(saved, scratch, n);  // saved is only read
    if (!parts) return unexpected<error>(parts.error());
    const auto& [sv, sc] = *parts;
    if (n == 0) return {};
    const int G = s_.tp * n, H = s_.hidden;
    const kernels::shared_gate_backward_kernel<T> back{.dout = {dout.data(), dout.stride()},
                                                       .y = {sv.y.data(), sv.y.stride()},
                                                       .gates = sv.gates.data(),
                                                       .num_tokens = n,
                                                       .hidden = H,
                                                       .gated = s_.gate,
                                                       .dy = {sc.dy.data(), sc.dy.stride()},
                                                       .dpre = sc.dpre.data()};
    if (auto st =
            launch(ex, launch_grid{.blocks = capped_blocks<Exec>(n, back.block_threads)}, back);
        !st)
      return st;
    if (s_.gate) {
      const auto xmine = sv.xg.subrows(s_.tp_rank * n, n);
      const kernels::shared_gate_weight_grad_kernel<T, Grad> wg{.x = {xmine.data(), xmine.stride()},
                                                                .dpre = sc.dpre.data(),
                                                                .num_tokens = n,
                                                                .hidden = H,
                                                                .grad = p_.gate_grad.data()};
      if (auto st = launch(ex, launch_grid{.blocks = capped_blocks<Exec>(H, wg.block_threads)}, wg);
          !st)
        return st;
    }
    const auto dyg = sc.yp;  // the forward's partial rows are dead by now
    if (s_.tp > 1)
      if (auto st = tp.all_gather(ex, row_view<const T, space>(sc.dy), dyg); !st) return st;
    if (auto st = ex.template fill<T>(sc.ones, T(1)); !st) return st;
    const int rows = G;
    if (auto st = mlp().backward(
            ex, batch(sv, sc, rows),
            s_.tp > 1 ? row_view<const T, space>(dyg) : row_view<const T, space>(sc.dy), sc.dxg,
            sc.dprobs, sv.mlp, sc.mlp);
        !st)
      return st;
    // dx_shared [N, H]: the reduce-scatter of the gathered rows' partials (TP > 1), else them.
    auto dxs = sc.dxg.first(n);
    if (s_.tp > 1) {
      dxs = sc.x_in;
      if (auto st = tp.reduce_scatter_v(ex, row_view<const T, space>(sc.dxg), rows_of(n), dxs,
                                        reduce_op::sum);
          !st)
        return st;
    }
    if (s_.gate) {
      const kernels::shared_gate_dx_kernel<T> k{.dpre = sc.dpre.data(),
                                                .gate = p_.gate.data(),
                                                .num_tokens = n,
                                                .hidden = H,
                                                .dx = {dxs.data(), dxs.stride()}};
      if (auto st = launch(ex,
                           launch_grid{.blocks = capped_blocks<Exec>(static_cast<long long>(n) * H,
                                                                     k.block_threads)},
                           k);
          !st)
        return st;
    }
    return ex.template add<T>(row_view<const T, space>(dxs), dx);
  }

 private:
  using A = accumulator_t<T>;
  static mlp_shape mlp_shape_of(const shared_expert_shape& s) noexcept {
    return {.hidden = s.hidden,
            .ffn = s.ffn,
            .num_local_experts = 1,
            .etp = s.tp,
            .etp_rank = s.tp_rank,
            .act = s.act};
  }
  static status check_shape(const shared_expert_shape& s) {
    if (s.max_tokens < 0)
      return make_error(errc::invalid_size, "shared_expert: max_tokens must be >= 0");
    if (s.tp < 1 || s.tp_rank < 0 || s.tp_rank >= s.tp)
      return make_error(errc::invalid_argument,
                        "shared_expert: tp must be >= 1 and tp_rank in [0, tp)");
    if (static_cast<long long>(s.max_tokens) * s.tp * s.hidden > max_int)
      return make_error(errc::overflow, "shared_expert: max_tokens * tp * hidden exceeds 2^31-1");
    return check_mlp_shape(mlp_shape_of(s), "shared_expert");
  }
  static constexpr std::size_t at(int r, int c, int cols) noexcept {
    return detail::uz(r) * detail::uz(cols) + detail::uz(c);
  }
  template <class U>
  static status alloc(Exec& ex, exec_buffer<U, Exec>& b, std::int64_t rows, std::int64_t width) {
    if (rows == 0) return {};
    auto m = exec_buffer<U, Exec>::make(ex, rows, width);
    if (!m) return unexpected<error>(m.error());
    b = std::move(*m);
    return {};
  }
  template <class U>
  static status zero(Exec& ex, const exec_buffer<U, Exec>& b) {
    return b.view().empty() ? status{} : ex.template fill<U>(b.view(), U(0));
  }
  // The views checked and taken: the MLP shard (mlp_experts checks its shapes), the gate's.
  status bind_views(const views_type& p) {
    const auto vec = [&](const auto& v) {
      return v.rows() == 1 && v.width() == s_.hidden && v.contiguous();
    };
    if (s_.gate ? !(vec(p.gate) && vec(p.gate_grad)) : !(p.gate.empty() && p.gate_grad.empty()))
      return make_error(errc::shape_mismatch,
                        s_.gate ? "shared_expert: the gate weight and its gradient must be "
                                  "contiguous [1, H]"
                                : "shared_expert: a gate weight given to a shared expert without "
                                  "a gate");
    if (mlp_) {
      if (auto st = mlp_->bind(p.mlp, p.grads); !st) return st;
    } else {
      auto m = mlp_type::make(mlp_shape_of(s_), p.mlp, p.grads);
      if (!m) return unexpected<error>(m.error());
      mlp_.emplace(std::move(*m));
    }
    p_ = p;
    return {};
  }
  mlp_type& mlp() noexcept { return *mlp_; }

  struct saved_views {
    row_view<T, space> xg, y;  // [tp N, H] the gathered input, [N, H] the ungated output
    row_view<A, space> gates;  // [1, N] in accumulator_t<T>
    std::span<std::byte> mlp;  // the MLP shard's saved part for tp N rows (its pre-activation)
  };
  struct scratch_views {
    row_view<T, space> x_in, yp, dxg, dy;  // [N, H], [tp N, H] x 2, [N, H]
    row_view<T, space> ones, dprobs;       // [tp N, 1]
    row_view<A, space> dpre;               // [1, N]
    std::span<std::byte> mlp;              // the MLP shard's workspace for tp N rows
  };
  template <class U>
  static row_view<U, space> take(workspace_carver& c, int rows, int width) {
    const std::span<U> s = c.take<U>(detail::uz(rows) * detail::uz(width));
    return row_view<U, space>(s.data(), rows, width);
  }
  saved_views carve_saved(workspace_carver& c, int n) const {
    const int H = s_.hidden, N = s_.max_tokens;
    saved_views v;
    v.xg = take<T>(c, s_.tp * N, H).first(s_.tp * n);
    v.y = take<T>(c, N, H).first(n);
    v.gates = row_view<A, space>(c.take<A>(detail::uz(N)).data(), 1, n);
    v.mlp = c.take<std::byte>(mlp_ ? mlp_->saved_bytes(s_.tp * N) : 0);
    return v;
  }
  scratch_views carve_scratch(workspace_carver& c, int n) const {
    const int H = s_.hidden, N = s_.max_tokens, G = s_.tp * N, g = s_.tp * n;
    scratch_views v;
    v.x_in = take<T>(c, N, H).first(n);
    v.yp = take<T>(c, G, H).first(g);
    v.dxg = take<T>(c, G, H).first(g);
    v.dy = take<T>(c, N, H).first(n);
    v.ones = take<T>(c, G, 1).first(g);
    v.dprobs = take<T>(c, G, 1).first(g);
    v.dpre = row_view<A, space>(c.take<A>(detail::uz(N)).data(), 1, n);
    v.mlp = c.take<std::byte>(mlp_ ? mlp_->workspace_bytes(G) : 0);
    return v;
  }
  // Both parts carved from the caller's buffers for N = n, or the error naming the one too
  // small.
  expected<std::pair<saved_views, scratch_views>> carve_parts(std::span<std::byte> saved,
                                                              std::span<std::byte> scratch,
                                                              int n) const {
    workspace_carver cs(saved), cx(scratch);
    std::pair<saved_views, scratch_views> p{carve_saved(cs, n), carve_scratch(cx, n)};
    if (!cs.fits() || !cx.fits())
      return make_error(errc::workspace_too_small,
                        "shared_expert: saved part smaller than saved_bytes() or scratch smaller "
                        "than scratch_bytes()");
    return p;
  }
  // The gathered rows as one expert's batch of probability 1 (`rows` holds its row count).
  expert_batch<T, T, space> batch(const saved_views& sv, const scratch_views& sc,
                                  const int& rows) const {
    return {.counts = std::span<const int>(&rows, 1),
            .x = row_view<const T, space>(sv.xg),
            .probs = row_view<const T, space>(sc.ones)};
  }
  // Every TP rank's rows for the reduce-scatter (equal shards), in a buffer sized at make.
  std::span<const int> rows_of(int n) {
    std::fill(tp_rows_.begin(), tp_rows_.end(), n);
    return tp_rows_;
  }
  status check(int n, const auto& in, const auto& out, const Comm& tp) const {
    using detail::to_decimal;
    if (tp.size() != s_.tp)
      return make_error(errc::shape_mismatch, "shared_expert: the TP communicator has " +
                                                  to_decimal(tp.size()) + " ranks, the shape " +
                                                  to_decimal(s_.tp));
    if (n < 0 || n > s_.max_tokens)
      return make_error(errc::invalid_size,
                        "shared_expert: N = " + to_decimal(n) + " outside [0, max_tokens]");
    if (in.width() != s_.hidden || out.rows() != n || out.width() != s_.hidden)
      return make_error(errc::shape_mismatch,
                        "shared_expert: the input and output must both be [N, H]");
    return {};
  }

  // The owning form's buffers (none after bind()).
  struct owned {
    exec_buffer<T, Exec> fc1, fc2, gate;
    exec_buffer<Grad, Exec> g1, g2, gg;
  };
  shared_expert_shape s_{};
  std::optional<owned> own_{};
  views_type p_{};                 // the parameters it runs on
  std::optional<mlp_type> mlp_{};  // the MLP shard over p_.mlp and p_.grads
  std::vector<int> tp_rows_;       // [tp] the reduce-scatter's rows
};

}  // namespace v0_1
}  // namespace moefold
