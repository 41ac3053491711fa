//! @file router_block.hpp
//! @brief The router's forward for many experts: one block of 128 threads per token (E <= 1,024,
//! thread i holding experts i + 128 j, j < 8), where router.hpp's warp per token stops at 256.
//! The same body as router_topk_kernel (basic_router_topk_kernel) over a block team: a block
//! reduction is a warp reduction per warp, then the four warp results combined in warp order
//! from shared memory, so its order is fixed and the CPU executor and the GPU give the same
//! bits. The k selections go to shared memory as they are made. On a host context's team of one
//! the same body runs over detail_router::one_thread_team with this team's limits (E <= 1,024,
//! k <= 32, groups <= 32; router.hpp says what that changes).
//!
//! logits [N, E] (row stride E), expert_bias [E] or null; out: indices [N, k], probs [N, k]
#pragma once

#include <cstddef>

#include <moefold/core/config.hpp>

#include "router.hpp"
#include "simt/math.hpp"
#include "simt/warp.hpp"

namespace moefold::kernels {

namespace detail_router {
//! A block per token: thread i holds experts i + 128 j; the selections and group scores live in
//! shared memory.
struct block_per_token {
  static constexpr int width = block_threads;
  static constexpr int warps = block_threads / 32;
  static constexpr int max_experts = width * per_thread;  //!< 1,024
  static constexpr int max_topk = 32;
  static constexpr int max_groups = 32;

  //! Shared memory: the reductions' per-warp values, the selections, the group scores.
  template <class R>
  struct shared_state {
    R red_v[warps];
    int red_i[warps];
    int sel_index[max_topk];
    R sel_value[max_topk];  // the score (or logit) each selection's probability starts from
    R group_score[max_groups];
  };
  template <class R>
  static constexpr std::size_t smem_for = sizeof(shared_state<R>);

  template <class Ctx, class R>
  struct team {
    static constexpr int width = block_per_token::width;
    static constexpr int per_thread = detail_router::per_thread;
    static constexpr int selections = (max_topk + width - 1) / width;  // 1: thread r, selection r
    Ctx& c;
    shared_state<R>& sh;

    MOEFOLD_HOST_DEVICE explicit team(Ctx& ctx)
        : c(ctx), sh(*ctx.template shared<shared_state<R>>()) {}
    //! All slots (constant bounds), as warp_per_token's team (router.hpp says what they mean).
    [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int slot_begin(int) { return 0; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int slot_end(int) { return per_thread; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int selection_end(int) { return selections; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int rank() const { return c.thread(); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int first_token() const { return c.block(); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int token_step() const { return c.grid_blocks(); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R max(R v) {
      v = simt::warp_max(c, v);
      if (c.lane() == 0) sh.red_v[c.warp()] = v;
      c.sync();
      R m = sh.red_v[0];
      for (int w = 1; w < warps; ++w) m = sh.red_v[w] > m ? sh.red_v[w] : m;
      c.sync();
      return m;
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R sum(R v) {
      v = simt::warp_sum(c, v);
      if (c.lane() == 0) sh.red_v[c.warp()] = v;
      c.sync();
      R s = sh.red_v[0];
      for (int w = 1; w < warps; ++w) s = simt::add(s, sh.red_v[w]);
      c.sync();
      return s;
    }
    //! (value, index) of the block's largest value, the lower index on a tie; on every thread.
    MOEFOLD_HOST_DEVICE void argmax(R& v, int& i) {
      simt::warp_argmax(c, v, i);
      if (c.lane() == 0) {
        sh.red_v[c.warp()] = v;
        sh.red_i[c.warp()] = i;
      }
      c.sync();
      v = sh.red_v[0];
      i = sh.red_i[0];
      for (int w = 1; w < warps; ++w)
        if (sh.red_v[w] > v || (sh.red_v[w] == v && sh.red_i[w] < i)) {
          v = sh.red_v[w];
          i = sh.red_i[w];
        }
      c.sync();
    }
    //! Round r chose expert i; its owner (thread i % 128) records it.
    MOEFOLD_HOST_DEVICE void record(int r, int i, R owner_value) {
      if (c.thread() == i % width) {
        sh.sel_index[r] = i;
        sh.sel_value[r] = owner_value;
      }
    }
    //! The selections, written by their owners, are read by every thread after this.
    MOEFOLD_HOST_DEVICE void records_done() { c.sync(); }
    //! The threads' selections r < k hand (index, value) to every thread through shared memory
    //! (the selection slots): shared_index(r), shared_value(r) until unshare().
    MOEFOLD_HOST_DEVICE void share(int k, const int (&index)[selections],
                                   const R (&value)[selections]) {
      for (int q = 0; q < selections; ++q) {
        const int r = c.thread() + width * q;
        if (r < k) {
          sh.sel_index[r] = index[q];
          sh.sel_value[r] = value[q];
        }
      }
      c.sync();
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int shared_index(int r) const { return sh.sel_index[r]; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R shared_value(int r) const { return sh.sel_value[r]; }
    //! The slots are read by every thread before anyone writes them again.
    MOEFOLD_HOST_DEVICE void unshare() { c.sync(); }
    //! The expert and value of selection thread() + width q (below k only).
    [[nodiscard]] MOEFOLD_HOST_DEVICE int selected_index(int q) const {
      return sh.sel_index[c.thread() + width * q];
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R selected_value(int q) const {
      return sh.sel_value[c.thread() + width * q];
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R first_value() const { return sh.sel_value[0]; }
    template <class F>
    [[nodiscard]] MOEFOLD_HOST_DEVICE R ordered_sum(int k, F f) const {
      R s = R(0);
      for (int j = 0; j < k; ++j) s = simt::add(s, f(sh.sel_value[j]));
      return s;
    }
    MOEFOLD_HOST_DEVICE void set_group_score(int g, R s) {
      if (c.thread() == 0) sh.group_score[g] = s;
    }
    //! Bit g: group g is among the `keep` best (lower group first on a tie), chosen by every
    //! thread from shared memory.
    [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned kept_groups(int groups, int keep) {
      c.sync();
      unsigned kept = 0;
      for (int r = 0; r < keep; ++r) {
        int best = -1;
        for (int g = 0; g < groups; ++g)
          if (!((kept >> g) & 1u) && (best < 0 || sh.group_score[g] > sh.group_score[best]))
            best = g;
        kept |= 1u << best;
      }
      c.sync();  // group_score is read above before anyone writes shared state again
      return kept;
    }
    //! Shared state is reused by the next token.
    MOEFOLD_HOST_DEVICE void token_done() { c.sync(); }
  };
};
}  // namespace detail_router

//! The router's forward, a block of 128 threads per token (E <= 1,024).
using router_topk_block_kernel = basic_router_topk_kernel<detail_router::block_per_token>;
//! Its backward, a block of 128 threads per token (E <= 1,024).
using router_backward_block_kernel = basic_router_backward_kernel<detail_router::block_per_token>;

}  // namespace moefold::kernels
