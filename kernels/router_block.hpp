//! @file router_block.hpp
//! @brief The router's forward for many experts: one block of 128 threads per token (E <= 1,024,
//! thread i holding experts i + 128 j, j < 8), where router.hpp's warp per token stops at 256.
//! The same rules as router_topk_kernel and the host router (routing/topk_router.hpp): every
//! score function, expert bias, group limits, top-k with the lower index first on ties,
//! renormalisation and scaling. A block reduction is a warp reduction per warp, then the four
//! warp results combined in warp order from shared memory, so its order is fixed and the CPU
//! executor and the GPU give the same bits. The k selections go to shared memory as they are
//! made, and every sum over them runs in selection order, as the host forms it.
//!
//! logits [N, E] (row stride E), expert_bias [E] or null; out: indices [N, k], probs [N, k]
#pragma once

#include <cstddef>

#include <moefold/core/config.hpp>

#include "router.hpp"
#include "simt/math.hpp"
#include "simt/warp.hpp"

namespace moefold::kernels {

struct router_topk_block_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "router_topk_block";
  static constexpr int per_thread = 8;
  static constexpr int max_experts = block_threads * per_thread;  //!< 1,024
  static constexpr int max_topk = 32;
  static constexpr int max_groups = 32;

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

  //! Shared memory: the reductions' per-warp values, the selections, the group scores.
  struct shared_state {
    float red_v[block_threads / 32];
    int red_i[block_threads / 32];
    int sel_index[max_topk];
    float sel_value[max_topk];  // the score (or logit) each selection's probability starts from
    float group_score[max_groups];
  };
  static constexpr std::size_t smem_bytes = sizeof(shared_state);

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    shared_state& sh = *c.template shared<shared_state>();
    const float neg_inf = simt::bits_float(0xff800000u);
    const int tid = c.thread();
    for (int t = c.block(); t < num_tokens; t += c.grid_blocks()) {
      const float* row = logits + static_cast<long long>(t) * num_experts;
      float s[per_thread], sel[per_thread];  // experts tid + 128 j: score, selection value
      for (int j = 0; j < per_thread; ++j) {
        const int e = tid + block_threads * j;
        s[j] = e < num_experts ? row[e] : neg_inf;
      }
      if (score == router_score::softmax) {
        if (pre_softmax) {
          float m = s[0];
          for (int j = 1; j < per_thread; ++j) m = s[j] > m ? s[j] : m;
          m = block_max(c, sh, m);
          float part = 0.0f;
          for (int j = 0; j < per_thread; ++j) {
            s[j] = tid + block_threads * j < num_experts ? simt::exp(simt::add(s[j], -m)) : 0.0f;
            part = simt::add(part, s[j]);
          }
          const float sum = block_sum(c, sh, part);
          for (int j = 0; j < per_thread; ++j)
            s[j] = tid + block_threads * j < num_experts ? simt::div(s[j], sum) : 0.0f;
        }
        for (int j = 0; j < per_thread; ++j)
          sel[j] = tid + block_threads * j < num_experts ? s[j] : neg_inf;
      } else {
        for (int j = 0; j < per_thread; ++j) {
          const int e = tid + block_threads * j;
          if (e >= num_experts) {
            sel[j] = neg_inf;
            continue;
          }
          s[j] = score == router_score::sigmoid ? simt::sigmoid(s[j])
                                                : simt::sqrt(detail_router::softplus(s[j]));
          sel[j] = expert_bias ? simt::add(s[j], expert_bias[e]) : s[j];
        }
      }

      if (num_groups > 0) mask_groups(c, sh, sel, neg_inf);

      // k rounds of block arg-max; the owner of the chosen expert records it and retires it.
      for (int r = 0; r < topk; ++r) {
        float v = neg_inf;
        int i = 0x7fffffff;
        for (int j = 0; j < per_thread; ++j)
          if (sel[j] > v) {  // strictly: the lower index (smaller j) stays on a tie
            v = sel[j];
            i = tid + block_threads * j;
          }
        block_argmax(c, sh, v, i);
        for (int j = 0; j < per_thread; ++j)
          if (tid + block_threads * j == i) {
            sh.sel_index[r] = i;
            sh.sel_value[r] = s[j];
            sel[j] = neg_inf;
          }
      }
      c.sync();  // the selections, written by their owners, read by threads 0..k-1

      // Probabilities, every sum in selection order, as the host.
      float p = tid < topk ? sh.sel_value[tid] : 0.0f;
      if (score == router_score::softmax && !pre_softmax) {
        const float top = sh.sel_value[0];  // the largest selected logit
        float sum = 0.0f;
        for (int j = 0; j < topk; ++j)
          sum = simt::add(sum, simt::exp(simt::add(sh.sel_value[j], -top)));
        p = tid < topk ? simt::div(simt::exp(simt::add(p, -top)), sum) : 0.0f;
      } else if (score != router_score::softmax && topk > 1) {
        float sum = 0.0f;
        for (int j = 0; j < topk; ++j) sum = simt::add(sum, sh.sel_value[j]);
        p = simt::div(p, simt::add(sum, 1e-20f));
      }
      if (scale) p = simt::mul(p, scaling_factor);
      if (tid < topk) {
        indices[static_cast<long long>(t) * topk + tid] = sh.sel_index[tid];
        probs[static_cast<long long>(t) * topk + tid] = p;
      }
      c.sync();  // shared state reused by the next token
    }
  }

 private:
  template <class Ctx>
  MOEFOLD_HOST_DEVICE static float block_max(Ctx& c, shared_state& sh, float v) {
    v = simt::warp_max(c, v);
    if (c.lane() == 0) sh.red_v[c.warp()] = v;
    c.sync();
    float m = sh.red_v[0];
    for (int w = 1; w < block_threads / 32; ++w) m = sh.red_v[w] > m ? sh.red_v[w] : m;
    c.sync();
    return m;
  }
  template <class Ctx>
  MOEFOLD_HOST_DEVICE static float block_sum(Ctx& c, shared_state& sh, float v) {
    v = simt::warp_sum(c, v);
    if (c.lane() == 0) sh.red_v[c.warp()] = v;
    c.sync();
    float sum = sh.red_v[0];
    for (int w = 1; w < block_threads / 32; ++w) sum = simt::add(sum, sh.red_v[w]);
    c.sync();
    return sum;
  }
  // (value, index) of the block's largest value, the lower index on a tie; on every thread.
  template <class Ctx>
  MOEFOLD_HOST_DEVICE static void block_argmax(Ctx& c, shared_state& sh, float& v, int& i) {
    simt::warp_argmax(c, v, i);
    if (c.lane() == 0) {
      sh.red_v[c.warp()] = v;
      sh.red_i[c.warp()] = i;
    }
    c.sync();
    v = sh.red_v[0];
    i = sh.red_i[0];
    for (int w = 1; w < block_threads / 32; ++w)
      if (sh.red_v[w] > v || (sh.red_v[w] == v && sh.red_i[w] < i)) {
        v = sh.red_v[w];
        i = sh.red_i[w];
      }
    c.sync();
  }

  //! Group-limited routing as router_topk_kernel::mask_groups, over the block: a group scores
  //! the sum of its top (k / group_topk) selection values in descending order; the group_topk
  //! best groups stay (lower group first on a tie), chosen by every thread from shared memory;
  //! the other experts' selection values become -inf.
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void mask_groups(Ctx& c, shared_state& sh, float* sel, float neg_inf) const {
    const int tid = c.thread();
    const int per = num_experts / num_groups, take = topk / group_topk;
    for (int g = 0; g < num_groups; ++g) {
      float tmp[per_thread];
      for (int j = 0; j < per_thread; ++j) {
        const int e = tid + block_threads * j;
        tmp[j] = e >= g * per && e < (g + 1) * per ? sel[j] : neg_inf;
      }
      float sum = 0.0f;
      for (int r = 0; r < take; ++r) {
        float v = neg_inf;
        int i = 0x7fffffff;
        for (int j = 0; j < per_thread; ++j)
          if (tmp[j] > v) {
            v = tmp[j];
            i = tid + block_threads * j;
          }
        block_argmax(c, sh, v, i);
        sum = simt::add(sum, v);
        for (int j = 0; j < per_thread; ++j)
          if (tid + block_threads * j == i) tmp[j] = neg_inf;
      }
      if (tid == 0) sh.group_score[g] = sum;
    }
    c.sync();
    unsigned kept = 0;  // bit g: group g stays
    for (int r = 0; r < group_topk; ++r) {
      int best = -1;
      for (int g = 0; g < num_groups; ++g)
        if (!((kept >> g) & 1u) && (best < 0 || sh.group_score[g] > sh.group_score[best])) best = g;
      kept |= 1u << best;
    }
    c.sync();  // group_score is read above before anyone writes shared state again
    for (int j = 0; j < per_thread; ++j) {
      const int e = tid + block_threads * j;
      if (e < num_experts && !((kept >> (e / per)) & 1u)) sel[j] = neg_inf;
    }
  }
};

}  // namespace moefold::kernels
