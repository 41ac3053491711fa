//! @file router.hpp
//! @brief The router's forward, fused: score function, top-k (lower index first on ties), group
//! limits, expert bias, renormalisation and scaling, for every variant the host router has
//! (routing/topk_router.hpp): softmax before or after top-k, sigmoid, sqrt-softplus; and its
//! backward. The forward is one body over a team of threads per token: here a warp (E <= 256,
//! k <= 32, groups <= 32; lane l holds experts l, l + 32, ...), in router_block.hpp a block of
//! 128 (E <= 1,024). Each of the k selections is a team arg-max, and every sum over the k
//! selected values runs in selection order, as the host forms it. Scores use moefold's own exp
//! and log (kernels/simt/math.hpp): the CPU executor and the GPU give the same bits; against the
//! host router (the C library's exp) they agree to a few ulp.
//!
//! On a host context's team of one (host_exec: Ctx::block_threads == 1) the same bodies run over
//! detail_router::one_thread_team (chosen by detail_router::team_for): one thread holds every
//! expert (slot j = expert j, its loops stopping at E) and every selection, and the team's
//! reductions are loops over its own values. What that changes, and what it does not:
//! - the arg-maxes, the max, the group scores and every sum over the k selections (selection
//!   order) are the same operations: the same bits as cpu_exec and the GPU;
//! - every sum over E (a softmax's denominator over E, the softmax backward's dot product, the
//!   aux losses' renormalisation and dot products, the logsumexp) adds in expert order instead of
//!   the team's tree (each thread's 8 experts, then the butterfly, then the block's warps in
//!   order). Those results differ from cpu_exec's by the rounding of the two orders: a few ulp
//!   for small E, growing like sqrt(E) ulp over random logits (a random walk of E roundings), up
//!   to the orders' worst case, 2 E ulp, where the roundings add up (many equal terms); the
//!   bounds tests/kernels/router_kernel_test.cpp and router_losses_kernel_test.cpp state and
//!   check (host_ulps, host_ulps_worst). A selection made from such values (a softmax before
//!   top-k, the aux losses' map) is the same except where two different candidates are within
//!   those ulps (a near-tie); exact ties stay exact on each context (lower index first).
//!
//! logits [N, E] (row stride E), expert_bias [E] or null; out: indices [N, k], probs [N, k]
#pragma once

#include <type_traits>

#include <moefold/core/config.hpp>
#include <moefold/core/score_function.hpp>

#include "simt/math.hpp"
#include "simt/warp.hpp"

namespace moefold::kernels {

namespace detail_router {
constexpr int block_threads = 128;
constexpr int per_thread = 8;  //!< experts per thread of a GPU team: rank + width * j, j < 8

//! torch's softplus with threshold 20: the identity above it.
template <class R>
[[nodiscard]] MOEFOLD_HOST_DEVICE R softplus(R x) {
  return x > R(20) ? x : simt::log1p(simt::exp(x));
}
//! The sum of lanes 0..n-1's values, added in lane order (the host's order); on every lane.
template <class Ctx, class R>
[[nodiscard]] MOEFOLD_HOST_DEVICE R ordered_sum(Ctx& c, R v, int n) {
  R sum = R(0);
  for (int j = 0; j < n; ++j) sum = simt::add(sum, c.shfl_idx(v, j));
  return sum;
}

//! A warp per token (four tokens per block of 128): lane l holds experts l + 32 j; lane r keeps
//! the r-th selection in registers. Reductions are the warp's butterflies.
//!
//! What a team gives the bodies (this one, block_per_token's in router_block.hpp and
//! one_thread_team below): `width` threads per token; thread `rank()` holds the experts
//! rank() + width j in its slots j < per_thread, of which a loop over the experts below e visits
//! j < slot_end(e) (all per_thread on a GPU team: constant bounds, so that the slot arrays stay
//! in registers; on a team of one the slots below e, at least one) and a loop over the experts
//! from e on starts at slot_begin(e); it holds the selections rank() + width q in its slots
//! q < selections, of which a loop over k selections visits q < selection_end(k).
struct warp_per_token {
  static constexpr int width = 32;
  static constexpr int max_experts = width * per_thread;  //!< 256
  static constexpr int max_topk = 32;                     //!< lane r keeps selection r
  static constexpr int max_groups = 32;                   //!< lane g keeps group g's score
  template <class R>
  static constexpr std::size_t smem_for = 0;

