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
//! logits [N, E] (row stride E), expert_bias [E] or null; out: indices [N, k], probs [N, k]
#pragma once

#include <moefold/core/config.hpp>
#include <moefold/core/score_function.hpp>

#include "simt/math.hpp"
#include "simt/warp.hpp"

namespace moefold::kernels {

namespace detail_router {
constexpr int block_threads = 128;
constexpr int per_thread = 8;  //!< experts per thread: rank + width * j, j < 8

//! torch's softplus with threshold 20: the identity above it.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float softplus(float x) {
  return x > 20.0f ? x : simt::log1p(simt::exp(x));
}
//! The sum of lanes 0..n-1's values, added in lane order (the host's order); on every lane.
template <class Ctx>
[[nodiscard]] MOEFOLD_HOST_DEVICE float ordered_sum(Ctx& c, float v, int n) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum = simt::add(sum, c.shfl_idx(v, j));
  return sum;
}

//! A warp per token (four tokens per block of 128): lane l holds experts l + 32 j; lane r keeps
//! the r-th selection in registers. Reductions are the warp's butterflies.
struct warp_per_token {
  static constexpr int width = 32;
  static constexpr int max_experts = width * per_thread;  //!< 256
  static constexpr int max_topk = 32;                     //!< lane r keeps selection r
  static constexpr int max_groups = 32;                   //!< lane g keeps group g's score
  static constexpr int smem_bytes = 0;

  template <class Ctx>
  struct team {
    static constexpr int width = warp_per_token::width;
    Ctx& c;
    int my_index = -1;      // lane r: selection r's expert
    float my_value = 0.0f;  // lane r: the value selection r's probability starts from
    float my_group = simt::bits_float(0xff800000u);  // lane g: group g's score

