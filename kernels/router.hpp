//! @file router.hpp
//! @brief The router's forward, fused: score function, top-k (lower index first on ties), group
//! limits, expert bias, renormalisation and scaling, one warp per token (E <= 256, k <= 32,
//! groups <= 32), for every variant the host router has (routing/topk_router.hpp): softmax
//! before or after top-k, sigmoid, sqrt-softplus. Lane l holds experts l, l + 32, ...; each of the
//! k selections is a warp arg-max, which every lane then knows, so the sums over the k selected
//! values are formed by every lane in selection order, as the host forms them. Scores use
//! moefold's own exp and log (kernels/simt/math.hpp): the CPU executor and the GPU give the same
//! bits; against the host router (the C library's exp) they agree to a few ulp.
//!
//! logits [N, E] (row stride E), expert_bias [E] or null; out: indices [N, k], probs [N, k]
#pragma once

#include <moefold/core/config.hpp>

#include "simt/math.hpp"
#include "simt/warp.hpp"

namespace moefold::kernels {

//! The score function, as routing/score_function.hpp names it.
enum class router_score : int { softmax = 0, sigmoid = 1, sqrt_softplus = 2 };

namespace detail_router {
//! The lane's logits of experts lane + 32 j (-inf past E).
template <class Ctx>
MOEFOLD_HOST_DEVICE void load_row(Ctx& c, const float* row, int num_experts, float (&s)[8]) {
  for (int j = 0; j < 8; ++j) {
    const int e = c.lane() + 32 * j;
    s[j] = e < num_experts ? row[e] : simt::bits_float(0xff800000u);
  }
}
//! softmax over the warp's E values in place (max-subtracted; the sum in the warp's tree order);
//! 0 past E.
template <class Ctx>
MOEFOLD_HOST_DEVICE void warp_softmax(Ctx& c, float (&s)[8], int num_experts) {
  float m = s[0];
  for (int j = 1; j < 8; ++j) m = s[j] > m ? s[j] : m;
  m = simt::warp_max(c, m);
  float part = 0.0f;
  for (int j = 0; j < 8; ++j) {
    s[j] = c.lane() + 32 * j < num_experts ? simt::exp(simt::add(s[j], -m)) : 0.0f;
    part = simt::add(part, s[j]);
  }
  const float sum = simt::warp_sum(c, part);
  for (int j = 0; j < 8; ++j) s[j] = c.lane() + 32 * j < num_experts ? simt::div(s[j], sum) : 0.0f;
}
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
}  // namespace detail_router

struct router_topk_kernel {
  static constexpr int block_threads = 128;  //!< four warps: four tokens per step
  static constexpr const char* name = "router_topk";
  static constexpr int max_experts = 256;  //!< 8 per lane
  static constexpr int max_topk = 32;      //!< lane j keeps the j-th selection
  static constexpr int max_groups = 32;    //!< lane g keeps group g's score

  const float* logits;
  int num_tokens, num_experts, topk;
  router_score score;
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
    constexpr int warps = block_threads / 32;
    const float neg_inf = simt::bits_float(0xff800000u);
    const int lane = c.lane();
    for (int t = c.block() * warps + c.warp(); t < num_tokens; t += c.grid_blocks() * warps) {
      const float* row = logits + static_cast<long long>(t) * num_experts;
      float s[8], sel[8];  // the lane's experts lane + 32 j: score, selection value
      detail_router::load_row(c, row, num_experts, s);
      if (score == router_score::softmax) {
        if (pre_softmax) detail_router::warp_softmax(c, s, num_experts);
        for (int j = 0; j < 8; ++j) sel[j] = lane + 32 * j < num_experts ? s[j] : neg_inf;
      } else {
        for (int j = 0; j < 8; ++j) {
          const int e = lane + 32 * j;
          if (e >= num_experts) {
            sel[j] = neg_inf;
            continue;
          }
          s[j] = score == router_score::sigmoid ? simt::sigmoid(s[j])
                                                : simt::sqrt(detail_router::softplus(s[j]));
          sel[j] = expert_bias ? simt::add(s[j], expert_bias[e]) : s[j];
        }
      }

      if (num_groups > 0) mask_groups(c, sel, neg_inf);

      // k rounds of arg-max; lane r keeps round r's expert and the value its probability
      // starts from (the selected logit, or the score without the bias).
      int my_index = -1;
      float my_value = 0.0f;
      for (int r = 0; r < topk; ++r) {
        float v = neg_inf;
        int i = 0x7fffffff;
        for (int j = 0; j < 8; ++j)
          if (sel[j] > v) {  // strictly: the lower index (smaller j) stays on a tie
            v = sel[j];
            i = lane + 32 * j;
          }
        simt::warp_argmax(c, v, i);
        // The owner hands over the score of the chosen expert and retires it.
        float chosen = 0.0f;
        if (lane == i % 32) {
          for (int j = 0; j < 8; ++j)
            if (lane + 32 * j == i) {
              chosen = s[j];
              sel[j] = neg_inf;
            }
        }
        chosen = c.shfl_idx(chosen, i % 32);
        if (lane == r) {
          my_index = i;
          my_value = chosen;
        }
      }

      // Probabilities, every sum in selection order (lane 0's value first), as the host.
      float p = my_value;
      if (score == router_score::softmax && !pre_softmax) {
        const float top = c.shfl_idx(my_value, 0);  // the largest selected logit
        p = lane < topk ? simt::exp(simt::add(my_value, -top)) : 0.0f;
        const float sum = ordered_sum(c, p);
        p = simt::div(p, sum);
      } else if (score != router_score::softmax && topk > 1) {
        const float sum = ordered_sum(c, lane < topk ? p : 0.0f);
        p = simt::div(p, simt::add(sum, 1e-20f));
      }
      if (scale) p = simt::mul(p, scaling_factor);
      if (lane < topk) {
        indices[static_cast<long long>(t) * topk + lane] = my_index;
        probs[static_cast<long long>(t) * topk + lane] = p;
      }
    }
  }

