//! @file model_presets.hpp
//! @brief The published configurations of the models the planner knows by name. Sources (the
//! models' Hugging Face config.json files, and for the derived models the papers that define
//! them) are listed in docs/planner.md. Training shapes (seq 4096, global batch 256) are the
//! MoE Parallel Folding paper's (arXiv 2504.14960) unless noted.
#pragma once

#include <array>
#include <optional>
#include <string_view>

#include "model.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

namespace detail {

inline model_config mixtral(const char* name, int layers, int hidden, int heads, int ffn) {
  model_config m;
  m.name = name;
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.kv_heads = 8;
  m.ffn = ffn;
  m.experts = 8;
  m.topk = 2;
  m.moe_ffn = ffn;
  m.vocab = 32000;
  return m;
}

}  // namespace detail

//! The preset names, in the order --help lists them.
inline constexpr std::array<std::string_view, 7> model_preset_names = {
    "mixtral-8x7b", "mixtral-8x22b",   "mixtral-8x22b-g8t8", "qwen2-57b-a14b",
    "llama3-8x70b", "qwen3-235b-a22b", "deepseek-v3"};

//! A preset by name, or nothing.
[[nodiscard]] inline std::optional<model_config> model_preset(std::string_view name) {
  if (name == "mixtral-8x7b")  // mistralai/Mixtral-8x7B-v0.1 config.json
    return detail::mixtral("mixtral-8x7b", 32, 4096, 32, 14336);
  if (name == "mixtral-8x22b")  // mistralai/Mixtral-8x22B-v0.1 config.json
    return detail::mixtral("mixtral-8x22b", 56, 6144, 48, 16384);
  if (name == "mixtral-8x22b-g8t8") {
    // Fine-grained Mixtral-8x22B (arXiv 2504.14960, granular upcycling G8 T8): each expert cut
    // into 8 slices of 2048, 64 experts, top-8.
    auto m = detail::mixtral("mixtral-8x22b-g8t8", 56, 6144, 48, 16384);
    m.experts = 64;
    m.topk = 8;
    m.moe_ffn = 2048;
    return m;
  }
  if (name == "qwen2-57b-a14b") {  // Qwen/Qwen2-57B-A14B config.json
    model_config m;
    m.name = "qwen2-57b-a14b";
    m.layers = 28;
    m.hidden = 3584;
    m.heads = 28;
    m.kv_heads = 4;
    m.ffn = 18944;
    m.experts = 64;
    m.topk = 8;
    m.moe_ffn = 2560;
    m.shared_ffn = 20480;
    m.vocab = 151936;
    return m;
  }
  if (name == "llama3-8x70b") {
    // meta-llama/Meta-Llama-3-70B config.json, upcycled to 8 experts, top-2 (arXiv 2412.09952).
    model_config m;
    m.name = "llama3-8x70b";
    m.layers = 80;
    m.hidden = 8192;
    m.heads = 64;
    m.kv_heads = 8;
    m.ffn = 28672;
    m.experts = 8;
    m.topk = 2;
    m.moe_ffn = 28672;
    m.vocab = 128256;
    return m;
  }
  if (name == "qwen3-235b-a22b") {  // Qwen/Qwen3-235B-A22B config.json
    model_config m;
    m.name = "qwen3-235b-a22b";
    m.layers = 94;
    m.hidden = 4096;
    m.heads = 64;
    m.kv_heads = 4;
    m.head_dim = 128;
    m.ffn = 12288;
    m.experts = 128;
    m.topk = 8;
    m.moe_ffn = 1536;
    m.vocab = 151936;
    m.gbs = 1024;  // not published; a typical large-run batch, state yours with --gbs
    return m;
  }
  if (name == "deepseek-v3") {  // deepseek-ai/DeepSeek-V3 config.json; arXiv 2412.19437
    model_config m;
    m.name = "deepseek-v3";
    m.layers = 61;
    m.hidden = 7168;
    m.heads = 128;
    m.kv_heads = 128;
    m.head_dim = 128;  // qk_nope_head_dim
    m.ffn = 18432;
    m.experts = 256;
    m.topk = 8;
    m.moe_ffn = 2048;
    m.shared_ffn = 2048;
    m.first_dense_layers = 3;
    m.vocab = 129280;
    m.q_lora_rank = 1536;
    m.kv_lora_rank = 512;
    m.qk_rope_dim = 64;
    m.v_head_dim = 128;
    m.mtp_layers = 1;
    m.router_groups = 8;  // n_group: node-limited routing, each token on at most 4 nodes
    m.router_group_topk = 4;
    m.gbs = 15360;  // the report's batch after its ramp-up
    m.dtype = precision::fp8;
    return m;
  }
  return std::nullopt;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
