//! @file simt_mlp.hpp
//! @brief The portable reference expert on an execution context: grouped_mlp's computation (fc1
//! -> activation -> * prob -> fc2, Megatron-Core's TEGroupedMLP layouts, ETP shards) as kernel
//! launches over the context's memory: the SIMT grouped GEMM (kernels/grouped_gemm.hpp) and the
//! activation kernels (kernels/activation.hpp). The same object runs on cpu_exec (CI, under the
//! sanitizers) and on cuda_exec, so every layer has a correct expert path on the GPU; the fast
//! path is a tensor-core expert behind the same functor shape.
//!
//! Arithmetic: fc1's output and the activations in accumulator_t<T> (fp32 for bf16), as
//! grouped_mlp keeps them; each GEMM output one fma chain over k in ascending order; the
//! activation in double rounded once. Weight gradients accumulate into the caller's buffers
//! (beta = 1) in G. Host <-> device traffic per call: the expert offsets (L + 1 integers) to the
//! device, nothing back; none when the batch's row ranges are on the context already
//! (device_expert_batch::offsets: the GEMMs' grids then come from a bound on M and L).
//!
//! Shapes: x, y, dy, dx [M, H] (any row stride), probs, dprobs [M, 1] contiguous; weights fc1
//! [L F1, H], fc2 [L H, F / ETP]; counts [L] on the host, or offsets [1, L + 1] on the context.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <moefold/kernels/activation.hpp>
#include <moefold/kernels/grouped_gemm.hpp>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"
#include "../exec/grouped_gemm_launch.hpp"
#include "grouped_mlp.hpp"
#include "mlp_params.hpp"

