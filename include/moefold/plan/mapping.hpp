//! @file mapping.hpp
//! @brief One folded mapping (tp, cp, ep, etp, pp, vpp, micro-batch) and the rules that make it
//! legal for a model on a number of GPUs: Megatron-Core's fold rules (through make_folded, so
//! the planner never considers a fold the mesh layer would refuse) plus the model-shape rules
//! Megatron-Core's trainer checks.
#pragma once

#include <string>

#include "../core/expected.hpp"
#include "../mesh/fold.hpp"
#include "model.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

struct mapping {
  int tp = 1, cp = 1, ep = 1, etp = 1, pp = 1, vpp = 1, mbs = 1;
  int dp = 1, edp = 1;  //!< derived: gpus / (tp*cp*pp) and gpus / (etp*ep*pp)
  friend bool operator==(const mapping&, const mapping&) = default;
};

//! "tp2 cp1 ep8 etp1 pp8 vpp1 mbs1 (dp8 edp2)".
[[nodiscard]] inline std::string to_string(const mapping& m) {
  return "tp" + std::to_string(m.tp) + " cp" + std::to_string(m.cp) + " ep" + std::to_string(m.ep) +
         " etp" + std::to_string(m.etp) + " pp" + std::to_string(m.pp) + " vpp" +
         std::to_string(m.vpp) + " mbs" + std::to_string(m.mbs) + " (dp" + std::to_string(m.dp) +
         " edp" + std::to_string(m.edp) + ")";
}

//! Layers on the fullest pipeline stage (Megatron-Core splits evenly; an uneven split puts the
//! remainder on some stages, e.g. DeepSeek-V3's 61 layers on 16 stages).
[[nodiscard]] inline int layers_per_stage(const model_config& m, int pp) noexcept {
  return (m.layers + pp - 1) / pp;
}

//! Checks a mapping for a model on `gpus` GPUs and fills in dp and edp. Returns the fold.
[[nodiscard]] inline expected<dynamic_folded_mesh> check_mapping(const model_config& m, int gpus,
                                                                 mapping& map) {
  auto bad = [&](const std::string& what) {
    return make_error(errc::invalid_size, to_string(map) + ": " + what);
  };
  if (map.vpp < 1 || map.mbs < 1)
    return make_error(errc::invalid_size, "vpp and mbs must be >= 1 (got vpp " +
                                              std::to_string(map.vpp) + ", mbs " +
                                              std::to_string(map.mbs) + ")");
  auto fold = make_folded(
      {.world = gpus, .tp = map.tp, .cp = map.cp, .pp = map.pp, .ep = map.ep, .etp = map.etp});
  if (!fold) return unexpected<error>(fold.error());
  map.dp = fold->dp();
  map.edp = fold->edp();
  const int kv_groups = m.mla() ? m.heads : m.kv_heads;
  if (m.heads % map.tp != 0 || kv_groups % map.tp != 0)
    return bad("tp must divide the attention heads (" + std::to_string(m.heads) +
               ") and key/value heads (" + std::to_string(kv_groups) + ")");
  if (m.experts % map.ep != 0)
    return bad("ep must divide the experts (" + std::to_string(m.experts) + ")");
  if (m.experts > 1 && m.moe_ffn % map.etp != 0)
    return bad("etp must divide the expert FFN size (" + std::to_string(m.moe_ffn) + ")");
  if (m.experts == 1 && (map.ep != 1 || map.etp != map.tp))
    return bad("a dense model has no experts: ep must be 1 and etp = tp");
  if (m.ffn > 0 && m.moe_layers() < m.layers && m.ffn % map.tp != 0)
    return bad("tp must divide the dense FFN size (" + std::to_string(m.ffn) + ")");
  if (m.shared_ffn % map.tp != 0)
    return bad("tp must divide the shared-expert FFN size (" + std::to_string(m.shared_ffn) + ")");
  if (m.seq % map.tp != 0)
    return bad("sequence parallelism needs tp to divide the sequence (" + std::to_string(m.seq) +
               ")");
  if (map.cp > 1 && m.seq % (2 * map.cp) != 0)
    return bad("context parallelism needs 2*cp to divide the sequence (" + std::to_string(m.seq) +
               ")");
  if (map.pp > m.layers) return bad("pp exceeds the layers (" + std::to_string(m.layers) + ")");
  if (map.vpp > 1) {
    if (map.pp == 1) return bad("an interleaved schedule (vpp > 1) needs pp > 1");
    // Uneven splits are legal (Megatron-Core's --pipeline-model-parallel-layout, as used for
    // DeepSeek-V3 and Qwen3-235B); every virtual stage needs a layer.
    if (static_cast<long long>(map.pp) * map.vpp > m.layers)
      return bad("pp*vpp exceeds the layers (" + std::to_string(m.layers) + ")");
  }
  const long long per_step = static_cast<long long>(map.mbs) * map.dp;
  if (m.gbs % per_step != 0)
    return bad("mbs*dp = " + std::to_string(per_step) + " must divide the global batch (" +
               std::to_string(m.gbs) + ")");
  const long long micro = m.gbs / per_step;
  if (map.vpp > 1 && micro % map.pp != 0)
    return bad("the interleaved schedule needs pp to divide the micro-batches (" +
               std::to_string(micro) + ")");
  return fold;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
