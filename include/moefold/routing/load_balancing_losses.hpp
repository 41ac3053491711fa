//! @file load_balancing_losses.hpp
//! @brief The three load-balancing losses of a router (Megatron-Core `switch_load_balancing_loss`
//! at the micro-batch, per-sequence and global-batch level: moe_router_load_balancing_type
//! "aux_loss", "seq_aux_loss", "global_aux_loss") on an execution context, forward and backward,
//! the loss values device values (a host read for logging), one implementation for every context
//! (the kernels of kernels/router_aux_loss.hpp).
//!
//! Each rank computes a partial loss over its own tokens; the statistics are summed over the
//! term's group, so the partials add up to the formula on the whole batch:
//!   micro-batch: counts over TP x CP, T = N |tp-cp|;
//!   per sequence: columns (sequence b, expert e) of the scores viewed as [N / B, B E], counts
//!     over TP x CP, T = (N / B) |tp-cp|, the mean over the B sequences;
//!   global: counts over TP x DP x CP added to running counts (the object's state, reset once per
//!     global batch), the loss from running / micro-batches, T = N |tp-dp-cp|.
//! loss = coeff E / (k T^2) sum_col (sum_rows scores[row, col]) counts[col] / divide_by, on the
//! aux scores (softmax over E, or the elementwise score renormalised over E) and their plain top-k
//! map, without bias, group limits or dropping. Under a padding mask T comes from the counts.
//!
//! Memory, in the context's memory space (the CUB idiom: sizes asked for, the caller's bytes
//! carved): `saved_bytes()` per forward in flight, until its backward (each term's d loss /
//! d scores and the loss values); `workspace_bytes()`, dead after each forward (the scores, the
//! map, the column sums and counts). The running counts of the global term are the object's.
//!
//! Shapes: logits, dlogits [N, E] contiguous; padding [1, N] (1 = padding token) or empty.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <moefold/kernels/router_aux_loss.hpp>

#include "../comm/communicator.hpp"
#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/score_function.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"
#include "router_args.hpp"
#include "router_launch.hpp"