namespace moefold {
inline namespace v0_1 {

//! The experts' weights in a context's memory space S: fc1 [L F1, H], fc2 [L H, F / ETP].
template <class T, class S>
struct mlp_device_weights {
  row_view<const T, S> fc1{};
  row_view<const T, S> fc2{};
};
//! Their gradient buffers, the same shapes, accumulated into.
template <class G, class S>
struct mlp_device_grads {
  row_view<G, S> fc1{};
  row_view<G, S> fc2{};
};
//! expert_batch in a context's memory: counts on the host, rows and probabilities in S. A
//! dispatch that left the counts on the context gives `offsets` instead (counts empty): the
//! first row of each local expert [1, L + 1], non-decreasing from 0, offsets[L] <= M (rows past
//! it belong to no expert: nothing is computed for them and their outputs are unspecified).
template <class T, class P, class S>
struct device_expert_batch {
  std::span<const int> counts{};     //!< [L] rows per local expert
  row_view<const T, S> x{};          //!< [M, H]
  row_view<const P, S> probs{};      //!< [M, 1] contiguous
  row_view<const int, S> offsets{};  //!< [1, L + 1] with counts empty
};

template <class T, execution_context Exec, class G = main_grad_t<T>, class P = T>
class simt_mlp {
 public:
  using space = typename Exec::memory_space;
  using value_type = T;
  using grad_type = G;
  using prob_type = P;

  //! Checks the shape (grouped_mlp's rules) and that the views are the shards' shapes,
  //! contiguous.
  [[nodiscard]] static expected<simt_mlp> make(Exec& exec, const mlp_shape& s,
                                               mlp_device_weights<T, space> w,
                                               mlp_device_grads<G, space> g) {
    if (auto st = grouped_mlp<T, G, P>::check_shape(s, "simt_mlp"); !st)
      return unexpected<error>(st.error());
    simt_mlp m;
    m.x_ = &exec;
    m.s_ = s;
    m.fs_ = s.ffn / s.etp;
    m.f1_ = (is_gated(s.act) ? 2 : 1) * m.fs_;
    const long long L = s.num_local_experts, H = s.hidden;
    auto fits = [](const auto& v, long long rows, long long width) {
      return v.rows() == rows && v.width() == width && v.contiguous();
    };
    if (!fits(w.fc1, L * m.f1_, H) || !fits(w.fc2, L * H, m.fs_) || !fits(g.fc1, L * m.f1_, H) ||
        !fits(g.fc2, L * H, m.fs_))
      return unexpected<error>(
          make_error(errc::shape_mismatch,
                     "simt_mlp: weights and gradients must be contiguous fc1 [L F1, H] = [" +
                         detail::to_decimal(L * m.f1_) + ", " + detail::to_decimal(H) +
                         "] and fc2 [L H, F / ETP] = [" + detail::to_decimal(L * H) + ", " +
                         detail::to_decimal(m.fs_) + "]"));
    m.w_ = w;
    m.g_ = g;
    return m;
  }

  [[nodiscard]] int num_local_experts() const noexcept { return s_.num_local_experts; }
  [[nodiscard]] int hidden() const noexcept { return s_.hidden; }
  [[nodiscard]] const mlp_shape& shape() const noexcept { return s_; }

  //! y = fc2(act(fc1 x) * p) per row (a partial sum under ETP).  [M, H] -> [M, H]
  [[nodiscard]] status forward(const device_expert_batch<T, P, space>& b, row_view<T, space> y) {
    if (auto st = prepare(b, y.rows(), y.width(), "y"); !st) return st;
    if (rows_ == 0) return {};
    if (auto st = fc1(b); !st) return st;
    if (auto st = activate(b); !st) return st;
    // y = h W2^T: B (k = c, n = h) = fc2[g][h][c].
    return gemm<A, T, T>(kernels::gemm_grouping::rows_are_m, 0, s_.hidden, fs_, {h(), fs_, 1, 0},
                         {w_.fc2.data(), 1, fs_, static_cast<long long>(s_.hidden) * fs_},
                         {y.data(), y.stride(), 1, 0}, false);
  }

  //! From dy [M, H]: dx [M, H], dprobs [M, 1] (ETP partials), and += the weight gradients.
  //! Recomputes fc1 and the activation from x.
  [[nodiscard]] status backward(const device_expert_batch<T, P, space>& b,
                                row_view<const T, space> dy, row_view<T, space> dx,
                                row_view<P, space> dprobs) {
    if (auto st = prepare(b, dy.rows(), dy.width(), "dy"); !st) return st;
    if (auto st = check_rows(dx.rows(), dx.width(), "dx"); !st) return st;
    if (dprobs.rows() != rows_ || dprobs.width() != 1 || !dprobs.contiguous())
      return make_error(errc::shape_mismatch, "simt_mlp: dprobs must be contiguous [M, 1], M = " +
                                                  detail::to_decimal(rows_));
    if (rows_ == 0) return {};
    const long long H = s_.hidden;
    if (auto st = fc1(b); !st) return st;
    // dh = dy W2: B (k = h, n = c) = fc2[g][h][c].
    if (auto st = gemm<T, T, A>(kernels::gemm_grouping::rows_are_m, 0, fs_, s_.hidden,
                                {dy.data(), dy.stride(), 1, 0}, {w_.fc2.data(), fs_, 1, H * fs_},
                                {dh(), fs_, 1, 0}, false);
        !st)
      return st;
    // da and dprobs from a, dh and p, and h = act * p for fc2's gradient on the way.
    const kernels::activation_backward_kernel<A, P> back{.act = s_.act,
                                                         .a = {a(), f1_},
                                                         .dh = {dh(), fs_},
                                                         .probs = b.probs.data(),
                                                         .da = {da(), f1_},
                                                         .dprobs = dprobs.data(),
                                                         .rows = rows_,
                                                         .width = fs_,
                                                         .h = {h(), fs_}};
    if (auto st = run(back, elements_grid(rows_ * 32LL, back.block_threads)); !st) return st;
    // fc2 grad [h, c] += sum_r dy[r, h] h[r, c]: A (m = h, k = r), B (k = r, n = c).
    if (auto st = gemm<T, A, G>(kernels::gemm_grouping::rows_are_k, s_.hidden, fs_, 0,
                                {dy.data(), 1, dy.stride(), 0}, {h(), fs_, 1, 0},
                                {g_.fc2.data(), fs_, 1, H * fs_}, true);
        !st)
      return st;
    // dx = da W1: B (k = c, n = h) = fc1[g][c][h].
    if (auto st =
            gemm<A, T, T>(kernels::gemm_grouping::rows_are_m, 0, s_.hidden, f1_, {da(), f1_, 1, 0},
                          {w_.fc1.data(), H, 1, f1_ * H}, {dx.data(), dx.stride(), 1, 0}, false);
        !st)
      return st;
    // fc1 grad [c, h] += sum_r da[r, c] x[r, h]: A (m = c, k = r), B (k = r, n = h).
    return gemm<A, T, G>(kernels::gemm_grouping::rows_are_k, f1_, s_.hidden, 0, {da(), 1, f1_, 0},
                         {b.x.data(), b.x.stride(), 1, 0}, {g_.fc1.data(), H, 1, f1_ * H}, true);
  }

 private:
  using A = accumulator_t<T>;

  // Checks the batch and an [M, H] operand, uploads the offsets, sizes the scratch.
  status prepare(const device_expert_batch<T, P, space>& b, int rows, int width, const char* what) {
    if (b.counts.empty() && !b.offsets.empty()) return prepare_on_context(b, rows, width, what);
    device_offsets_ = false;
    if (static_cast<int>(b.counts.size()) != s_.num_local_experts)
      return make_error(
          errc::shape_mismatch,
          "simt_mlp: counts has " + detail::to_decimal(static_cast<long long>(b.counts.size())) +
              " entries for " + detail::to_decimal(s_.num_local_experts) + " local experts");
    host_offsets_.assign(1, 0);
    for (int c : b.counts) {
      if (c < 0)
        return make_error(errc::invalid_argument, "simt_mlp: a negative row count in counts");
      host_offsets_.push_back(host_offsets_.back() + c);
    }
    if (host_offsets_.back() > 0x7fffffffLL)
      return make_error(errc::invalid_size, "simt_mlp: more than 2^31 - 1 rows");
    rows_ = static_cast<int>(host_offsets_.back());
    if (b.x.rows() != rows_ || b.x.width() != s_.hidden)
      return make_error(errc::shape_mismatch,
                        "simt_mlp: x must be [M, H] = [" + detail::to_decimal(rows_) + ", " +
                            detail::to_decimal(s_.hidden) + "], M = sum(counts)");
    if (auto st = check_probs_and_rows(b, rows, width, what); !st) return st;
    if (rows_ == 0) return {};
    // The offsets to the device: the only host -> device traffic of a call.
    const int n = s_.num_local_experts + 1;
    if (auto st = ensure_offsets(n); !st) return st;
    if (auto st = x_->copy(row_view<const long long, host_space>(host_offsets_.data(), 1, n),
                           offsets_.view());
        !st)
      return st;
    return size_scratch();
  }
  // The same with the row ranges on the context: M from x, the offsets widened there.
  status prepare_on_context(const device_expert_batch<T, P, space>& b, int rows, int width,
                            const char* what) {
    const int n = s_.num_local_experts + 1;
    if (b.offsets.rows() != 1 || b.offsets.width() != n)
      return make_error(errc::shape_mismatch, "simt_mlp: offsets must be [1, L + 1] = [1, " +
                                                  detail::to_decimal(n) + "]");
    device_offsets_ = true;
    rows_ = b.x.rows();
    if (rows_ < 0 || b.x.width() != s_.hidden)
      return make_error(errc::shape_mismatch,
                        "simt_mlp: x must be [M, H] with H = " + detail::to_decimal(s_.hidden));
    if (auto st = check_probs_and_rows(b, rows, width, what); !st) return st;
    if (rows_ == 0) return {};
    if (auto st = ensure_offsets(n); !st) return st;
    const kernels::widen_offsets_kernel k{
        .from = b.offsets.data(), .count = n, .to = offsets_.view().data()};
    if (auto st = run(k, launch_grid{.blocks = 1}); !st) return st;
    return size_scratch();
  }
  // probs [M, 1] contiguous and the call's [rows, width] operand [M, H]: both paths' rules.
  status check_probs_and_rows(const device_expert_batch<T, P, space>& b, int rows, int width,
                              const char* what) const {
    if (b.probs.rows() != rows_ || b.probs.width() != 1 || !b.probs.contiguous())
      return make_error(errc::shape_mismatch, "simt_mlp: probs must be contiguous [M, 1], M = " +
                                                  detail::to_decimal(rows_));
    return check_rows(rows, width, what);
  }
  // The widened offsets [1, L + 1], allocated once on first use.
  status ensure_offsets(int n) {
    if (offsets_.view().data() != nullptr) return {};
    auto o = exec_buffer<long long, Exec>::make(*x_, 1, n);
    if (!o) return unexpected<error>(o.error());
    offsets_ = std::move(*o);
    return {};
  }
  status size_scratch() {
    if (rows_ > capacity_) {  // one block of scratch: a [M, F1], da [M, F1], h [M, Fs], dh [M, Fs]
      auto s = exec_buffer<A, Exec>::make(*x_, rows_, 2LL * f1_ + 2LL * fs_);
      if (!s) return unexpected<error>(s.error());
      scratch_ = std::move(*s);
      capacity_ = rows_;
    }
    return {};
  }
  status check_rows(int rows, int width, const char* what) const {
    if (rows != rows_ || width != s_.hidden)
      return make_error(errc::shape_mismatch,
                        std::string("simt_mlp: ") + what + " must be [M, H] = [" +
                            detail::to_decimal(rows_) + ", " + detail::to_decimal(s_.hidden) + "]");
    return {};
  }
  // The pieces of the one scratch buffer, each its own contiguous [capacity, width] block.
  A* a() const { return scratch_.view().data(); }
  A* da() const { return a() + static_cast<long long>(capacity_) * f1_; }
  A* h() const { return da() + static_cast<long long>(capacity_) * f1_; }
  A* dh() const { return h() + static_cast<long long>(capacity_) * fs_; }

  // a = x W1^T: B (k = h, n = c) = fc1[g][c][h].
  status fc1(const device_expert_batch<T, P, space>& b) {
    const long long H = s_.hidden;
    return gemm<T, T, A>(kernels::gemm_grouping::rows_are_m, 0, f1_, s_.hidden,
                         {b.x.data(), b.x.stride(), 1, 0}, {w_.fc1.data(), 1, H, f1_ * H},
                         {a(), f1_, 1, 0}, false);
  }
  // h = act(a) * p.
  status activate(const device_expert_batch<T, P, space>& b) {
    const kernels::activation_forward_kernel<A, P> k{.act = s_.act,
                                                     .a = {a(), f1_},
                                                     .probs = b.probs.data(),
                                                     .h = {h(), fs_},
                                                     .rows = rows_,
                                                     .width = fs_};
    return run(k, elements_grid(static_cast<long long>(rows_) * fs_, k.block_threads));
  }

  template <class TA, class TB, class TC>
  status gemm(kernels::gemm_grouping grouping, int m, int n, int k,
              kernels::gemm_operand<const TA> pa, kernels::gemm_operand<const TB> pb,
              kernels::gemm_operand<TC> pc, bool accumulate) {
    using K = kernels::grouped_gemm_kernel<TA, TB, TC>;
    const K kernel{.grouping = grouping,
                   .offsets = offsets_.view().data(),
                   .groups = s_.num_local_experts,
                   .m = m,
                   .n = n,
                   .k = k,
                   .a = pa,
                   .b = pb,
                   .c = pc,
                   .accumulate = accumulate};
    if (device_offsets_) return launch_grouped_gemm(*x_, kernel, static_cast<long long>(rows_));
    return launch_grouped_gemm(*x_, kernel, std::span<const long long>(host_offsets_));
  }
  static launch_grid elements_grid(long long n, int threads) {
    return {.blocks = capped_blocks<Exec>(n, threads)};
  }
  template <class K>
  status run(const K& kernel, launch_grid grid) {
    return launch(*x_, grid, kernel);
  }

  Exec* x_ = nullptr;
  mlp_shape s_{};
  int fs_ = 0, f1_ = 0, rows_ = 0, capacity_ = 0;
  mlp_device_weights<T, space> w_{};
  mlp_device_grads<G, space> g_{};
  std::vector<long long> host_offsets_{};
  bool device_offsets_ = false;  // this call's row ranges came on the context (no host copy)
  exec_buffer<long long, Exec> offsets_{};
  exec_buffer<A, Exec> scratch_{};
};

}  // namespace v0_1
}  // namespace moefold
