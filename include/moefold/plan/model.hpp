//! @file model.hpp
//! @brief The transformer a plan is made for: sizes, MoE layout, training shape, and the
//! parameter counts derived from them.
#pragma once

#include <cstdint>
#include <string>

#include "../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! Number format of the GEMMs. Activations, weights and gradients are kept in bf16 either way
//! (Megatron-Core's FP8 recipes keep bf16 master copies and bf16 activations between layers).
enum class precision : std::uint8_t { bf16, fp8 };

//! A decoder-only MoE transformer and its training shape. Names follow Megatron-Core's
//! arguments; a size of 0 where noted means "not used".
struct model_config {
  std::string name = "custom";
  int layers = 0;              //!< transformer layers (without MTP layers)
  int hidden = 0;              //!< hidden size H
  int heads = 0;               //!< attention (query) heads
  int kv_heads = 0;            //!< key/value heads (GQA groups); = heads for MHA
  int head_dim = 0;            //!< per-head size; 0 means hidden / heads
  int ffn = 0;                 //!< FFN size of the dense (non-MoE) layers
  int experts = 1;             //!< routed experts per MoE layer
  int topk = 1;                //!< experts each token is routed to
  int moe_ffn = 0;             //!< FFN size of one routed expert
  int shared_ffn = 0;          //!< total FFN size of the shared expert(s); 0: none
  int moe_layer_freq = 1;      //!< layer i (counted from 0) is MoE when i % freq == 0 ...
  int first_dense_layers = 0;  //!< ... and i >= first_dense_layers (DeepSeek's first_k_dense)
  int vocab = 0;               //!< vocabulary (output layer and embedding, untied)
  int seq = 4096;              //!< training sequence length
  int gbs = 256;               //!< global batch, in sequences
  int mbs = 1;                 //!< default micro-batch (sequences), used when not searched
  precision dtype = precision::bf16;
  bool gated = true;  //!< SwiGLU-style gated FFN (3 weight matrices instead of 2)
  // Multi-latent attention (DeepSeek); q_lora_rank == 0 and kv_lora_rank == 0 means GQA/MHA.
  int q_lora_rank = 0;   //!< 0: no query compression
  int kv_lora_rank = 0;  //!< > 0 switches to MLA
  int qk_rope_dim = 0;   //!< rotary part of each query/key head (MLA)
  int v_head_dim = 0;    //!< value head size (MLA); head_dim is the non-rotary q/k head size
  int mtp_layers = 0;    //!< multi-token-prediction layers (on the last pipeline stage)
  // Group-limited routing (DeepSeek-V3's node-limited routing; Megatron-Core's
  // --moe-router-num-groups and --moe-router-group-topk): the experts are split into
  // router_groups contiguous groups and each token chooses among router_group_topk of them.
  int router_groups = 0;      //!< 0: not group-limited
  int router_group_topk = 0;  //!< groups a token may use (with router_groups)

  [[nodiscard]] bool mla() const noexcept { return kv_lora_rank > 0; }
  [[nodiscard]] int head_size() const noexcept {
    return head_dim > 0 ? head_dim : (heads > 0 ? hidden / heads : 0);
  }
  [[nodiscard]] bool is_moe_layer(int i) const noexcept {
    return experts > 1 && i >= first_dense_layers && i % moe_layer_freq == 0;
  }
  [[nodiscard]] int moe_layers() const noexcept {
    int n = 0;
    for (int i = 0; i < layers; ++i) n += is_moe_layer(i) ? 1 : 0;
    return n;
  }
  [[nodiscard]] double ffn_matrices() const noexcept { return gated ? 3.0 : 2.0; }

  //! Parameters of one attention block (projections and its layer norm).
  [[nodiscard]] double attention_params() const noexcept {
    const double h = hidden, n = heads, d = head_size();
    if (mla()) {
      const double r = qk_rope_dim, v = v_head_dim > 0 ? v_head_dim : d;
      const double q = q_lora_rank > 0 ? h * q_lora_rank + q_lora_rank * n * (d + r) + q_lora_rank
                                       : h * n * (d + r);
      const double kv = h * (kv_lora_rank + r) + kv_lora_rank * n * (d + v) + kv_lora_rank;
      return q + kv + n * v * h + h;
    }
    const double q = n * d, kv = static_cast<double>(kv_heads) * d;
    return h * (q + 2 * kv) + q * h + h;
  }
  //! Parameters of a dense FFN block (with its layer norm).
  [[nodiscard]] double dense_ffn_params() const noexcept {
    return ffn_matrices() * hidden * static_cast<double>(ffn) + hidden;
  }
  //! Routed-expert parameters of one MoE layer.
  [[nodiscard]] double expert_params() const noexcept {
    return static_cast<double>(experts) * ffn_matrices() * hidden * static_cast<double>(moe_ffn);
  }
  //! Non-expert parameters of one MoE layer: router, shared expert, layer norm.
  [[nodiscard]] double moe_dense_params() const noexcept {
    return static_cast<double>(hidden) * experts +
           ffn_matrices() * hidden * static_cast<double>(shared_ffn) + hidden;
  }
  //! All parameters, embedding and output layer included (untied), MTP layers included.
  [[nodiscard]] double total_params() const noexcept {
    const int moe = moe_layers(), dense = layers - moe;
    const double moe_layer = attention_params() + expert_params() + moe_dense_params();
    const double mtp = mtp_layers * (moe_layer + 2.0 * hidden * hidden + 3.0 * hidden);
    return dense * (attention_params() + dense_ffn_params()) + moe * moe_layer + mtp +
           2.0 * vocab * hidden + hidden;
  }
  //! Parameters one token passes through (top-k of the routed experts).
  [[nodiscard]] double active_params() const noexcept {
    const int moe = moe_layers(), dense = layers - moe;
    const double routed = static_cast<double>(topk) * ffn_matrices() * hidden * moe_ffn;
    const double moe_layer = attention_params() + routed + moe_dense_params();
    const double mtp = mtp_layers * (moe_layer + 2.0 * hidden * hidden + 3.0 * hidden);
    return dense * (attention_params() + dense_ffn_params()) + moe * moe_layer + mtp +
           2.0 * vocab * hidden + hidden;
  }
};

