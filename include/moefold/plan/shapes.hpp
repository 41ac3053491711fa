//! @file shapes.hpp
//! @brief The per-rank sizes a mapping gives one micro-batch: tokens on the attention side and
//! on the MoE side, rows per local expert, layers per pipeline stage. Memory and time are both
//! written in terms of these.
#pragma once

#include <algorithm>

#include "mapping.hpp"
#include "model.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

struct step_shapes {
  double attn_tokens = 0;    //!< T_a = mbs * seq / cp: rows of the attention GEMMs (SP gathers)
  double moe_tokens = 0;     //!< T_m = T_a / tp: tokens a rank routes (its sequence-parallel shard)
  double expert_rows = 0;    //!< T_m * topk * etp: rows a rank's experts compute (balanced routing)
  double local_experts = 1;  //!< experts / ep
  long long micro = 1;       //!< micro-batches per step per pipeline: gbs / (mbs * dp)
  int stage_layers = 1;      //!< layers on the fullest stage
  int stage_moe_layers = 0;  //!< MoE layers among them (fullest stage by MoE count)
  int last_stage_moe = 0;    //!< MoE layers on the last stage
  int last_stage_layers = 0;
  int first_stage_moe = 0;
  int first_stage_layers = 0;
};

[[nodiscard]] inline step_shapes make_shapes(const model_config& m, const mapping& map) {
  step_shapes s;
  s.attn_tokens = static_cast<double>(map.mbs) * m.seq / map.cp;
  s.moe_tokens = s.attn_tokens / map.tp;
  s.expert_rows = s.moe_tokens * m.topk * map.etp;
  s.local_experts = static_cast<double>(m.experts) / map.ep;
  s.micro = m.gbs / (static_cast<long long>(map.mbs) * map.dp);
  const int per = layers_per_stage(m, map.pp);
  s.stage_layers = per;
  // Stage k holds layers [k*per, min(L, (k+1)*per)); count the MoE layers of each.
  for (int k = 0; k < map.pp; ++k) {
    const int lo = k * per, hi = std::min(m.layers, lo + per);
    int moe = 0;
    for (int i = lo; i < hi; ++i) moe += m.is_moe_layer(i) ? 1 : 0;
    s.stage_moe_layers = std::max(s.stage_moe_layers, moe);
    if (k == 0) {
      s.first_stage_moe = moe;
      s.first_stage_layers = std::max(0, hi - lo);
    }
    if (k == map.pp - 1) {
      s.last_stage_moe = moe;
      s.last_stage_layers = std::max(0, hi - lo);
    }
  }
  return s;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
