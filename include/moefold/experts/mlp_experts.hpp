//! @file mlp_experts.hpp
//! @brief moefold's routed experts, one object for every execution context: per local expert an
//! MLP fc1 -> activation -> * prob -> fc2 (Megatron-Core's TEGroupedMLP, experts/mlp_params.hpp)
//! on weights the caller owns (FSDP, a distributed optimizer, a checkpoint loader), adding the
//! weight gradients into gradient buffers the caller owns (beta = 1, fp32 main gradients for bf16
//! weights). Under ETP, fc1 is column-parallel and fc2 row-parallel, so each ETP rank's output is
//! a partial sum that the dispatcher's ReduceScatter completes.
//!
//! Every GEMM goes through the grouped-GEMM seam (exec/grouped_gemm.hpp) with the backend the
//! Gemms policy names (exec/gemm_policy.hpp): gemm_kind::expert for fc1 and fc2 forward and their
//! data gradients (grouped by M), gemm_kind::expert_wgrad for the weight gradients (grouped by K,
//! accumulate into G), gemm_mode::dropless. By default host_exec runs host_gemm, cpu_exec and
//! cuda_exec the SIMT kernel; a cuBLAS or CUTLASS backend is a policy, not a change here. The
//! activations are the kernel bodies of kernels/activation.hpp on the context (every activation
//! of core/activation.hpp).
//!
//! The context, the saved storage and the workspace come with each call (saved_bytes(rows) and
//! workspace_bytes(rows) size them, in the context's memory): the object holds only views of the
//! caller's parameters and the shape, so nothing is allocated after make() and two forwards in
//! flight on two streams share nothing.
//!
//! Saved for the backward: fc1's output, the pre-activation a [M, F1] in T, which the forward
//! writes into `saved` and its backward reads (Megatron-Core's TEGroupedMLP keeps it too), so the
//! backward runs four GEMMs, not five. With mlp_experts_options::recompute_fc1 nothing is saved
//! (saved_bytes is 0) and the backward runs fc1 again from x: M F1 values less per forward in
//! flight for one more GEMM. The activation's output is recomputed from a in either case (the
//! activation's backward kernel writes it on the way, for fc2's weight gradient).
//! The one exception is the host copy of the row ranges (L + 1 integers, sized at make), which a
//! call fills before it enqueues anything and no enqueued work reads.
//!
//! Arithmetic: fc1's output, the activation and their gradients in T (bf16 intermediates, as
//! Megatron-Core's TEGroupedMLP keeps them, and what the tensor-core GEMMs take as operands); each
//! GEMM as its backend sums in fp32 (simt_gemm: one fma chain over k in ascending order, the bits
//! of the GPU; host_gemm: a plain chain in the same order; cuBLAS and CUTLASS: their tensor-core
//! order); the activation in double rounded once. An empty expert adds nothing to its weight
//! gradients (the seam's rule for an empty group of K).
//!
//! GEMM modes: when the host counts give every expert the same rows (pad mode, where each holds
//! the capacity), the GEMMs run on the policy's gemm_mode::pad backends (one strided batch),
//! otherwise on its gemm_mode::dropless ones.
//! Host <-> device traffic per call: none but the GEMM backends' own (simt_gemm copies the row
//! ranges, L + 1 integers, to the context per GEMM when the batch brings host counts; nothing
//! when it brings device offsets), nothing read back.
//!
//! Shapes: x, y, dy, dx [M, H] (any row stride); probs, dprobs [M, 1] contiguous; weights and
//! gradients fc1 [L F1, H], fc2 [L H, F / ETP] contiguous; counts [L] on the host, or offsets
//! [1, L + 1] on the context (dispatch/expert_batch.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <moefold/kernels/activation.hpp>
#include <moefold/kernels/grouped_gemm.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/exec.hpp"
#include "../exec/gemm_notice.hpp"
#include "../exec/gemm_policy.hpp"
#include "../exec/grouped_gemm.hpp"
#include "expert_fn.hpp"
#include "mlp_params.hpp"

