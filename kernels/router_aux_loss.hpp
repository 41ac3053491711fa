//! @file router_aux_loss.hpp
//! @brief The load-balancing losses of routing/aux_loss.hpp and group_losses.hpp as device values:
//! the aux scores and their top-k map, the column sums and counts, the Switch/GShard loss with
//! its gradient with respect to the scores (per micro-batch, per sequence, global), and that
//! gradient chained into the logits. What crosses ranks (the counts summed over TP x CP, or
//! TP x DP x CP) is the caller's collective between aux_column_sums_kernel and
//! switch_loss_kernel; nothing here reads a value back to the host.
//!
//! Order of operations: the column sums and counts run over rows in row order and the loss over
//! columns in column order, as the host forms them, so from the same scores they are the same
//! bits as the host's; the scores themselves come from moefold's exp (a few ulp from the C
//! library's) with the team's fixed reduction order. On a host context's team of one (host_exec)
//! the team bodies (aux scores, the gradient) run over detail_router::one_thread_team, whose sums
//! over E run in expert order: within the ulps router.hpp states of cpu_exec's, the map the same
//! except near-ties; the column sums and the loss (independent threads, fixed orders) are the
//! same bits on every context.
//!
//! logits [N, E], padding [N] (1 = padding token) or null; scores [N, E], map [N, E];
//! columns: E (micro-batch and global losses) or B E (per sequence: token n = s B + b is row s,
//! column b E + e of the scores viewed as [N / B, B E]).
#pragma once

#include <cstdint>

#include <moefold/core/config.hpp>

#include "router.hpp"
#include "router_block.hpp"
#include "simt/math.hpp"

namespace moefold::kernels {

//! What the aux losses see (Megatron-Core `compute_routing_scores_for_aux_loss`): scores over all
//! E (softmax, or the elementwise score renormalised over E) and their plain top-k map, without
//! bias, group limits or dropping; padding tokens get zero scores and no map entry. Every
//! element of scores and map is written.
template <class Team, class R = float>
struct basic_aux_scores_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  static constexpr bool cooperative = true;  // a team per token (a team of one on the host)
  static constexpr const char* name = Team::width == 32 ? "aux_scores" : "aux_scores_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr auto smem_bytes = Team::template smem_for<R>;

  const R* logits;
  const std::uint8_t* padding;  //!< [N] or null
  int num_tokens, num_experts, topk;
  score_function score;
  R* scores;          //!< [N, E]
  std::uint8_t* map;  //!< [N, E]: 1 where the expert is among the token's top k

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using team_t = detail_router::team_for<Team, Ctx, R>;
    constexpr int per_thread = team_t::per_thread, width = team_t::width;
    const R neg_inf = simt::neg_inf<R>();
    team_t tm(c);
    const int rank = tm.rank();
    const int n = team_t::slot_end(num_experts);  // the slots the thread's experts are in
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      const long long at = static_cast<long long>(t) * num_experts;
      R s[per_thread];
      detail_router::slot_flags<per_thread> chosen;  // j: expert rank + width j is in the top k
      chosen.clear(n);
      if (padding != nullptr && padding[t] != 0) {
        for (int j = 0; j < n; ++j) s[j] = R(0);
      } else {
        detail_router::load_row(tm, logits + at, num_experts, s);
        if (score == score_function::softmax) {
          detail_router::softmax(tm, s, num_experts);
        } else {
          R part = R(0);  // in slot order, then the team's: on a team of one, expert order
          for (int j = 0; j < n; ++j) {
            s[j] = rank + width * j < num_experts ? detail_router::elementwise_score(score, s[j])
                                                  : R(0);
            part = simt::add(part, s[j]);
          }
          const R d = simt::add(tm.sum(part), R(1e-20));
          for (int j = 0; j < n; ++j) s[j] = simt::div(s[j], d);
        }
        R sel[per_thread];
        for (int j = 0; j < n; ++j) sel[j] = rank + width * j < num_experts ? s[j] : neg_inf;
        for (int r = 0; r < topk; ++r) {
          R v = neg_inf;
          int i = 0x7fffffff;
          for (int j = 0; j < n; ++j)
            if (sel[j] > v) {  // strictly: the lower index stays on a tie
              v = sel[j];
              i = rank + width * j;
            }
          tm.argmax(v, i);
          detail_router::at_expert(tm, i, num_experts, [&](int j) {
            chosen.set(j);
            sel[j] = neg_inf;
          });
        }
      }
      for (int j = 0; j < n; ++j) {
        const int e = rank + width * j;
        if (e >= num_experts) continue;
        scores[at + e] = s[j];
        map[at + e] = static_cast<std::uint8_t>(chosen.bit(j));
      }
      tm.token_done();
    }
  }
};
using aux_scores_kernel = basic_aux_scores_kernel<detail_router::warp_per_token>;
using aux_scores_block_kernel = basic_aux_scores_kernel<detail_router::block_per_token>;