    MOEFOLD_HOST_DEVICE explicit team(Ctx& ctx) : c(ctx) {}
    [[nodiscard]] MOEFOLD_HOST_DEVICE int rank() const { return c.lane(); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int first_token() const {
      return c.block() * (block_threads / 32) + c.warp();
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int token_step() const {
      return c.grid_blocks() * (block_threads / 32);
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE float max(float v) { return simt::warp_max(c, v); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE float sum(float v) { return simt::warp_sum(c, v); }
    MOEFOLD_HOST_DEVICE void argmax(float& v, int& i) { simt::warp_argmax(c, v, i); }
    //! Round r chose expert i; `owner_value` is meaningful on its owner (rank i % 32) only,
    //! which hands it over.
    MOEFOLD_HOST_DEVICE void record(int r, int i, float owner_value) {
      const float chosen = c.shfl_idx(owner_value, i % width);
      if (c.lane() == r) {
        my_index = i;
        my_value = chosen;
      }
    }
    MOEFOLD_HOST_DEVICE void records_done() {}
    //! Ranks r < k hand (index, value) to every lane: shared_index(r), shared_value(r) until
    //! unshare().
    MOEFOLD_HOST_DEVICE void share(int, int index, float value) {
      my_index = index;
      my_value = value;
    }
    [[nodiscard]] MOEFOLD_HOST_DEVICE int shared_index(int r) { return c.shfl_idx(my_index, r); }
    [[nodiscard]] MOEFOLD_HOST_DEVICE float shared_value(int r) { return c.shfl_idx(my_value, r); }
    MOEFOLD_HOST_DEVICE void unshare() {}
    //! Selection rank()'s expert and value (meaningful for rank() < k).
    [[nodiscard]] MOEFOLD_HOST_DEVICE int selected_index() const { return my_index; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE float selected_value() const { return my_value; }
    [[nodiscard]] MOEFOLD_HOST_DEVICE float first_value() { return c.shfl_idx(my_value, 0); }
    //! f(value) summed over the k selections in selection order, on every lane.
    template <class F>
    [[nodiscard]] MOEFOLD_HOST_DEVICE float ordered_sum(int k, F f) {
      return detail_router::ordered_sum(c, c.lane() < k ? f(my_value) : 0.0f, k);
    }
    MOEFOLD_HOST_DEVICE void set_group_score(int g, float s) {
      if (c.lane() == g) my_group = s;
    }
    //! Bit g: group g is among the `keep` best of `groups` (lower group first on a tie).
    [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned kept_groups(int groups, int keep) {
      unsigned kept = 0;
      float gv = my_group;
      for (int r = 0; r < keep; ++r) {
        float v = gv;
        int i = c.lane() < groups ? c.lane() : 0x7fffffff;
        simt::warp_argmax(c, v, i);
        kept |= 1u << i;
        if (c.lane() == i) gv = simt::bits_float(0xff800000u);
      }
      my_group = simt::bits_float(0xff800000u);
      return kept;
    }
    //! Back to the initial values: none of the token's state stays live into the next token.
    MOEFOLD_HOST_DEVICE void token_done() {
      my_index = -1;
      my_value = 0.0f;
    }
  };
};

//! The elementwise score (sigmoid or sqrt-softplus) of x.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float elementwise_score(score_function f, float x) {
  return f == score_function::sigmoid ? simt::sigmoid(x) : simt::sqrt(softplus(x));
}
//! d score / d x from x and the score sk, as routing/score_function.hpp's
//! elementwise_score_grad (sqrt-softplus: 0 where the score underflowed to 0).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float score_grad(score_function f, float x, float sk) {
  if (f == score_function::sigmoid) return simt::mul(sk, simt::add(1.0f, -sk));
  if (!(sk > 0.0f)) return 0.0f;
  const float sp_grad = x > 20.0f ? 1.0f : simt::sigmoid(x);
  return simt::div(sp_grad, simt::mul(2.0f, sk));
}

//! The team's logits of experts rank + width j (-inf past E).
template <class Team>
MOEFOLD_HOST_DEVICE void load_row(Team& tm, const float* row, int num_experts,
                                  float (&s)[per_thread]) {
  for (int j = 0; j < per_thread; ++j) {
    const int e = tm.rank() + Team::width * j;
    s[j] = e < num_experts ? row[e] : simt::bits_float(0xff800000u);
  }
}
//! softmax over the team's E values in place (max-subtracted; the sum in the team's fixed
//! reduction order); 0 past E.
template <class Team>
MOEFOLD_HOST_DEVICE void softmax(Team& tm, float (&s)[per_thread], int num_experts) {
  float m = s[0];
  for (int j = 1; j < per_thread; ++j) m = s[j] > m ? s[j] : m;
  m = tm.max(m);
  float part = 0.0f;
  for (int j = 0; j < per_thread; ++j) {
    s[j] = tm.rank() + Team::width * j < num_experts ? simt::exp(simt::add(s[j], -m)) : 0.0f;
    part = simt::add(part, s[j]);
  }
  const float sum = tm.sum(part);
  for (int j = 0; j < per_thread; ++j)
    s[j] = tm.rank() + Team::width * j < num_experts ? simt::div(s[j], sum) : 0.0f;
}
}  // namespace detail_router

//! The router's forward over a team of threads per token (Team: detail_router::warp_per_token
//! here, block_per_token in router_block.hpp). One parameter list and one body for both.
template <class Team>
struct basic_router_topk_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  // Named as every team-generic kernel is: the block team's gets the suffix _block.
  static constexpr const char* name = Team::width == 32 ? "router_topk" : "router_topk_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr int max_topk = Team::max_topk;
  static constexpr int max_groups = Team::max_groups;
  static constexpr auto smem_bytes = Team::smem_bytes;

  const float* logits;
  int num_tokens, num_experts, topk;
  score_function score;
  bool pre_softmax;
  int num_groups;  //!< 0: no group limit
  int group_topk;
  const float* expert_bias;  //!< [E] added to the selection scores, or null
  bool scale;                //!< probabilities times scaling_factor
  float scaling_factor;
  int* indices;  //!< [N, k]
  float* probs;  //!< [N, k]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    constexpr int per_thread = detail_router::per_thread, width = Team::width;
    const float neg_inf = simt::bits_float(0xff800000u);
    typename Team::template team<Ctx> tm(c);
    const int rank = tm.rank();
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      const float* row = logits + static_cast<long long>(t) * num_experts;
      float s[per_thread], sel[per_thread];  // experts rank + width j: score, selection value
      detail_router::load_row(tm, row, num_experts, s);
      if (score == score_function::softmax) {
        if (pre_softmax) detail_router::softmax(tm, s, num_experts);
        for (int j = 0; j < per_thread; ++j)
          sel[j] = rank + width * j < num_experts ? s[j] : neg_inf;
      } else {
        for (int j = 0; j < per_thread; ++j) {
          const int e = rank + width * j;
          if (e >= num_experts) {
            sel[j] = neg_inf;
            continue;
          }
          s[j] = detail_router::elementwise_score(score, s[j]);
          sel[j] = expert_bias ? simt::add(s[j], expert_bias[e]) : s[j];
        }
      }

      if (num_groups > 0) mask_groups(tm, sel, neg_inf);

      // k rounds of arg-max; the owner of the chosen expert hands over the value its
      // probability starts from (the selected logit, or the score without the bias) and
      // retires it.
      for (int r = 0; r < topk; ++r) {
        float v = neg_inf;
        int i = 0x7fffffff;
        for (int j = 0; j < per_thread; ++j)
          if (sel[j] > v) {  // strictly: the lower index (smaller j) stays on a tie
            v = sel[j];
            i = rank + width * j;
          }
        tm.argmax(v, i);
        float owned = 0.0f;
        for (int j = 0; j < per_thread; ++j)
          if (rank + width * j == i) {
            owned = s[j];
            sel[j] = neg_inf;
          }
        tm.record(r, i, owned);
      }
      tm.records_done();

      // Probabilities, every sum in selection order (selection 0 first), as the host.
      float p = rank < topk ? tm.selected_value() : 0.0f;
      if (score == score_function::softmax && !pre_softmax) {
        const float top = tm.first_value();  // the largest selected logit
        const auto e = [top](float x) { return simt::exp(simt::add(x, -top)); };
        const float sum = tm.ordered_sum(topk, e);
        p = rank < topk ? simt::div(e(p), sum) : 0.0f;
      } else if (score != score_function::softmax && topk > 1) {
        const float sum = tm.ordered_sum(topk, [](float x) { return x; });
        p = simt::div(p, simt::add(sum, 1e-20f));
      }
      if (scale) p = simt::mul(p, scaling_factor);
      if (rank < topk) {
        indices[static_cast<long long>(t) * topk + rank] = tm.selected_index();
        probs[static_cast<long long>(t) * topk + rank] = p;
      }
      tm.token_done();
    }
  }