  template <class Ctx, class R>
  struct team {
    static constexpr int width = warp_per_token::width;
    static constexpr int per_thread = detail_router::per_thread;
    static constexpr int selections = 1;  // lane r: selection r
    Ctx& c;
    int my_index = -1;                // lane r: selection r's expert
    R my_value = R(0);                // lane r: the value selection r's probability starts from
    R my_group = simt::neg_inf<R>();  // lane g: group g's score

    MOEFOLD_HOST_DEVICE explicit team(Ctx& ctx) : c(ctx) {}
    [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int slot_begin(int) { return 0; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int slot_end(int) { return per_thread; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int selection_end(int) { return selections; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int rank() const { return c.lane(); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int first_token() const {
      return c.block() * (block_threads / 32) + c.warp();
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int token_step() const {
      return c.grid_blocks() * (block_threads / 32);
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R max(R v) { return simt::warp_max(c, v); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R sum(R v) { return simt::warp_sum(c, v); }
    MOEFOLD_HOST_DEVICE void argmax(R& v, int& i) { simt::warp_argmax(c, v, i); }
    //! Round r chose expert i; `owner_value` is meaningful on its owner (rank i % 32) only,
    //! which hands it over.
    MOEFOLD_HOST_DEVICE void record(int r, int i, R owner_value) {
      const R chosen = c.shfl_idx(owner_value, i % width);
      if (c.lane() == r) {
        my_index = i;
        my_value = chosen;
      }
    }
    MOEFOLD_HOST_DEVICE void records_done() {}
    //! Ranks r < k hand their selections' (index, value) to every lane: shared_index(r),
    //! shared_value(r) until unshare().
    MOEFOLD_HOST_DEVICE void share(int, const int (&index)[selections],
                                   const R (&value)[selections]) {
      my_index = index[0];
      my_value = value[0];
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int shared_index(int r) { return c.shfl_idx(my_index, r); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R shared_value(int r) { return c.shfl_idx(my_value, r); }
    MOEFOLD_HOST_DEVICE void unshare() {}
    //! The expert and value of selection rank() + width q (meaningful below k).
    [[nodiscard]] MOEFOLD_HOST_DEVICE int selected_index(int) const { return my_index; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R selected_value(int) const { return my_value; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE R first_value() { return c.shfl_idx(my_value, 0); }
    //! f(value) summed over the k selections in selection order, on every lane.
    template <class F>
    [[nodiscard]] MOEFOLD_HOST_DEVICE R ordered_sum(int k, F f) {
      return detail_router::ordered_sum(c, c.lane() < k ? f(my_value) : R(0), k);
    }
    MOEFOLD_HOST_DEVICE void set_group_score(int g, R s) {
      if (c.lane() == g) my_group = s;
    }
    //! Bit g: group g is among the `keep` best of `groups` (lower group first on a tie).
    [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned kept_groups(int groups, int keep) {
      unsigned kept = 0;
      R gv = my_group;
      for (int r = 0; r < keep; ++r) {
        R v = gv;
        int i = c.lane() < groups ? c.lane() : 0x7fffffff;
        simt::warp_argmax(c, v, i);
        kept |= 1u << i;
        if (c.lane() == i) gv = simt::neg_inf<R>();
      }
      my_group = simt::neg_inf<R>();
      return kept;
    }
    //! Back to the initial values: none of the token's state stays live into the next token.
    MOEFOLD_HOST_DEVICE void token_done() {
      my_index = -1;
      my_value = R(0);
    }
  };
};

//! A team of one thread per token (a host context's team of one, Ctx::block_threads == 1) with
//! Team's limits: the thread holds every expert (slot j: expert j, j < Team::max_experts; loops
//! stop at E) and every selection (slot q: selection q, q < Team::max_topk; loops stop at k). A
//! reduction over the team is the thread's own value; the sums over E the bodies form from their
//! slots run in expert order (the top of this file says what that changes).
template <class Team, class Ctx, class R>
struct one_thread_team {
  static constexpr int width = 1;
  static constexpr int per_thread = Team::max_experts;
  static constexpr int selections = Team::max_topk;
  Ctx& c;
  int index[selections] = {};      // selection q's expert
  R value[selections] = {};        // selection q's value (what its probability starts from)
  R group[Team::max_groups] = {};  // group g's score

  MOEFOLD_HOST_DEVICE explicit one_thread_team(Ctx& ctx) : c(ctx) {}
  //! The slots of the experts from e on / below e: at least one, as a GPU team's thread holds all
  //! of its slots whatever E is (slots past E hold -inf or 0).
  [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int slot_begin(int e) {
    return e < 0 ? 0 : e < per_thread ? e : per_thread;
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int slot_end(int e) {
    return e < 1 ? 1 : e < per_thread ? e : per_thread;
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE static constexpr int selection_end(int k) {
    return k < 1 ? 1 : k < selections ? k : selections;
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int rank() const { return 0; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int first_token() const { return c.block(); }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int token_step() const { return c.grid_blocks(); }
  [[nodiscard]] MOEFOLD_HOST_DEVICE R max(R v) const { return v; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE R sum(R v) const { return v; }
  MOEFOLD_HOST_DEVICE void argmax(R&, int&) const {}
  //! Round r chose expert i (rounds past max_topk, which no GPU team's thread keeps, neither).
  MOEFOLD_HOST_DEVICE void record(int r, int i, R owner_value) {
    if (r >= selections) return;
    index[r] = i;
    value[r] = owner_value;
  }
  MOEFOLD_HOST_DEVICE void records_done() const {}
  MOEFOLD_HOST_DEVICE void share(int k, const int (&idx)[selections], const R (&val)[selections]) {
    for (int q = 0; q < k && q < selections; ++q) {
      index[q] = idx[q];
      value[q] = val[q];
    }
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int shared_index(int r) const { return index[r]; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE R shared_value(int r) const { return value[r]; }
  MOEFOLD_HOST_DEVICE void unshare() const {}
  [[nodiscard]] MOEFOLD_HOST_DEVICE int selected_index(int q) const { return index[q]; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE R selected_value(int q) const { return value[q]; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE R first_value() const { return value[0]; }
  //! f(value) summed over the k selections in selection order.
  template <class F>
  [[nodiscard]] MOEFOLD_HOST_DEVICE R ordered_sum(int k, F f) const {
    R s = R(0);
    for (int j = 0; j < k; ++j) s = simt::add(s, f(value[j]));
    return s;
  }
  MOEFOLD_HOST_DEVICE void set_group_score(int g, R s) {
    if (g < Team::max_groups) group[g] = s;
  }
  //! Bit g: group g is among the `keep` best of `groups` (lower group first on a tie).
  [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned kept_groups(int groups, int keep) const {
    unsigned kept = 0;
    for (int r = 0; r < keep; ++r) {
      int best = -1;
      for (int g = 0; g < groups; ++g)
        if (!((kept >> g) & 1u) && (best < 0 || group[g] > group[best])) best = g;
      kept |= 1u << best;
    }
    return kept;
  }
  MOEFOLD_HOST_DEVICE void token_done() const {}
};

//! The team a body over Team runs with on context Ctx: Team's own (a warp or a block per token),
//! or one thread per token on a host context's team of one.
template <class Team, class Ctx, class R>
using team_for = std::conditional_t<Ctx::block_threads == 1, one_thread_team<Team, Ctx, R>,
                                    typename Team::template team<Ctx, R>>;

//! One flag per slot of a thread, below n after clear(n): a bitmask over a GPU team's 8 slots
//! (one register), a bool per slot over a team of one's.
template <int P, bool Mask = (P <= 32)>
struct slot_flags {
  unsigned bits = 0;
  MOEFOLD_HOST_DEVICE void clear(int) { bits = 0; }
  MOEFOLD_HOST_DEVICE void set(int j) { bits |= 1u << j; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned bit(int j) const { return (bits >> j) & 1u; }
};
template <int P>
struct slot_flags<P, false> {
  bool on[P];
  MOEFOLD_HOST_DEVICE void clear(int n) {
    for (int j = 0; j < n; ++j) on[j] = false;
  }
  MOEFOLD_HOST_DEVICE void set(int j) { on[j] = true; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned bit(int j) const { return on[j] ? 1u : 0u; }
};

//! f(j) for the slot j in which the calling thread holds expert e, if it holds e: on a GPU team a
//! loop over the constant slots (the arrays stay in registers), on a team of one slot e itself
//! (when e is in [0, E): no thread holds another index).
template <class T, class F>
MOEFOLD_HOST_DEVICE void at_expert(const T& tm, int e, int num_experts, F f) {
  if constexpr (T::width == 1) {
    if (e >= 0 && e < num_experts && e < T::per_thread) f(e);
  } else {
    for (int j = 0; j < T::per_thread; ++j)
      if (e == tm.rank() + T::width * j) f(j);
  }
}

//! The elementwise score (sigmoid or sqrt-softplus) of x.
template <class R>
[[nodiscard]] MOEFOLD_HOST_DEVICE R elementwise_score(score_function f, R x) {
  return f == score_function::sigmoid ? simt::sigmoid(x) : simt::sqrt(softplus(x));
}
//! d score / d x from x and the score sk, as routing/score_function.hpp's
//! elementwise_score_grad (sqrt-softplus: 0 where the score underflowed to 0).
template <class R>
[[nodiscard]] MOEFOLD_HOST_DEVICE R score_grad(score_function f, R x, R sk) {
  if (f == score_function::sigmoid) return simt::mul(sk, simt::add(R(1), -sk));
  if (!(sk > R(0))) return R(0);
  const R sp_grad = x > R(20) ? R(1) : simt::sigmoid(x);
  return simt::div(sp_grad, simt::mul(R(2), sk));
}

//! The team's logits of experts rank + width j (-inf past E), slots j < slot_end(E).
template <class Team, class R, int P>
MOEFOLD_HOST_DEVICE void load_row(Team& tm, const R* row, int num_experts, R (&s)[P]) {
  for (int j = 0; j < Team::slot_end(num_experts); ++j) {
    const int e = tm.rank() + Team::width * j;
    s[j] = e < num_experts ? row[e] : simt::neg_inf<R>();
  }
}
//! softmax over the team's E values in place (max-subtracted; the sum in the team's fixed
//! reduction order: a GPU team's tree, a team of one's expert order); 0 past E.
template <class Team, class R, int P>
MOEFOLD_HOST_DEVICE void softmax(Team& tm, R (&s)[P], int num_experts) {
  const int n = Team::slot_end(num_experts);
  R m = s[0];
  for (int j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
  m = tm.max(m);
  R part = R(0);
  for (int j = 0; j < n; ++j) {
    s[j] = tm.rank() + Team::width * j < num_experts ? simt::exp(simt::add(s[j], -m)) : R(0);
    part = simt::add(part, s[j]);
  }
  const R sum = tm.sum(part);
  for (int j = 0; j < n; ++j)
    s[j] = tm.rank() + Team::width * j < num_experts ? simt::div(s[j], sum) : R(0);
}
}  // namespace detail_router

//! The router's forward over a team of threads per token (Team: detail_router::warp_per_token
//! here, block_per_token in router_block.hpp). One parameter list and one body for both.
template <class Team, class R = float>
struct basic_router_topk_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  static constexpr bool cooperative = true;  // a team per token (a team of one on the host)
  // Named as every team-generic kernel is: the block team's gets the suffix _block.
  static constexpr const char* name = Team::width == 32 ? "router_topk" : "router_topk_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr int max_topk = Team::max_topk;
  static constexpr int max_groups = Team::max_groups;
  static constexpr auto smem_bytes = Team::template smem_for<R>;

  const R* logits;
  int num_tokens, num_experts, topk;
  score_function score;
  bool pre_softmax;
  int num_groups;  //!< 0: no group limit
  int group_topk;
  const float* expert_bias;  //!< [E] added to the selection scores, or null
  bool scale;                //!< probabilities times scaling_factor
  R scaling_factor;
  int* indices;  //!< [N, k]
  R* probs;      //!< [N, k]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using team_t = detail_router::team_for<Team, Ctx, R>;
    constexpr int per_thread = team_t::per_thread, width = team_t::width;
    const R neg_inf = simt::neg_inf<R>();
    team_t tm(c);
    const int rank = tm.rank();
    const int n = team_t::slot_end(num_experts);  // the slots the thread's experts are in
    const int nq = team_t::selection_end(topk);   // the slots of the thread's selections
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      const R* row = logits + static_cast<long long>(t) * num_experts;
      R s[per_thread], sel[per_thread];  // experts rank + width j: score, selection value
      detail_router::load_row(tm, row, num_experts, s);
      if (score == score_function::softmax) {
        if (pre_softmax) detail_router::softmax(tm, s, num_experts);
        for (int j = 0; j < n; ++j) sel[j] = rank + width * j < num_experts ? s[j] : neg_inf;
      } else {
        for (int j = 0; j < n; ++j) {
          const int e = rank + width * j;
          if (e >= num_experts) {
            sel[j] = neg_inf;
            continue;
          }
          s[j] = detail_router::elementwise_score(score, s[j]);
          sel[j] = expert_bias ? simt::add(s[j], static_cast<R>(expert_bias[e])) : s[j];
        }
      }

      if (num_groups > 0) mask_groups(tm, sel, neg_inf);

      // k rounds of arg-max; the owner of the chosen expert hands over the value its
      // probability starts from (the selected logit, or the score without the bias) and
      // retires it.
      for (int r = 0; r < topk; ++r) {
        R v = neg_inf;
        int i = 0x7fffffff;
        for (int j = 0; j < n; ++j)
          if (sel[j] > v) {  // strictly: the lower index (smaller j) stays on a tie
            v = sel[j];
            i = rank + width * j;
          }
        tm.argmax(v, i);
        R owned = R(0);
        detail_router::at_expert(tm, i, num_experts, [&](int j) {
          owned = s[j];
          sel[j] = neg_inf;
        });
        tm.record(r, i, owned);
      }
      tm.records_done();

      // Probabilities, every sum in selection order (selection 0 first), as the host: the
      // thread's selections rank + width q.
      R p[team_t::selections];
      for (int q = 0; q < nq; ++q) p[q] = rank + width * q < topk ? tm.selected_value(q) : R(0);
      if (score == score_function::softmax && !pre_softmax) {
        const R top = tm.first_value();  // the largest selected logit
        const auto e = [top](R x) { return simt::exp(simt::add(x, -top)); };
        const R sum = tm.ordered_sum(topk, e);
        for (int q = 0; q < nq; ++q)
          p[q] = rank + width * q < topk ? simt::div(e(p[q]), sum) : R(0);
      } else if (score != score_function::softmax && topk > 1) {
        const R sum = tm.ordered_sum(topk, [](R x) { return x; });
        for (int q = 0; q < nq; ++q) p[q] = simt::div(p[q], simt::add(sum, R(1e-20)));
      }
      for (int q = 0; q < nq; ++q) {
        const int r = rank + width * q;
        if (scale) p[q] = simt::mul(p[q], scaling_factor);
        if (r < topk) {
          indices[static_cast<long long>(t) * topk + r] = tm.selected_index(q);
          probs[static_cast<long long>(t) * topk + r] = p[q];
        }
      }
      tm.token_done();
    }
  }

 private:
  //! Group-limited routing: a group scores the sum of its top (k / group_topk) selection values
  //! (in descending order, as torch sums them); the group_topk best groups stay (lower group
  //! first on a tie); the other experts' selection values become -inf.
  template <class T>
  MOEFOLD_HOST_DEVICE void mask_groups(T& tm, R* sel, R neg_inf) const {
    constexpr int per_thread = T::per_thread, width = T::width;
    const int rank = tm.rank();
    const int per = num_experts / num_groups, take = topk / group_topk;
    for (int g = 0; g < num_groups; ++g) {
      // The slots of the group's experts (all slots on a GPU team, masked by the test below).
      const int lo = T::slot_begin(g * per), hi = T::slot_end((g + 1) * per);
      R tmp[per_thread];
      for (int j = lo; j < hi; ++j) {
        const int e = rank + width * j;
        tmp[j] = e >= g * per && e < (g + 1) * per ? sel[j] : neg_inf;
      }
      R sum = R(0);
      for (int r = 0; r < take; ++r) {
        R v = neg_inf;
        int i = 0x7fffffff;
        for (int j = lo; j < hi; ++j)
          if (tmp[j] > v) {
            v = tmp[j];
            i = rank + width * j;
          }
        tm.argmax(v, i);
        sum = simt::add(sum, v);
        detail_router::at_expert(tm, i, num_experts, [&](int j) { tmp[j] = neg_inf; });
      }
      tm.set_group_score(g, sum);
    }
    const unsigned kept = tm.kept_groups(num_groups, group_topk);  // bit g: group g stays
    for (int j = 0; j < T::slot_end(num_experts); ++j) {
      const int e = rank + width * j;
      if (e < num_experts && !((kept >> (e / per)) & 1u)) sel[j] = neg_inf;
    }
  }
};

//! The router's forward, a warp per token (E <= 256).
using router_topk_kernel = basic_router_topk_kernel<detail_router::warp_per_token>;

//! The router's backward over a team of threads per token (a warp: E <= 256; a block of 128 in
//! router_block.hpp: E <= 1,024; k <= 32): from dprobs [N, k] (the gradient of the routed
//! probabilities) to dlogits [N, E] (every element written; experts not selected get 0, or, with
//! a softmax before top-k, their share of the softmax's gradient). The selection, group masks and
//! expert bias carry no gradient, as on the host (topk_router::backward). Sums over the k
//! selected in selection order as the host forms them; the softmax-before-top-k dot product over
//! E (and its softmax's sum) in the team's fixed reduction order (on a team of one: expert order,
//! the top of this file says what that changes). An index outside [0, E) (not the forward's)
//! contributes nothing instead of reading out of bounds.
//!
//! logits [N, E], indices [N, k] (the forward's), dprobs [N, k]; out: dlogits [N, E]
template <class Team, class R = float>
struct basic_router_backward_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  static constexpr bool cooperative = true;  // a team per token (a team of one on the host)
  static constexpr const char* name =
      Team::width == 32 ? "router_backward" : "router_backward_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr int max_topk = Team::max_topk;
  static constexpr auto smem_bytes = Team::template smem_for<R>;

  const R* logits;
  const int* indices;
  const R* dprobs;
  int num_tokens, num_experts, topk;
  score_function score;
  bool pre_softmax;
  bool scale;
  R scaling_factor;
  R* dlogits;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using team_t = detail_router::team_for<Team, Ctx, R>;
    constexpr int per_thread = team_t::per_thread, width = team_t::width;
    constexpr int sels = team_t::selections;
    team_t tm(c);
    const int rank = tm.rank();
    const int n = team_t::slot_end(num_experts), nq = team_t::selection_end(topk);
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      const R* row = logits + static_cast<long long>(t) * num_experts;
      R* drow = dlogits + static_cast<long long>(t) * num_experts;
      const long long base = static_cast<long long>(t) * topk;
      // The thread's selections r = rank + width q < k: expert and gradient (times the scaling
      // factor).
      int my_index[sels];
      R g[sels];
      for (int q = 0; q < nq; ++q) {
        const int r = rank + width * q;
        my_index[q] = r < topk ? indices[base + r] : -1;
        g[q] = r < topk ? dprobs[base + r] : R(0);
        if (scale) g[q] = simt::mul(g[q], scaling_factor);
      }
      R out[per_thread];  // the thread's experts rank + width j
      for (int j = 0; j < n; ++j) out[j] = R(0);
      if (score == score_function::softmax && pre_softmax) {
        // s = softmax(row); ds = the selections' gradients scattered; ds_e -> s_e (ds_e - <s, ds>).
        R s[per_thread], ds[per_thread];
        for (int j = 0; j < n; ++j) ds[j] = R(0);
        detail_router::load_row(tm, row, num_experts, s);
        detail_router::softmax(tm, s, num_experts);
        tm.share(topk, my_index, g);
        for (int r = 0; r < topk; ++r) {
          const int e = tm.shared_index(r);
          const R gr = tm.shared_value(r);
          // A constant index on a GPU team: the array stays in registers.
          detail_router::at_expert(tm, e, num_experts,
                                   [&](int j) { ds[j] = simt::add(ds[j], gr); });
        }
        tm.unshare();
        R dot = R(0);  // in slot order, then the team's: on a team of one, expert order
        for (int j = 0; j < n; ++j) dot = simt::add(dot, simt::mul(s[j], ds[j]));
        dot = tm.sum(dot);
        for (int j = 0; j < n; ++j) out[j] = simt::mul(s[j], simt::add(ds[j], -dot));
      } else {
        R x[sels], gx[sels];  // the selected logit, d loss / d x
        for (int q = 0; q < nq; ++q) {
          const bool valid =
              rank + width * q < topk && my_index[q] >= 0 && my_index[q] < num_experts;
          x[q] = valid ? row[my_index[q]] : R(0);
        }
        if (score == score_function::softmax) {
          // p = softmax over the k selected logits; dx_i = p_i (g_i - <p, g>).
          const R top = held(tm, x, 0);  // the largest selected logit
          R p[sels], pg[sels];
          for (int q = 0; q < nq; ++q)
            p[q] = rank + width * q < topk ? simt::exp(simt::add(x[q], -top)) : R(0);
          const R z = held_sum(tm, p);
          for (int q = 0; q < nq; ++q) {
            p[q] = simt::div(p[q], z);
            pg[q] = rank + width * q < topk ? simt::mul(p[q], g[q]) : R(0);
          }
          const R dot = held_sum(tm, pg);
          for (int q = 0; q < nq; ++q) gx[q] = simt::mul(p[q], simt::add(g[q], -dot));
        } else {
          R sk[sels], gs[sels];
          for (int q = 0; q < nq; ++q) {
            sk[q] = rank + width * q < topk ? detail_router::elementwise_score(score, x[q]) : R(0);
            gs[q] = g[q];
          }
          if (topk > 1) {
            // p_i = s_i / D, D = sum s + 1e-20: ds_i = g_i / D - <g, s> / D^2.
            const R d = simt::add(held_sum(tm, sk), R(1e-20));
            R gsk[sels];
            for (int q = 0; q < nq; ++q)
              gsk[q] = rank + width * q < topk ? simt::mul(g[q], sk[q]) : R(0);
            const R gsum = held_sum(tm, gsk);
            for (int q = 0; q < nq; ++q)
              gs[q] = simt::add(simt::div(g[q], d), -simt::div(gsum, simt::mul(d, d)));
          }
          for (int q = 0; q < nq; ++q)
            gx[q] = simt::mul(gs[q], detail_router::score_grad(score, x[q], sk[q]));
        }
        tm.share(topk, my_index, gx);
        for (int r = 0; r < topk; ++r) {
          const int e = tm.shared_index(r);
          const R gr = tm.shared_value(r);
          detail_router::at_expert(tm, e, num_experts, [&](int j) { out[j] = gr; });
        }
        tm.unshare();
      }
      for (int j = 0; j < n; ++j) {
        const int e = rank + width * j;
        if (e < num_experts) drow[e] = out[j];
      }
      tm.token_done();
    }
  }

 private:
  // Selection r's v (the thread holding it passes its slots' values), on every thread.
  template <class T, int S>
  MOEFOLD_HOST_DEVICE static R held(T& tm, const R (&v)[S], int r) {
    int none[S];
    for (int q = 0; q < S; ++q) none[q] = -1;
    tm.share(r + 1, none, v);
    const R out = tm.shared_value(r);
    tm.unshare();
    return out;
  }
  // The sum of selections 0..k-1's v, added in selection order, on every thread.
  template <class T, int S>
  MOEFOLD_HOST_DEVICE R held_sum(T& tm, const R (&v)[S]) const {
    int none[S];
    for (int q = 0; q < S; ++q) none[q] = -1;
    tm.share(topk, none, v);
    R sum = R(0);
    for (int j = 0; j < topk; ++j) sum = simt::add(sum, tm.shared_value(j));
    tm.unshare();
    return sum;
  }
};

//! The router's backward, a warp per token (E <= 256).
using router_backward_kernel = basic_router_backward_kernel<detail_router::warp_per_token>;

}  // namespace moefold::kernels