//! Column sums of the scores and counts of the map viewed as [rows, columns]: a thread per
//! column adds its rows in row order (the host's order: the same bits from the same scores).
//! Counts in double, as the host keeps them and as they are summed across ranks.
template <class R = float>
struct aux_column_sums_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "aux_column_sums";

  const R* scores;          //!< [rows, columns]
  const std::uint8_t* map;  //!< [rows, columns]
  long long rows;
  int columns;
  R* sums;         //!< [columns]
  double* counts;  //!< [columns]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (int col = c.block() * block_threads + c.thread(); col < columns;
         col += c.grid_blocks() * block_threads) {
      R s = R(0);
      double n = 0.0;
      for (long long r = 0; r < rows; ++r) {
        s = simt::add(s, scores[r * columns + col]);
        n = simt::add(n, static_cast<double>(map[r * columns + col]));
      }
      sums[col] = s;
      counts[col] = n;
    }
  }
};

//! The Switch/GShard loss (Megatron-Core `switch_load_balancing_loss_func`) from the column sums
//! and the counts summed over the statistics group:
//!   loss = coeff E / (k T^2) sum_col sums[col] counts[col] / divide_by,
//!   dscores[col] = counts[col] coeff E / (k T^2) / divide_by,
//! T = total_tokens, or, with total_tokens 0 (a padding mask), sum(counts) / per_token. The
//! global loss passes `running` [columns + 1]: the counts summed over this global batch's
//! micro-batches so far, which the kernel adds these counts to, then the number of those
//! micro-batches, which the kernel counts this one into: the counts used are running / steps. The
//! count lives on the device with the sums, so a CUDA graph that replays the forward advances
//! both. One thread, columns in order: the host's arithmetic, the same bits. T <= 0 gives loss 0
//! and zero gradients (no valid token anywhere); the micro-batch still counts.
template <class R = float>
struct switch_loss_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "switch_loss";

  const R* column_sums;  //!< [columns]
  const double* counts;  //!< [columns], summed over the group
  int columns;
  double total_tokens;  //!< T, or 0: sum(counts) / per_token
  double per_token;     //!< k (k B per sequence) under a padding mask
  int topk, num_experts;
  double coeff, divide_by;
  double* running;  //!< [columns + 1] the global loss's running counts and micro-batches, or null
  double* used;     //!< [columns] the counts the loss used (logging, tests), or null
  R* loss;          //!< [1]
  R* dscores;       //!< [columns] d loss / d scores[row, col], the same for every row

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() != 0 || c.thread() != 0) return;
    double steps = 0.0;  // with running: micro-batches so far, this one included
    if (running != nullptr) {
      running[columns] = simt::add(running[columns], 1.0);
      steps = running[columns];
    }
    double total = total_tokens;
    if (!(total > 0.0)) {
      double sum = 0.0;
      for (int col = 0; col < columns; ++col) sum = simt::add(sum, counts[col]);
      total = simt::div(sum, per_token);
    }
    if (!(total > 0.0)) {
      *loss = R(0);
      for (int col = 0; col < columns; ++col) dscores[col] = R(0);
      return;
    }
    const auto count = [&](int col) {
      if (running == nullptr) return counts[col];
      running[col] = simt::add(running[col], counts[col]);
      return simt::div(running[col], steps);
    };
    const R factor =
        static_cast<R>(simt::div(simt::mul(static_cast<double>(num_experts), coeff),
                                 simt::mul(simt::mul(static_cast<double>(topk), total), total)));
    const R divisor = static_cast<R>(divide_by);
    R dot = R(0);
    for (int col = 0; col < columns; ++col) {
      const double n = count(col);
      if (used != nullptr) used[col] = n;
      const R nf = static_cast<R>(n);
      dot = simt::add(dot, simt::mul(column_sums[col], nf));
      dscores[col] = simt::div(simt::mul(nf, factor), divisor);
    }
    *loss = simt::div(simt::mul(dot, factor), divisor);
  }
};

