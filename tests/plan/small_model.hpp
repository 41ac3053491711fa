// The small model and cluster the plan tests compute by hand: 4 MoE layers, H 1024, 8 heads
// (MHA), 8 experts of 2048, top-2, vocab 32000, seq 1024, global batch 8; H100 nodes of 8 GPUs.
#pragma once

#include <moefold/plan/plan.hpp>

namespace moefold::plan::testing {

inline model_config small_model() {
  model_config m;
  m.name = "small";
  m.layers = 4;
  m.hidden = 1024;
  m.heads = 8;
  m.kv_heads = 8;
  m.experts = 8;
  m.topk = 2;
  m.moe_ffn = 2048;
  m.vocab = 32000;
  m.seq = 1024;
  m.gbs = 8;
  return m;
}

//! The H100 preset with `n` GPUs in the job.
inline cluster_config h100_gpus(int n) {
  auto c = cluster_preset("h100-sxm").value();
  c.gpus = n;
  return c;
}

//! The built-in efficiencies without the eager host floor: the GPU's side of a step. The small
//! model's layers take far less GPU time than the floor, which hides every other mechanism
//! (dispatch_model_test.cpp checks the floor itself).
inline efficiency gpu_side() {
  efficiency e;
  e.host_moe_layer_s = 0;
  return e;
}

}  // namespace moefold::plan::testing