//! Checks that a model is self-consistent; the message names the field and its value.
[[nodiscard]] inline status validate(const model_config& m) {
  auto bad = [&](const std::string& what) {
    return make_error(errc::invalid_size, "model '" + m.name + "': " + what);
  };
  struct field {
    const char* name;
    int value;
    int min;
  };
  const field fields[] = {{"layers", m.layers, 1},
                          {"hidden", m.hidden, 1},
                          {"heads", m.heads, 1},
                          {"kv_heads", m.kv_heads, 1},
                          {"head_dim", m.head_dim, 0},
                          {"ffn", m.ffn, 0},
                          {"experts", m.experts, 1},
                          {"topk", m.topk, 1},
                          {"moe_ffn", m.moe_ffn, 0},
                          {"shared_ffn", m.shared_ffn, 0},
                          {"moe_layer_freq", m.moe_layer_freq, 1},
                          {"first_dense_layers", m.first_dense_layers, 0},
                          {"vocab", m.vocab, 1},
                          {"seq", m.seq, 1},
                          {"gbs", m.gbs, 1},
                          {"mbs", m.mbs, 1},
                          {"q_lora_rank", m.q_lora_rank, 0},
                          {"kv_lora_rank", m.kv_lora_rank, 0},
                          {"qk_rope_dim", m.qk_rope_dim, 0},
                          {"v_head_dim", m.v_head_dim, 0},
                          {"mtp_layers", m.mtp_layers, 0},
                          {"router_groups", m.router_groups, 0},
                          {"router_group_topk", m.router_group_topk, 0}};
  for (const auto& f : fields)
    if (f.value < f.min)
      return bad(std::string(f.name) + " must be >= " + std::to_string(f.min) + " (got " +
                 std::to_string(f.value) + ")");
  // The step model walks the layers; bound them so that a typo cannot stall a search.
  if (m.layers > 10000)
    return bad("layers must be <= 10000 (got " + std::to_string(m.layers) + ")");
  if (m.kv_heads > m.heads || m.heads % m.kv_heads != 0)
    return bad("heads = " + std::to_string(m.heads) +
               " must be a multiple of kv_heads = " + std::to_string(m.kv_heads));
  if (m.head_dim == 0 && m.hidden % m.heads != 0)
    return bad("hidden = " + std::to_string(m.hidden) +
               " is not divisible by heads = " + std::to_string(m.heads) + " (give head_dim)");
  if (m.topk > m.experts)
    return bad("topk = " + std::to_string(m.topk) +
               " exceeds experts = " + std::to_string(m.experts));
  if (m.experts > 1 && m.moe_ffn < 1) return bad("an MoE model (experts > 1) needs moe_ffn >= 1");
  if (m.moe_layers() < m.layers && m.ffn < 1)
    return bad("the model has dense layers, so ffn must be >= 1");
  if (m.mbs > m.gbs)
    return bad("mbs = " + std::to_string(m.mbs) + " exceeds gbs = " + std::to_string(m.gbs));
  if ((m.router_groups > 0) != (m.router_group_topk > 0))
    return bad("router_groups and router_group_topk go together (got " +
               std::to_string(m.router_groups) + " and " + std::to_string(m.router_group_topk) +
               ")");
  if (m.router_groups > 0) {
    if (m.experts % m.router_groups != 0)
      return bad("router_groups = " + std::to_string(m.router_groups) +
                 " must divide experts = " + std::to_string(m.experts));
    if (m.router_group_topk > m.router_groups)
      return bad("router_group_topk = " + std::to_string(m.router_group_topk) +
                 " exceeds router_groups = " + std::to_string(m.router_groups));
    if (static_cast<long long>(m.router_group_topk) * (m.experts / m.router_groups) < m.topk)
      return bad("topk = " + std::to_string(m.topk) + " exceeds the experts of " +
                 std::to_string(m.router_group_topk) + " groups");
  }
  if (m.kv_lora_rank == 0 && (m.q_lora_rank > 0 || m.qk_rope_dim > 0 || m.v_head_dim > 0))
    return bad("q_lora_rank, qk_rope_dim and v_head_dim are MLA fields: they need kv_lora_rank");
  return {};
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