 private:
  //! Group-limited routing: a group scores the sum of its top (k / group_topk) selection values
  //! (in descending order, as torch sums them); the group_topk best groups stay (lower group
  //! first on a tie); the other experts' selection values become -inf.
  template <class T>
  MOEFOLD_HOST_DEVICE void mask_groups(T& tm, float* sel, float neg_inf) const {
    constexpr int per_thread = detail_router::per_thread, width = Team::width;
    const int rank = tm.rank();
    const int per = num_experts / num_groups, take = topk / group_topk;
    for (int g = 0; g < num_groups; ++g) {
      float tmp[per_thread];
      for (int j = 0; j < per_thread; ++j) {
        const int e = rank + width * j;
        tmp[j] = e >= g * per && e < (g + 1) * per ? sel[j] : neg_inf;
      }
      float sum = 0.0f;
      for (int r = 0; r < take; ++r) {
        float v = neg_inf;
        int i = 0x7fffffff;
        for (int j = 0; j < per_thread; ++j)
          if (tmp[j] > v) {
            v = tmp[j];
            i = rank + width * j;
          }
        tm.argmax(v, i);
        sum = simt::add(sum, v);
        for (int j = 0; j < per_thread; ++j)
          if (rank + width * j == i) tmp[j] = neg_inf;
      }
      tm.set_group_score(g, sum);
    }
    const unsigned kept = tm.kept_groups(num_groups, group_topk);  // bit g: group g stays
    for (int j = 0; j < per_thread; ++j) {
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
//! E in the team's fixed reduction order. An index outside [0, E) (not the forward's)
//! contributes nothing instead of reading out of bounds.
//!
//! logits [N, E], indices [N, k] (the forward's), dprobs [N, k]; out: dlogits [N, E]
template <class Team>
struct basic_router_backward_kernel {
  static constexpr int block_threads = detail_router::block_threads;
  static constexpr const char* name =
      Team::width == 32 ? "router_backward" : "router_backward_block";
  static constexpr int max_experts = Team::max_experts;
  static constexpr int max_topk = Team::max_topk;
  static constexpr auto smem_bytes = Team::smem_bytes;

  const float* logits;
  const int* indices;
  const float* dprobs;
  int num_tokens, num_experts, topk;
  score_function score;
  bool pre_softmax;
  bool scale;
  float scaling_factor;
  float* dlogits;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    constexpr int per_thread = detail_router::per_thread, width = Team::width;
    typename Team::template team<Ctx> tm(c);
    const int rank = tm.rank();
    for (int t = tm.first_token(); t < num_tokens; t += tm.token_step()) {
      const float* row = logits + static_cast<long long>(t) * num_experts;
      float* drow = dlogits + static_cast<long long>(t) * num_experts;
      const long long base = static_cast<long long>(t) * topk;
      // Rank i < k: the i-th selection and its gradient (times the scaling factor).
      const int my_index = rank < topk ? indices[base + rank] : -1;
      float g = rank < topk ? dprobs[base + rank] : 0.0f;
      if (scale) g = simt::mul(g, scaling_factor);
      float out[per_thread] = {};  // the thread's experts rank + width j
      if (score == score_function::softmax && pre_softmax) {
        // s = softmax(row); ds = the selections' gradients scattered; ds_e -> s_e (ds_e - <s, ds>).
        float s[per_thread], ds[per_thread] = {};
        detail_router::load_row(tm, row, num_experts, s);
        detail_router::softmax(tm, s, num_experts);
        tm.share(topk, my_index, g);
        for (int r = 0; r < topk; ++r) {
          const int e = tm.shared_index(r);
          const float gr = tm.shared_value(r);
          for (int j = 0; j < per_thread; ++j)  // a constant index: the array stays in registers
            if (e == rank + width * j) ds[j] = simt::add(ds[j], gr);
        }
        tm.unshare();
        float dot = 0.0f;
        for (int j = 0; j < per_thread; ++j) dot = simt::add(dot, simt::mul(s[j], ds[j]));
        dot = tm.sum(dot);
        for (int j = 0; j < per_thread; ++j) out[j] = simt::mul(s[j], simt::add(ds[j], -dot));
      } else {
        const bool valid = rank < topk && my_index >= 0 && my_index < num_experts;
        const float x = valid ? row[my_index] : 0.0f;
        float gx = 0.0f;  // d loss / d x of the thread's selection
        if (score == score_function::softmax) {
          // p = softmax over the k selected logits; dx_i = p_i (g_i - <p, g>).
          const float top = held(tm, x, 0);  // the largest selected logit
          float p = rank < topk ? simt::exp(simt::add(x, -top)) : 0.0f;
          p = simt::div(p, held_sum(tm, p));
          const float dot = held_sum(tm, rank < topk ? simt::mul(p, g) : 0.0f);
          gx = simt::mul(p, simt::add(g, -dot));
        } else {
          const float sk = rank < topk ? detail_router::elementwise_score(score, x) : 0.0f;
          float gs = g;
          if (topk > 1) {
            // p_i = s_i / D, D = sum s + 1e-20: ds_i = g_i / D - <g, s> / D^2.
            const float d = simt::add(held_sum(tm, sk), 1e-20f);
            const float gsum = held_sum(tm, rank < topk ? simt::mul(g, sk) : 0.0f);
            gs = simt::add(simt::div(g, d), -simt::div(gsum, simt::mul(d, d)));
          }
          gx = simt::mul(gs, detail_router::score_grad(score, x, sk));
        }
        tm.share(topk, my_index, gx);
        for (int r = 0; r < topk; ++r) {
          const int e = tm.shared_index(r);
          const float gr = tm.shared_value(r);
          for (int j = 0; j < per_thread; ++j)
            if (e == rank + width * j) out[j] = gr;
        }
        tm.unshare();
      }
      for (int j = 0; j < per_thread; ++j) {
        const int e = rank + width * j;
        if (e < num_experts) drow[e] = out[j];
      }
      tm.token_done();
    }
  }

 private:
  // Rank r's v, on every thread.
  template <class T>
  MOEFOLD_HOST_DEVICE static float held(T& tm, float v, int r) {
    tm.share(r + 1, -1, v);
    const float out = tm.shared_value(r);
    tm.unshare();
    return out;
  }
  // The sum of ranks 0..k-1's v, added in rank (selection) order, on every thread.
  template <class T>
  MOEFOLD_HOST_DEVICE float held_sum(T& tm, float v) const {
    tm.share(topk, -1, v);
    float sum = 0.0f;
    for (int j = 0; j < topk; ++j) sum = simt::add(sum, tm.shared_value(j));
    tm.unshare();
    return sum;
  }
};

//! The router's backward, a warp per token (E <= 256).
using router_backward_kernel = basic_router_backward_kernel<detail_router::warp_per_token>;

}  // namespace moefold::kernels