 private:
  template <class Ctx>
  MOEFOLD_HOST_DEVICE float ordered_sum(Ctx& c, float v) const {
    return detail_router::ordered_sum(c, v, topk);
  }

  //! Group-limited routing: a group scores the sum of its top (k / group_topk) selection values
  //! (in descending order, as torch sums them); the group_topk best groups stay (lower group
  //! first on a tie); the other experts' selection values become -inf.
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void mask_groups(Ctx& c, float* sel, float neg_inf) const {
    const int lane = c.lane();
    const int per = num_experts / num_groups, take = topk / group_topk;
    float my_group_score = neg_inf;  // lane g: group g's score
    for (int g = 0; g < num_groups; ++g) {
      float tmp[8];
      for (int j = 0; j < 8; ++j) {
        const int e = lane + 32 * j;
        tmp[j] = e >= g * per && e < (g + 1) * per ? sel[j] : neg_inf;
      }
      float sum = 0.0f;
      for (int r = 0; r < take; ++r) {
        float v = neg_inf;
        int i = 0x7fffffff;
        for (int j = 0; j < 8; ++j)
          if (tmp[j] > v) {
            v = tmp[j];
            i = lane + 32 * j;
          }
        simt::warp_argmax(c, v, i);
        sum = simt::add(sum, v);
        for (int j = 0; j < 8; ++j)
          if (lane + 32 * j == i) tmp[j] = neg_inf;
      }
      if (lane == g) my_group_score = sum;
    }
    unsigned kept = 0;  // bit g: group g stays
    float gv = my_group_score;
    for (int r = 0; r < group_topk; ++r) {
      float v = gv;
      int i = lane < num_groups ? lane : 0x7fffffff;
      simt::warp_argmax(c, v, i);
      kept |= 1u << i;
      if (lane == i) gv = neg_inf;
    }
    for (int j = 0; j < 8; ++j) {
      const int e = lane + 32 * j;
      if (e < num_experts && !((kept >> (e / per)) & 1u)) sel[j] = neg_inf;
    }
  }
};