namespace moefold {
inline namespace v0_1 {

//! The load-balancing terms a router trains with; a coefficient of 0 turns its term off.
struct load_balancing_options {
  int num_experts = 0;                             //!< E
  int topk = 0;                                    //!< k
  score_function score = score_function::softmax;  //!< the router's score function
  int max_tokens = 0;                              //!< the most tokens of one forward
  int batch = 1;                                   //!< B sequences per micro-batch: n = s B + b
  double aux_coeff = 0.0;                          //!< micro-batch (moe_aux_loss_coeff)
  double seq_aux_coeff = 0.0;                      //!< per sequence
  double global_aux_coeff = 0.0;                   //!< global batch
};

//! The three terms, in the order of their loss values and seeds.
inline constexpr int load_balancing_terms = 3;

//! What one forward ran, for its backward (a host value; the gradients are in its saved bytes).
struct load_balancing_record {
  std::array<bool, load_balancing_terms> on{};  //!< micro-batch, per sequence, global
  int num_tokens = 0;
  [[nodiscard]] bool any() const noexcept { return on[0] || on[1] || on[2]; }
};

template <class R, class Exec>
class load_balancing_losses {
  static_assert(router_dtype_check<R, Exec>::ok);

 public:
  using space = typename Exec::memory_space;

  //! Checks the options; allocates the global term's running counts [E] on `exec` (with
  //! global_aux_coeff > 0), zeroed. `exec` must outlive the object (it frees them there).
  [[nodiscard]] static expected<load_balancing_losses> make(Exec& exec,
                                                            const load_balancing_options& o) {
    using detail::to_decimal;
    const auto ok = [](double c) { return std::isfinite(c) && c >= 0; };
    if (!(ok(o.aux_coeff) && ok(o.seq_aux_coeff) && ok(o.global_aux_coeff)))
      return make_error(errc::invalid_argument,
                        "load-balancing losses: coefficients must be finite and >= 0 (0 turns "
                        "one off)");
    if (o.num_experts < 1 || o.topk < 1 || o.topk > o.num_experts || o.max_tokens < 0 ||
        o.batch < 1)
      return make_error(errc::invalid_size,
                        "load-balancing losses: need 1 <= topk <= num_experts, max_tokens >= 0, "
                        "batch >= 1 (got topk " +
                            to_decimal(o.topk) + ", num_experts " + to_decimal(o.num_experts) +
                            ", max_tokens " + to_decimal(o.max_tokens) + ", batch " +
                            to_decimal(o.batch) + ")");
    if (o.num_experts > kernels::aux_scores_block_kernel::max_experts)
      return make_error(errc::invalid_argument,
                        "load-balancing losses: the kernels take E <= " +
                            to_decimal(kernels::aux_scores_block_kernel::max_experts));
    load_balancing_losses l;
    l.o_ = o;
    if (o.global_aux_coeff > 0) {  // [1, E + 1]: the running counts, then their micro-batches
      auto r = exec_buffer<double, Exec>::make(exec, 1, o.num_experts + 1);
      if (!r) return unexpected<error>(r.error());
      l.running_ = std::move(*r);
      if (auto st = exec.template fill<double>(l.running_.view(), 0.0); !st)
        return unexpected<error>(st.error());
    }
    return l;
  }

  [[nodiscard]] const load_balancing_options& options() const noexcept { return o_; }
  //! True when some coefficient is > 0.
  [[nodiscard]] bool any() const noexcept {
    return o_.aux_coeff > 0 || o_.seq_aux_coeff > 0 || o_.global_aux_coeff > 0;
  }

  //! Bytes one forward keeps until its backward.
  [[nodiscard]] std::size_t saved_bytes() const {
    workspace_carver c;
    (void)carve_saved(c);
    return c.required();
  }
  //! Bytes a forward works in (free again when it returns).
  [[nodiscard]] std::size_t workspace_bytes() const {
    workspace_carver c;
    (void)carve_work(c);
    return c.required();
  }

  //! The active terms of one training forward over logits [N, E]: the losses (their values in
  //! `saved`: losses()) and each one's d loss / d scores for the backward. tp_cp sums the
  //! micro-batch and per-sequence counts, tp_dp_cp the global ones (it may be null when the global
  //! term is off). The global term adds this forward's counts to the running counts: call it
  //! once per micro-batch (not again for an activation recompute).
  template <class Comm>
  [[nodiscard]] expected<load_balancing_record> forward(Exec& exec, row_view<const R, space> logits,
                                                        row_view<const std::uint8_t, space> padding,
                                                        Comm& tp_cp, Comm* tp_dp_cp,
                                                        std::span<std::byte> saved,
                                                        std::span<std::byte> workspace) {
    const int n = logits.rows(), E = o_.num_experts;
    if (auto st = check_inputs(logits, padding); !st) return unexpected<error>(st.error());
    load_balancing_record rec;
    rec.num_tokens = n;
    rec.on = {o_.aux_coeff > 0, o_.seq_aux_coeff > 0, o_.global_aux_coeff > 0};
    if (!rec.any()) return rec;
    if (rec.on[1] && n % o_.batch != 0)
      return make_error(errc::shape_mismatch, "seq aux loss: num_tokens=" + detail::to_decimal(n) +
                                                  " is not a multiple of the batch size " +
                                                  detail::to_decimal(o_.batch));
    if (rec.on[2] && tp_dp_cp == nullptr)
      return make_error(errc::invalid_argument,
                        "load-balancing losses: the global term needs the tp-dp-cp communicator");
    workspace_carver sc(saved), wc(workspace);
    const saved_views sv = carve_saved(sc);
    const work_views wv = carve_work(wc);
    if (!sc.fits() || !wc.fits())
      return make_error(errc::workspace_too_small,
                        "load-balancing losses: saved and workspace bytes must be at least "
                        "saved_bytes() = " +
                            detail::to_decimal(saved_bytes()) +
                            " and workspace_bytes() = " + detail::to_decimal(workspace_bytes()));
    if (auto st = exec.template fill<R>(sv.loss, R(0)); !st) return unexpected<error>(st.error());
    // The aux scores and their top-k map over all E [N, E], shared by the three terms.
    if (auto st = detail::by_router_team(E,
                                         [&]<class Team>() {
                                           const kernels::basic_aux_scores_kernel<Team, R> k{
                                               .logits = logits.data(),
                                               .padding = pad(padding),
                                               .num_tokens = n,
                                               .num_experts = E,
                                               .topk = o_.topk,
                                               .score = o_.score,
                                               .scores = wv.scores.data(),
                                               .map = wv.map.data()};
                                           return detail::launch_per_token<Team>(exec, k, n);
                                         });
        !st)
      return unexpected<error>(st.error());
    for (int i = 0; i < load_balancing_terms; ++i) {
      if (!rec.on[static_cast<std::size_t>(i)]) continue;
      if (auto st = term(exec, i, n, padding, i == 2 ? *tp_dp_cp : tp_cp, sv, wv); !st)
        return unexpected<error>(st.error());
    }
    return rec;
  }

  //! The loss values of the forward whose saved bytes these are: [1, 3] (micro-batch, per
  //! sequence, global; 0 for a term that is off), this rank's parts.
  [[nodiscard]] row_view<const R, space> losses(std::span<std::byte> saved) const {
    workspace_carver c(saved);
    return carve_saved(c).loss;
  }

  //! Adds seeds[i] * d term_i / d logits to dlogits [N, E] for the terms `rec` ran, in the order
  //! micro-batch, per sequence, global (the seeds: d training loss / d term).
  [[nodiscard]] status backward(Exec& exec, row_view<const R, space> logits,
                                row_view<const std::uint8_t, space> padding,
                                const load_balancing_record& rec, std::span<std::byte> saved,
                                const std::array<R, load_balancing_terms>& seeds,
                                row_view<R, space> dlogits) const {
    const int n = logits.rows(), E = o_.num_experts;
    if (!rec.any()) return {};
    if (auto st = check_inputs(logits, padding); !st) return st;
    if (n != rec.num_tokens || dlogits.rows() != n || dlogits.width() != E || !dlogits.contiguous())
      return make_error(errc::shape_mismatch,
                        "load-balancing losses: backward needs the forward's logits and dlogits "
                        "[N, E] with N = " +
                            detail::to_decimal(rec.num_tokens));
    workspace_carver sc(saved);
    const saved_views sv = carve_saved(sc);
    if (!sc.fits())
      return make_error(errc::workspace_too_small,
                        "load-balancing losses: the saved bytes are fewer than saved_bytes()");
    for (int i = 0; i < load_balancing_terms; ++i) {
      if (!rec.on[static_cast<std::size_t>(i)]) continue;
      const auto& ds = sv.dscores[static_cast<std::size_t>(i)];
      if (auto st =
              detail::by_router_team(E,
                                     [&]<class Team>() {
                                       const kernels::basic_aux_loss_backward_kernel<Team, R> k{
                                           .logits = logits.data(),
                                           .padding = pad(padding),
                                           .num_tokens = n,
                                           .num_experts = E,
                                           .score = o_.score,
                                           .dscores = ds.data(),
                                           .columns = ds.width(),
                                           .seed = seeds[static_cast<std::size_t>(i)],
                                           .dlogits = dlogits.data()};
                                       return detail::launch_per_token<Team>(exec, k, n);
                                     });
          !st)
        return st;
    }
    return {};
  }

  //! The global term's running state [1, E + 1] in the context's memory: the counts (summed
  //! over TP x DP x CP), then the micro-batches they cover (a double, counted by the forward's
  //! kernel, so a CUDA graph's replays advance it); empty with the global term off.
  [[nodiscard]] row_view<const double, space> running_state() const noexcept {
    return running_.cview();
  }
  //! The end of a global batch: the running counts restart.
  [[nodiscard]] status reset_running(Exec& exec) {
    if (o_.global_aux_coeff > 0) return exec.template fill<double>(running_.view(), 0.0);
    return {};
  }
  //! A checkpoint's running counts [E] (host memory) and micro-batches: E entries with the
  //! global term on (or none with 0 steps: the start of a global batch), none with it off.
  [[nodiscard]] status load_running(Exec& exec, std::span<const double> counts, int steps) {
    const bool on = o_.global_aux_coeff > 0;
    if (steps < 0 || (!on && (steps != 0 || !counts.empty())) ||
        (on && counts.size() != detail::uz(o_.num_experts) && !(counts.empty() && steps == 0)))
      return make_error(errc::shape_mismatch,
                        "load-balancing losses: the running counts must have E entries with the "
                        "global term on (or none at the start of a global batch), none with it "
                        "off, and steps >= 0");
    if (!on) return {};
    if (counts.empty()) return reset_running(exec);
    std::vector<double> state(counts.begin(), counts.end());
    state.push_back(static_cast<double>(steps));
    if (auto st = exec.copy(row_view<const double, host_space>(state.data(), 1, o_.num_experts + 1),
                            running_.view());
        !st)
      return st;
    return exec.synchronize();  // the host vector goes out of scope
  }

 private:
  struct saved_views {
    std::array<row_view<R, space>, load_balancing_terms> dscores;  // [1, columns of the term]
    row_view<R, space> loss;                                       // [1, 3]
  };
  struct work_views {
    std::span<R> scores;          // [N, E]
    std::span<std::uint8_t> map;  // [N, E]
    std::span<R> sums;            // [B E]
    std::span<double> counts;     // [B E]
  };
  int columns(int i) const noexcept { return i == 1 ? o_.batch * o_.num_experts : o_.num_experts; }
  saved_views carve_saved(workspace_carver& c) const {
    saved_views v;
    for (int i = 0; i < load_balancing_terms; ++i) {
      const int cols = columns(i);
      v.dscores[static_cast<std::size_t>(i)] =
          row_view<R, space>(c.take<R>(detail::uz(cols)).data(), 1, cols);
    }
    v.loss = row_view<R, space>(c.take<R>(load_balancing_terms).data(), 1, load_balancing_terms);
    return v;
  }
  work_views carve_work(workspace_carver& c) const {
    const std::size_t NE = detail::uz(o_.max_tokens) * detail::uz(o_.num_experts),
                      BE = detail::uz(o_.batch) * detail::uz(o_.num_experts);
    work_views v;
    v.scores = c.take<R>(NE);
    v.map = c.take<std::uint8_t>(NE);
    v.sums = c.take<R>(BE);
    v.counts = c.take<double>(BE);
    return v;
  }
  static const std::uint8_t* pad(row_view<const std::uint8_t, space> p) noexcept {
    return p.empty() ? nullptr : p.data();
  }
  status check_inputs(row_view<const R, space> logits,
                      row_view<const std::uint8_t, space> padding) const {
    const int n = logits.rows();
    if (logits.width() != o_.num_experts || !logits.contiguous() || n > o_.max_tokens)
      return make_error(errc::shape_mismatch,
                        "load-balancing losses: logits must be contiguous [N, E] with E = " +
                            detail::to_decimal(o_.num_experts) +
                            " and N <= max_tokens = " + detail::to_decimal(o_.max_tokens));
    if (!padding.empty() && (padding.rows() != 1 || padding.width() != n || !padding.contiguous()))
      return make_error(errc::shape_mismatch,
                        "load-balancing losses: the padding mask must be [1, N] or empty");
    return {};
  }

  // Term i: the column sums and counts, the group's all-reduce of the counts, the loss and
  // d loss / d scores.
  template <class Comm>
  status term(Exec& exec, int i, int n, row_view<const std::uint8_t, space> padding, Comm& group,
              const saved_views& sv, const work_views& wv) {
    const int E = o_.num_experts, B = i == 1 ? o_.batch : 1, cols = B * E;
    const kernels::aux_column_sums_kernel<R> sums{.scores = wv.scores.data(),
                                                  .map = wv.map.data(),
                                                  .rows = n / B,
                                                  .columns = cols,
                                                  .sums = wv.sums.data(),
                                                  .counts = wv.counts.data()};
    if (auto st = launch(exec, launch_grid{.blocks = capped_blocks<Exec>(cols, sums.block_threads)},
                         sums);
        !st)
      return st;
    if (group.size() > 1)
      if (auto st = group.all_reduce(exec, row_view<double, space>(wv.counts.data(), 1, cols),
                                     reduce_op::sum);
          !st)
        return st;
    const double coeff[load_balancing_terms] = {o_.aux_coeff, o_.seq_aux_coeff,
                                                o_.global_aux_coeff};
    const kernels::switch_loss_kernel<R> loss{
        .column_sums = wv.sums.data(),
        .counts = wv.counts.data(),
        .columns = cols,
        .total_tokens = padding.empty() ? static_cast<double>(n / B) * group.size() : 0.0,
        .per_token = static_cast<double>(o_.topk) * B,
        .topk = o_.topk,
        .num_experts = E,
        .coeff = coeff[i],
        .divide_by = static_cast<double>(B),
        .running = i == 2 ? running_.view().data() : nullptr,
        .used = nullptr,
        .loss = sv.loss.data() + i,
        .dscores = sv.dscores[static_cast<std::size_t>(i)].data()};
    return launch(exec, launch_grid{.blocks = 1}, loss);
  }

  load_balancing_options o_{};
  exec_buffer<double, Exec> running_{};  // [1, E + 1] with the global term on: counts, steps
};

}  // namespace v0_1
}  // namespace moefold