namespace moefold {
inline namespace v0_1 {

//! What mlp_experts keeps for its backward.
struct mlp_experts_options {
  //! Recompute fc1 in the backward instead of saving its output [M, F1] from the forward.
  bool recompute_fc1 = false;
};

//! The experts of one rank on context Exec. `T` is the element type of the weights and the rows,
//! `G` the gradients', `P` the probabilities' (T, or fp32 with bf16 rows as an fp32 router gives
//! them), `Gemms` the GEMM backends' policy.
template <class T, execution_context Exec, class Gemms = default_gemms<Exec>,
          class G = main_grad_t<T>, class P = T>
class mlp_experts {
  static_assert(gemm_policy<Gemms, Exec>,
                "mlp_experts: Gemms must name, for every GEMM kind and mode, a grouped-GEMM "
                "backend that runs on Exec (exec/gemm_policy.hpp: host_gemms runs on host_exec "
                "only, simt_gemms everywhere)");

 public:
  using value_type = T;
  using grad_type = G;
  using prob_type = P;
  using exec_type = Exec;
  using gemms_type = Gemms;
  using space = typename Exec::memory_space;
  using batch_type = expert_batch<T, P, space>;
  using weights_type = mlp_weight_views<T, space>;
  using grads_type = mlp_grad_views<G, space>;
  static constexpr const char* name = "mlp_experts";

  //! Checks the shape (check_mlp_shape) and that the views are the shards' shapes, contiguous.
  [[nodiscard]] static expected<mlp_experts> make(const mlp_shape& s, weights_type w, grads_type g,
                                                  mlp_experts_options o = {}) {
    return made(s, w, g, o);
  }
  //! The same over host spans (host memory contexts): fc1 [L, F1, H] and fc2 [L, H, F / ETP]
  //! elements each (mlp_sizes(s)).
  [[nodiscard]] static expected<mlp_experts> make(
      const mlp_shape& s, mlp_weights<T> w, mlp_grads<G> g,
      mlp_experts_options o = {}) requires host_accessible_v<space> {
    return made(s, w, g, o);
  }

  //! Points the experts at other buffers of the same shapes (a trainer that swaps parameter
  //! storage, e.g. after an FSDP gather into a new buffer). Checked; a refused binding keeps the
  //! old one.
  [[nodiscard]] status bind(weights_type w, grads_type g) {
    const long long L = s_.num_local_experts, H = s_.hidden;
    const auto fits = [](const auto& v, long long rows, long long width) {
      return v.rows() == rows && v.width() == width && v.contiguous();
    };
    if (!fits(w.fc1, L * f1_, H) || !fits(w.fc2, L * H, fs_) || !fits(g.fc1, L * f1_, H) ||
        !fits(g.fc2, L * H, fs_))
      return make_error(errc::shape_mismatch,
                        std::string(name) +
                            ": weights and gradients must be contiguous fc1 [L F1, H] = [" +
                            detail::to_decimal(L * f1_) + ", " + detail::to_decimal(H) +
                            "] and fc2 [L H, F / ETP] = [" + detail::to_decimal(L * H) + ", " +
                            detail::to_decimal(fs_) + "]");
    w_ = w;
    g_ = g;
    return {};
  }
  //! The same over host spans of mlp_sizes(shape()) elements each.
  [[nodiscard]] status bind(mlp_weights<T> w, mlp_grads<G> g) requires host_accessible_v<space> {
    const mlp_param_sizes n = mlp_sizes(s_);
    if (w.fc1.size() != n.fc1 || w.fc2.size() != n.fc2 || g.fc1.size() != n.fc1 ||
        g.fc2.size() != n.fc2)
      return make_error(
          errc::shape_mismatch,
          std::string(name) + ": weights and gradients must hold fc1 [L, F1, H] = " +
              detail::to_decimal(n.fc1) + " and fc2 [L, H, F/ETP] = " + detail::to_decimal(n.fc2) +
              " elements; got " + detail::to_decimal(w.fc1.size()) + ", " +
              detail::to_decimal(w.fc2.size()) + " and gradients " +
              detail::to_decimal(g.fc1.size()) + ", " + detail::to_decimal(g.fc2.size()));
    const long long rows1 = static_cast<long long>(s_.num_local_experts) * f1_,
                    rows2 = static_cast<long long>(s_.num_local_experts) * s_.hidden;
    if (rows1 > max_rows || rows2 > max_rows)
      return make_error(errc::overflow, std::string(name) + ": L F1 and L H must be below 2^31");
    const int H = s_.hidden;
    return bind(weights_type{row_view<const T, space>(w.fc1.data(), static_cast<int>(rows1), H),
                             row_view<const T, space>(w.fc2.data(), static_cast<int>(rows2), fs_)},
                grads_type{row_view<G, space>(g.fc1.data(), static_cast<int>(rows1), H),
                           row_view<G, space>(g.fc2.data(), static_cast<int>(rows2), fs_)});
  }

  [[nodiscard]] int num_local_experts() const noexcept { return s_.num_local_experts; }
  [[nodiscard]] int hidden() const noexcept { return s_.hidden; }
  [[nodiscard]] const mlp_shape& shape() const noexcept { return s_; }
  [[nodiscard]] const mlp_experts_options& options() const noexcept { return o_; }
  //! The caller's weights and gradient buffers the experts run on: the gradients are what a
  //! trainer reduces over EDP (no list of them needed elsewhere).
  [[nodiscard]] const weights_type& weights() const noexcept { return w_; }
  //! Where the experts tell, once each, that a GEMM's backend declined and another runs
  //! (exec/gemm_notice.hpp; stderr by default), and what they have told.
  void set_gemm_notice(gemm_notice_sink sink) { notices_.set_sink(std::move(sink)); }
  [[nodiscard]] const std::vector<std::string>& gemm_notices_said() const noexcept {
    return notices_.said();
  }
  [[nodiscard]] const grads_type& grads() const noexcept { return g_; }

  //! Bytes of the context's memory a forward keeps for its backward for batches of at most
  //! `rows` rows: the pre-activation [M, F1] in T, or nothing with recompute_fc1.
  [[nodiscard]] std::size_t saved_bytes(int rows) const {
    if (o_.recompute_fc1) return 0;
    workspace_carver c;
    (void)c.take<A>(detail::uz(std::max(rows, 0)) * detail::uz(f1_));
    return c.required();
  }
  //! Bytes of the context's memory forward() and backward() take as their workspace for batches
  //! of at most `rows` rows: the activation and the gradients ([M, F / ETP] twice, [M, F1]; with
  //! recompute_fc1 fc1's output [M, F1] too, in T), the row ranges widened on the context, and
  //! the largest workspace a GEMM backend asks for.
  [[nodiscard]] std::size_t workspace_bytes(int rows) const {
    workspace_carver c;
    (void)carve(c, std::max(rows, 0), gemm_bytes(std::max(rows, 0)));
    return c.required();
  }

  //! y = fc2(act(fc1 x) * p) for every row of the batch (a partial sum under ETP).  [M, H] ->
  //! [M, H]. `saved`: saved_bytes(M) or more, kept untouched for this forward's backward;
  //! `workspace`: workspace_bytes(M) or more; both in the context's memory.
  [[nodiscard]] status forward(Exec& x, const batch_type& b, row_view<T, space> y,
                               std::span<std::byte> saved, std::span<std::byte> workspace) {
    if (auto st = check_expert_batch(b, s_.num_local_experts, s_.hidden, name); !st) return st;
    if (auto st = check_rows(y.rows(), y.width(), b.rows(), "y"); !st) return st;
    auto c = prepare(x, b, saved, workspace);
    if (!c) return unexpected<error>(c.error());
    if (c->rows == 0) return {};
    if (auto st = fc1(x, *c, b); !st) return st;
    // h = act(a) * p  [M, F1] -> [M, Fs]
    const kernels::activation_forward_kernel<A, P> k{.act = s_.act,
                                                     .a = {c->a, f1_},
                                                     .probs = b.probs.data(),
                                                     .h = {c->h, fs_},
                                                     .rows = c->rows,
                                                     .width = fs_};
    if (auto st =
            launch(x, elements_grid(static_cast<long long>(c->rows) * fs_, k.block_threads), k);
        !st)
      return st;
    // y = h W2^T: A (m = r, k = c) = h, B (k = c, n = h) = fc2[g][h][c].  [M, Fs] -> [M, H]
    const long long H = s_.hidden;
    return run<gemm_kind::expert>(
        x, "fc2 forward", *c,
        args<A, T, T>(*c, kernels::gemm_grouping::rows_are_m, 0, s_.hidden, fs_, {c->h, fs_, 1, 0},
                      {w_.fc2.data(), 1, fs_, H * fs_}, {y.data(), y.stride(), 1, 0}, false));
  }

  //! From dy [M, H]: dx [M, H], dprobs [M, 1] (ETP partials), and += the weight gradients (fp32
  //! main gradients for bf16 weights). `saved`: what this batch's forward was given (it reads the
  //! pre-activation there; with recompute_fc1 it runs fc1 again from x). The activation is
  //! recomputed from the pre-activation.
  [[nodiscard]] status backward(Exec& x, const batch_type& b, row_view<const T, space> dy,
                                row_view<T, space> dx, row_view<P, space> dprobs,
                                std::span<std::byte> saved, std::span<std::byte> workspace) {
    if (auto st = check_expert_batch(b, s_.num_local_experts, s_.hidden, name); !st) return st;
    const int M = b.rows();
    if (auto st = check_rows(dy.rows(), dy.width(), M, "dy"); !st) return st;
    if (auto st = check_rows(dx.rows(), dx.width(), M, "dx"); !st) return st;
    if (dprobs.rows() != M || dprobs.width() != 1 || !dprobs.contiguous())
      return make_error(
          errc::shape_mismatch,
          std::string(name) + ": dprobs must be contiguous [M, 1], M = " + detail::to_decimal(M));
    auto c = prepare(x, b, saved, workspace);
    if (!c) return unexpected<error>(c.error());
    if (c->rows == 0) return {};
    const long long H = s_.hidden;
    using kernels::gemm_grouping;
    if (o_.recompute_fc1)
      if (auto st = fc1(x, *c, b); !st) return st;
    // dh = dy W2: B (k = h, n = c) = fc2[g][h][c].  [M, H] -> [M, Fs]
    if (auto st = run<gemm_kind::expert>(
            x, "fc2 data gradient", *c,
            args<T, T, A>(*c, gemm_grouping::rows_are_m, 0, fs_, s_.hidden,
                          {dy.data(), dy.stride(), 1, 0}, {w_.fc2.data(), fs_, 1, H * fs_},
                          {c->dh, fs_, 1, 0}, false));
        !st)
      return st;
    // da and dprobs from a, dh and p, and h = act * p for fc2's gradient on the way.
    const kernels::activation_backward_kernel<A, P> back{.act = s_.act,
                                                         .a = {c->a, f1_},
                                                         .dh = {c->dh, fs_},
                                                         .probs = b.probs.data(),
                                                         .da = {c->da, f1_},
                                                         .dprobs = dprobs.data(),
                                                         .rows = c->rows,
                                                         .width = fs_,
                                                         .h = {c->h, fs_}};
    if (auto st = launch(x, elements_grid(c->rows * 32LL, back.block_threads), back); !st)
      return st;
    // fc2 grad [h, c] += sum_r dy[r, h] h[r, c]: A (m = h, k = r), B (k = r, n = c).
    if (auto st = run<gemm_kind::expert_wgrad>(
            x, "fc2 weight gradient", *c,
            args<T, A, G>(*c, gemm_grouping::rows_are_k, s_.hidden, fs_, 0,
                          {dy.data(), 1, dy.stride(), 0}, {c->h, fs_, 1, 0},
                          {g_.fc2.data(), fs_, 1, H * fs_}, true));
        !st)
      return st;
    // dx = da W1: B (k = c, n = h) = fc1[g][c][h].  [M, F1] -> [M, H]
    if (auto st = run<gemm_kind::expert>(
            x, "fc1 data gradient", *c,
            args<A, T, T>(*c, gemm_grouping::rows_are_m, 0, s_.hidden, f1_, {c->da, f1_, 1, 0},
                          {w_.fc1.data(), H, 1, f1_ * H}, {dx.data(), dx.stride(), 1, 0}, false));
        !st)
      return st;
    // fc1 grad [c, h] += sum_r da[r, c] x[r, h]: A (m = c, k = r), B (k = r, n = h).
    return run<gemm_kind::expert_wgrad>(
        x, "fc1 weight gradient", *c,
        args<A, T, G>(*c, gemm_grouping::rows_are_k, f1_, s_.hidden, 0, {c->da, 1, f1_, 0},
                      {b.x.data(), b.x.stride(), 1, 0}, {g_.fc1.data(), H, 1, f1_ * H}, true));
  }

 private:
  using A = T;  // the intermediates' element type (see the file comment)
  template <gemm_kind K, gemm_mode Mode, class TA, class TB, class TC>
  using backend = typename Gemms::template backend<K, Mode, TA, TB, TC>;

  // Either make(): the shape checked, the views bound (checked), the host offsets sized.
  template <class W, class Gr>
  static expected<mlp_experts> made(const mlp_shape& s, const W& w, const Gr& g,
                                    const mlp_experts_options& o) {
    if (auto st = check_mlp_shape(s, name); !st) return unexpected<error>(st.error());
    mlp_experts m;
    m.s_ = s;
    m.o_ = o;
    m.fs_ = s.ffn / s.etp;
    m.f1_ = (is_gated(s.act) ? 2 : 1) * m.fs_;
    if (auto st = m.bind(w, g); !st) return unexpected<error>(st.error());
    m.host_offsets_.assign(detail::uz(s.num_local_experts) + 1, 0);
    return m;
  }

  // One call's row ranges and scratch (views of the caller's workspace).
  struct call {
    int rows = 0;                    // M
    bool on_context = false;         // the row ranges are `offsets` (else host_offsets_)
    bool uniform = false;            // host counts, every expert the same rows: gemm_mode::pad
    long long* offsets = nullptr;    // [L + 1] on the context
    A *a = nullptr, *h = nullptr;    // [M, F1] (saved, or scratch with recompute_fc1), [M, Fs]
    A *da = nullptr, *dh = nullptr;  // [M, F1], [M, Fs]
    std::span<std::byte> gemm{};     // the GEMM backends' workspace (one GEMM at a time)
  };

  // The one layout of the workspace, measured (empty carver) and carved alike; the
  // pre-activation is its own only with recompute_fc1 (else it is the saved storage's).
  call carve(workspace_carver& w, int rows, std::size_t gemm) const {
    const std::size_t M = detail::uz(rows);
    call c;
    c.rows = rows;
    c.offsets = w.take<long long>(detail::uz(s_.num_local_experts) + 1).data();
    c.gemm = w.take<std::byte>(gemm);
    if (o_.recompute_fc1) c.a = w.take<A>(M * detail::uz(f1_)).data();
    c.h = w.take<A>(M * detail::uz(fs_)).data();
    c.da = w.take<A>(M * detail::uz(f1_)).data();
    c.dh = w.take<A>(M * detail::uz(fs_)).data();
    return c;
  }

  // The GEMMs' workspace for batches of `rows` rows: the most any of the six asks for, with the
  // row ranges on the host or on the context.
  std::size_t gemm_bytes(int rows) const {
    std::size_t most = 0;
    for (bool on_context : {false, true}) {
      call c;
      c.rows = rows;
      c.on_context = on_context;
      using gg = kernels::gemm_grouping;
      const auto m = gg::rows_are_m, k = gg::rows_are_k;
      most = std::max(
          {most,
           bytes<gemm_kind::expert>(args<T, T, A>(c, m, 0, f1_, s_.hidden, {}, {}, {}, false)),
           bytes<gemm_kind::expert>(args<A, T, T>(c, m, 0, s_.hidden, fs_, {}, {}, {}, false)),
           bytes<gemm_kind::expert>(args<T, T, A>(c, m, 0, fs_, s_.hidden, {}, {}, {}, false)),
           bytes<gemm_kind::expert>(args<A, T, T>(c, m, 0, s_.hidden, f1_, {}, {}, {}, false)),
           bytes<gemm_kind::expert_wgrad>(args<T, A, G>(c, k, s_.hidden, fs_, 0, {}, {}, {}, true)),
           bytes<gemm_kind::expert_wgrad>(
               args<A, T, G>(c, k, f1_, s_.hidden, 0, {}, {}, {}, true))});
    }
    return most;
  }
  template <gemm_kind K, class TA, class TB, class TC>
  static std::size_t bytes(const grouped_gemm_args<TA, TB, TC>& a) {
    return std::max(backend<K, gemm_mode::dropless, TA, TB, TC>::workspace_bytes(a),
                    backend<K, gemm_mode::pad, TA, TB, TC>::workspace_bytes(a));
  }

  // Carves the call's saved part and scratch and puts its row ranges where the GEMMs read them:
  // the host offsets from the counts, or the batch's device offsets widened on the context.
  expected<call> prepare(Exec& x, const batch_type& b, std::span<std::byte> saved,
                         std::span<std::byte> workspace) {
    const int M = b.rows();
    // No expert (L = 0) or no row: nothing to compute (rows past offsets[L] have no output).
    if (M == 0 || s_.num_local_experts == 0) return call{};
    const bool on_context = b.offsets_on_context();
    workspace_carver w(workspace);
    call c = carve(w, M, gemm_bytes(M));
    const auto too_small = [&](const char* what, std::span<std::byte> given, std::size_t asks) {
      return make_error(errc::workspace_too_small,
                        std::string(name) + ": the " + what + " holds " +
                            detail::to_decimal(static_cast<long long>(given.size())) + " bytes; " +
                            what + "_bytes(" + detail::to_decimal(M) + ") asks for " +
                            detail::to_decimal(static_cast<long long>(asks)));
    };
    if (!w.fits()) return too_small("workspace", workspace, workspace_bytes(M));
    if (!o_.recompute_fc1) {
      workspace_carver sv(saved);
      c.a = sv.take<A>(detail::uz(M) * detail::uz(f1_)).data();
      if (!sv.fits()) return too_small("saved", saved, saved_bytes(M));
    }
    c.on_context = on_context;
    if (on_context) {
      const int n = s_.num_local_experts + 1;
      const kernels::widen_offsets_kernel k{.from = b.offsets.data(), .count = n, .to = c.offsets};
      if (auto st = launch(x, launch_grid{.blocks = 1}, k); !st)
        return unexpected<error>(st.error());
    } else {
      host_offsets_[0] = 0;
      for (std::size_t l = 0; l < b.counts.size(); ++l)
        host_offsets_[l + 1] = host_offsets_[l] + b.counts[l];
      c.uniform = std::all_of(b.counts.begin(), b.counts.end(),
                              [&](int n) { return n == b.counts.front(); });
    }
    return c;
  }

  // The arguments of one of the six GEMMs, its row ranges those of the call.
  template <class TA, class TB, class TC>
  grouped_gemm_args<TA, TB, TC> args(const call& c, kernels::gemm_grouping grouping, int m, int n,
                                     int k, kernels::gemm_operand<const TA> a,
                                     kernels::gemm_operand<const TB> b,
                                     kernels::gemm_operand<TC> out, bool accumulate) const {
    grouped_gemm_args<TA, TB, TC> g{.grouping = grouping,
                                    .groups = s_.num_local_experts,
                                    .m = m,
                                    .n = n,
                                    .k = k,
                                    .a = a,
                                    .b = b,
                                    .c = out,
                                    .accumulate = accumulate};
    if (c.on_context) {
      g.offsets = c.offsets;
      g.row_bound = c.rows;
    } else {
      g.host_offsets = host_offsets_;
    }
    return g;
  }

  // One GEMM through the seam with the policy's backend: its rules, its workspace, the run.
  template <gemm_kind K, class TA, class TB, class TC>
  status run(Exec& x, const char* what, const call& c,
             const grouped_gemm_args<TA, TB, TC>& a) const {
    if (c.uniform) return run_on<backend<K, gemm_mode::pad, TA, TB, TC>>(x, what, c, a);
    return run_on<backend<K, gemm_mode::dropless, TA, TB, TC>>(x, what, c, a);
  }
  template <class B, class TA, class TB, class TC>
  status run_on(Exec& x, const char* what, const call& c,
                const grouped_gemm_args<TA, TB, TC>& a) const {
    if (auto st = B::can_implement(a); !st) return st;
    if (c.gemm.size() < B::workspace_bytes(a))
      return make_error(errc::workspace_too_small,
                        std::string(name) + ": the GEMM workspace holds " +
                            detail::to_decimal(static_cast<long long>(c.gemm.size())) + " bytes, " +
                            B::name + " asks for " +
                            detail::to_decimal(static_cast<long long>(B::workspace_bytes(a))));
    B gemm;
    if (auto st = gemm.initialize(x, a, c.gemm); !st) return st;
    notices_.after_initialize(gemm, name, what);
    return gemm.run(x);
  }

  // a = x W1^T: B (k = h, n = c) = fc1[g][c][h].  [M, H] -> [M, F1]
  status fc1(Exec& x, const call& c, const batch_type& b) const {
    const long long H = s_.hidden;
    return run<gemm_kind::expert>(
        x, "fc1 forward", c,
        args<T, T, A>(c, kernels::gemm_grouping::rows_are_m, 0, f1_, s_.hidden,
                      {b.x.data(), b.x.stride(), 1, 0}, {w_.fc1.data(), 1, H, f1_ * H},
                      {c.a, f1_, 1, 0}, false));
  }

  status check_rows(int rows, int width, int M, const char* what) const {
    if (rows != M || width != s_.hidden)
      return make_error(errc::shape_mismatch, std::string(name) + ": " + what +
                                                  " must be [M, H] = [" + detail::to_decimal(M) +
                                                  ", " + detail::to_decimal(s_.hidden) + "]");
    return {};
  }
  static launch_grid elements_grid(long long n, int threads) {
    return {.blocks = capped_blocks<Exec>(n, threads)};
  }

  mlp_shape s_{};
  mlp_experts_options o_{};
  int fs_ = 0;  // F / ETP
  int f1_ = 0;  // fc1 rows of this shard per expert
  weights_type w_{};
  grads_type g_{};
  // The row ranges from the host counts [L + 1] (sized at make; see the file comment).
  std::vector<long long> host_offsets_{};
  // The fallbacks taken, told once each (exec/gemm_notice.hpp).
  mutable gemm_notices notices_{};
};

}  // namespace v0_1
}  // namespace moefold
