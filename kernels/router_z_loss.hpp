//! @file router_z_loss.hpp
//! @brief The router z-loss (ST-MoE, Megatron-Core `z_loss_func`; routing/aux_loss.hpp) as device
//! values: coeff * mean over valid tokens of logsumexp(logits[t])^2, and its gradient
//! seed * coeff * 2 lse_t softmax(logits[t]) / valid added to dlogits. Three launches: the
//! per-token logsumexp (a team per token), the total (one block, a fixed order), the backward (a
//! team per token, reading the forward's logsumexp and valid count from device memory). Pass
//! coeff already divided by |TP x CP|, as group_losses.hpp does.
//!
//! On a host context's team of one (host_exec) the team bodies run over
//! detail_router::one_thread_team and the total with one thread: the sums over E and over the
//! tokens run in expert and token order instead of the teams' trees, within the ulps router.hpp
//! states of cpu_exec's (the valid count is the same integer).
//!
//! logits [N, E], padding [N] (1 = padding token) or null; lse [N]; loss [1], valid [1].
#pragma once

#include <cstdint>

#include <moefold/core/config.hpp>

#include "router.hpp"
#include "router_block.hpp"
#include "simt/math.hpp"
#include "simt/warp.hpp"

namespace moefold::kernels {

//! lse[t] = max + log(sum exp(x - max)) over the token's E logits (the sum in the team's fixed
//! order: a GPU team's tree, a team of one's expert order); 0 for a padding token.
template <class Team, class R = float>
struct basic_logsumexp_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  static constexpr bool cooperative = true;  // a team per token (a team of one on the host)
  static constexpr const char* name = Team::width == 32 ? "logsumexp" : "logsumexp_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr auto smem_bytes = Team::template smem_for<R>;

  const R* logits;
  const std::uint8_t* padding;  //!< [N] or null
  int num_tokens, num_experts;
  R* lse;  //!< [N]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using team_t = detail_router::team_for<Team, Ctx, R>;
    constexpr int per_thread = team_t::per_thread, width = team_t::width;
    team_t tm(c);
    const int rank = tm.rank();
    const int n = team_t::slot_end(num_experts);  // the slots the thread's experts are in
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      if (padding != nullptr && padding[t] != 0) {
        if (rank == 0) lse[t] = R(0);
        continue;  // the same on every thread of a team
      }
      R x[per_thread];
      detail_router::load_row(tm, logits + static_cast<long long>(t) * num_experts, num_experts, x);
      R m = x[0];
      for (int j = 1; j < n; ++j) m = x[j] > m ? x[j] : m;
      m = tm.max(m);
      R part = R(0);
      for (int j = 0; j < n; ++j)
        if (rank + width * j < num_experts) part = simt::add(part, simt::exp(simt::add(x[j], -m)));
      const R sum = tm.sum(part);
      if (rank == 0) lse[t] = simt::add(m, simt::log(sum));
      tm.token_done();
    }
  }
};
using logsumexp_kernel = basic_logsumexp_kernel<detail_router::warp_per_token>;
using logsumexp_block_kernel = basic_logsumexp_kernel<detail_router::block_per_token>;

//! loss = coeff * sum_t lse[t]^2 / valid over the valid tokens (0 without one), valid = their
//! number. One block of 256 (on a GPU and cpu_exec): thread i adds tokens i, i + 256, ... in
//! order, then the warps' butterflies and the 8 warp sums in warp order: a fixed order, the same
//! bits on both. On a host context's team of one the one thread adds every token in order: the
//! same valid count, the loss within the ulps of a sum's order (router.hpp).
template <class R = float>
struct z_loss_total_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;  // a block's sum through shared memory
  static constexpr const char* name = "z_loss_total";
  static constexpr int warps = block_threads / 32;
  struct shared_state {
    R sum[warps];
    int valid[warps];
  };
  static constexpr auto smem_bytes = sizeof(shared_state);

  const R* lse;                 //!< [N]
  const std::uint8_t* padding;  //!< [N] or null
  int num_tokens;
  R coeff;
  R* loss;     //!< [1]
  int* valid;  //!< [1]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() != 0) return;  // one block does it all (a uniform exit: no barrier skipped)
    constexpr int threads = Ctx::block_threads, team_warps = threads / Ctx::warp_threads;
    static_assert(team_warps <= warps, "the team's warps fit the shared state");
    shared_state& sh = *c.template shared<shared_state>();
    R part = R(0);
    int n = 0;
    for (int t = c.thread(); t < num_tokens; t += threads) {
      if (padding != nullptr && padding[t] != 0) continue;
      part = simt::add(part, simt::mul(lse[t], lse[t]));
      ++n;
    }
    part = simt::warp_sum(c, part);
    n = simt::warp_sum(c, n);
    if (c.lane() == 0) {
      sh.sum[c.warp()] = part;
      sh.valid[c.warp()] = n;
    }
    c.sync();
    if (c.thread() != 0) return;
    R sum = R(0);
    int count = 0;
    for (int w = 0; w < team_warps; ++w) {
      sum = simt::add(sum, sh.sum[w]);
      count += sh.valid[w];
    }
    *valid = count;
    *loss = count > 0 ? simt::mul(simt::div(sum, static_cast<R>(count)), coeff) : R(0);
  }
};

//! dlogits[t, e] += seed * coeff * 2 lse[t] / valid * softmax(logits[t])_e for valid tokens.
template <class Team, class R = float>
struct basic_z_loss_backward_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  static constexpr bool cooperative = true;  // a team per token (a team of one on the host)
  static constexpr const char* name =
      Team::width == 32 ? "z_loss_backward" : "z_loss_backward_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr auto smem_bytes = Team::template smem_for<R>;

  const R* logits;
  const std::uint8_t* padding;  //!< [N] or null
  const R* lse;                 //!< [N], from the forward
  const int* valid;             //!< [1], from z_loss_total_kernel
  int num_tokens, num_experts;
  R coeff, seed;
  R* dlogits;  //!< [N, E], added to

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using team_t = detail_router::team_for<Team, Ctx, R>;
    constexpr int per_thread = team_t::per_thread, width = team_t::width;
    team_t tm(c);
    const int rank = tm.rank();
    const int n = *valid;
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      if (n <= 0 || (padding != nullptr && padding[t] != 0)) continue;  // uniform over a team
      const long long at = static_cast<long long>(t) * num_experts;
      R s[per_thread];
      detail_router::load_row(tm, logits + at, num_experts, s);
      detail_router::softmax(tm, s, num_experts);
      // The host's order: seed * coeff * 2 * lse / valid.
      const R f =
          simt::div(simt::mul(simt::mul(simt::mul(seed, coeff), R(2)), lse[t]), static_cast<R>(n));
      for (int j = 0; j < team_t::slot_end(num_experts); ++j) {
        const int e = rank + width * j;
        if (e < num_experts) dlogits[at + e] = simt::add(dlogits[at + e], simt::mul(f, s[j]));
      }
      tm.token_done();
    }
  }
};
using z_loss_backward_kernel = basic_z_loss_backward_kernel<detail_router::warp_per_token>;
using z_loss_backward_block_kernel = basic_z_loss_backward_kernel<detail_router::block_per_token>;

}  // namespace moefold::kernels