//! The router's backward, one warp per token (E <= 256, k <= 32): from dprobs [N, k] (the
//! gradient of the routed probabilities) to dlogits [N, E] (every element written; experts not
//! selected get 0, or, with a softmax before top-k, their share of the softmax's gradient). The
//! selection, group masks and expert bias carry no gradient, as on the host
//! (topk_router::backward). Sums over the k selected in selection order as the host forms them;
//! the softmax-before-top-k dot product over E in the warp's tree order. An index outside
//! [0, E) (not the forward's) contributes nothing instead of reading out of bounds.
//!
//! logits [N, E], indices [N, k] (the forward's), dprobs [N, k]; out: dlogits [N, E]
struct router_backward_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "router_backward";
  static constexpr int max_experts = router_topk_kernel::max_experts;
  static constexpr int max_topk = router_topk_kernel::max_topk;

  const float* logits;
  const int* indices;
  const float* dprobs;
  int num_tokens, num_experts, topk;
  router_score score;
  bool pre_softmax;
  bool scale;
  float scaling_factor;
  float* dlogits;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    constexpr int warps = block_threads / 32;
    const int lane = c.lane();
    for (int t = c.block() * warps + c.warp(); t < num_tokens; t += c.grid_blocks() * warps) {
      const float* row = logits + static_cast<long long>(t) * num_experts;
      float* drow = dlogits + static_cast<long long>(t) * num_experts;
      const long long base = static_cast<long long>(t) * topk;
      // Lane i < k: the i-th selection and its gradient (times the scaling factor).
      const int my_index = lane < topk ? indices[base + lane] : -1;
      float g = lane < topk ? dprobs[base + lane] : 0.0f;
      if (scale) g = simt::mul(g, scaling_factor);
      float out[8] = {};  // the lane's experts lane + 32 j
      if (score == router_score::softmax && pre_softmax) {
        // s = softmax(row); ds = the selections' gradients scattered; ds_e -> s_e (ds_e - <s, ds>).
        float s[8], ds[8] = {};
        detail_router::load_row(c, row, num_experts, s);
        detail_router::warp_softmax(c, s, num_experts);
        for (int r = 0; r < topk; ++r) {
          const int e = c.shfl_idx(my_index, r);
          const float gr = c.shfl_idx(g, r);
          for (int j = 0; j < 8; ++j)  // a constant index: the array stays in registers
            if (e == lane + 32 * j) ds[j] = simt::add(ds[j], gr);
        }
        float dot = 0.0f;
        for (int j = 0; j < 8; ++j) dot = simt::add(dot, simt::mul(s[j], ds[j]));
        dot = simt::warp_sum(c, dot);
        for (int j = 0; j < 8; ++j) out[j] = simt::mul(s[j], simt::add(ds[j], -dot));
      } else {
        const bool valid = lane < topk && my_index >= 0 && my_index < num_experts;
        const float x = valid ? row[my_index] : 0.0f;
        float gx = 0.0f;  // d loss / d x of the lane's selection
        if (score == router_score::softmax) {
          // p = softmax over the k selected logits; dx_i = p_i (g_i - <p, g>).
          const float top = c.shfl_idx(x, 0);  // the largest selected logit
          float p = lane < topk ? simt::exp(simt::add(x, -top)) : 0.0f;
          p = simt::div(p, ordered_sum(c, p));
          const float dot = ordered_sum(c, lane < topk ? simt::mul(p, g) : 0.0f);
          gx = simt::mul(p, simt::add(g, -dot));
        } else {
          const float sk = lane < topk ? (score == router_score::sigmoid
                                              ? simt::sigmoid(x)
                                              : simt::sqrt(detail_router::softplus(x)))
                                       : 0.0f;
          float gs = g;
          if (topk > 1) {
            // p_i = s_i / D, D = sum s + 1e-20: ds_i = g_i / D - <g, s> / D^2.
            const float d = simt::add(ordered_sum(c, sk), 1e-20f);
            const float gsum = ordered_sum(c, lane < topk ? simt::mul(g, sk) : 0.0f);
            gs = simt::add(simt::div(g, d), -simt::div(gsum, simt::mul(d, d)));
          }
          gx = simt::mul(gs, score_grad(x, sk));
        }
        for (int r = 0; r < topk; ++r) {
          const int e = c.shfl_idx(my_index, r);
          const float gr = c.shfl_idx(gx, r);
          for (int j = 0; j < 8; ++j)
            if (e == lane + 32 * j) out[j] = gr;
        }
      }
      for (int j = 0; j < 8; ++j) {
        const int e = lane + 32 * j;
        if (e < num_experts) drow[e] = out[j];
      }
    }
  }

 private:
  // d score / d x from x and the score, as routing/score_function.hpp's elementwise_score_grad.
  MOEFOLD_HOST_DEVICE float score_grad(float x, float sk) const {
    if (score == router_score::sigmoid) return simt::mul(sk, simt::add(1.0f, -sk));
    if (!(sk > 0.0f)) return 0.0f;
    const float sp_grad = x > 20.0f ? 1.0f : simt::sigmoid(x);
    return simt::div(sp_grad, simt::mul(2.0f, sk));
  }
  template <class Ctx>
  MOEFOLD_HOST_DEVICE float ordered_sum(Ctx& c, float v) const {
    return detail_router::ordered_sum(c, v, topk);
  }
};

}  // namespace moefold::kernels