//! Adds seed * d loss / d logits to dlogits [N, E]: the scores' gradient dscores[(t E + e) %
//! columns] chained through the softmax (s_e (ds_e - <s, ds>)) or the renormalised elementwise
//! score ((ds_e / D - <ds, s> / D^2) score'(x_e), D = sum s + 1e-20). Padding tokens get
//! nothing. `seed` is the gradient of the training loss with respect to this loss (Megatron's
//! main_loss_backward_scale).
template <class Team, class R = float>
struct basic_aux_loss_backward_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  static constexpr bool cooperative = true;  // a team per token (a team of one on the host)
  static constexpr const char* name =
      Team::width == 32 ? "aux_loss_backward" : "aux_loss_backward_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr auto smem_bytes = Team::template smem_for<R>;

  const R* logits;
  const std::uint8_t* padding;  //!< [N] or null
  int num_tokens, num_experts;
  score_function score;
  const R* dscores;  //!< [columns], from switch_loss_kernel
  int columns;
  R seed;
  R* dlogits;  //!< [N, E], added to

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using team_t = detail_router::team_for<Team, Ctx, R>;
    constexpr int per_thread = team_t::per_thread, width = team_t::width;
    team_t tm(c);
    const int rank = tm.rank();
    const int n = team_t::slot_end(num_experts);  // the slots the thread's experts are in
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      if (padding != nullptr && padding[t] != 0) continue;  // the same on every thread of a team
      const long long at = static_cast<long long>(t) * num_experts;
      R x[per_thread], s[per_thread], ds[per_thread], dl[per_thread];
      detail_router::load_row(tm, logits + at, num_experts, x);
      for (int j = 0; j < n; ++j) {
        const int e = rank + width * j;
        ds[j] = e < num_experts ? simt::mul(seed, dscores[(at + e) % columns]) : R(0);
        s[j] = x[j];
      }
      // The sums over E in slot order, then the team's: on a team of one, expert order.
      if (score == score_function::softmax) {
        detail_router::softmax(tm, s, num_experts);
        R dot = R(0);
        for (int j = 0; j < n; ++j) dot = simt::add(dot, simt::mul(s[j], ds[j]));
        dot = tm.sum(dot);
        for (int j = 0; j < n; ++j) dl[j] = simt::mul(s[j], simt::add(ds[j], -dot));
      } else {
        R part = R(0), gpart = R(0);
        for (int j = 0; j < n; ++j) {
          s[j] =
              rank + width * j < num_experts ? detail_router::elementwise_score(score, x[j]) : R(0);
          part = simt::add(part, s[j]);
          gpart = simt::add(gpart, simt::mul(ds[j], s[j]));
        }
        const R d = simt::add(tm.sum(part), R(1e-20));
        const R gs = tm.sum(gpart);
        const R tail = simt::div(gs, simt::mul(d, d));
        for (int j = 0; j < n; ++j)
          dl[j] = rank + width * j < num_experts
                      ? simt::mul(simt::add(simt::div(ds[j], d), -tail),
                                  detail_router::score_grad(score, x[j], s[j]))
                      : R(0);
      }
      for (int j = 0; j < n; ++j) {
        const int e = rank + width * j;
        if (e < num_experts) dlogits[at + e] = simt::add(dlogits[at + e], dl[j]);
      }
      tm.token_done();
    }
  }
};
using aux_loss_backward_kernel = basic_aux_loss_backward_kernel<detail_router::warp_per_token>;
using aux_loss_backward_block_kernel =
    basic_aux_loss_backward_kernel<detail_router::block_per_token>;

}  // namespace moefold::kernels
