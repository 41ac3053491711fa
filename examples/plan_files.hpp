// moefold-plan's model and cluster files, read with nlohmann/json (the library's plan/ takes the
// structs; reading files is the tool's business). Strict: malformed JSON is an error at a line
// and column, a member name given twice in one object is an error (nlohmann would keep the last),
// every member must be known, integers must be written as integers in range, required members
// must be present, nesting is bounded, and the result is validated like a preset. The JSON
// Schema of both files is docs/planner-model.schema.json and docs/planner-cluster.schema.json.
#pragma once

#include <moefold/core/expected.hpp>
#include <moefold/plan/cluster.hpp>
#include <moefold/plan/model.hpp>

#include "json_document.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace moefold::examples {

namespace detail {

inline std::string kind_of(const ordered_json& v) {
  if (v.is_number()) return v.dump();
  const std::string t = v.type_name();
  return (t == "array" || t == "object") ? "an " + t : "a " + t;
}

inline status json_int(const ordered_json& v, const std::string& what, int& out) {
  if (!v.is_number_integer())
    return make_error(errc::invalid_argument,
                      what + " must be an integer (got " + kind_of(v) + ")");
  const bool fits = v.is_number_unsigned()
                        ? v.get<std::uint64_t>() <= INT_MAX
                        : v.get<std::int64_t>() >= INT_MIN && v.get<std::int64_t>() <= INT_MAX;
  if (!fits)
    return make_error(errc::invalid_argument, what + " = " + v.dump() + " does not fit in 32 bits");
  out = v.get<int>();
  return {};
}

inline status json_double(const ordered_json& v, const std::string& what, double& out) {
  if (!v.is_number() || !std::isfinite(v.get<double>()))
    return make_error(errc::invalid_argument, what + " must be a number (got " + kind_of(v) + ")");
  out = v.get<double>();
  return {};
}

// A name goes into error messages and output lines: a string without control characters.
inline bool is_label(const ordered_json& v) {
  if (!v.is_string()) return false;
  for (unsigned char ch : v.get_ref<const std::string&>())
    if (ch < 0x20 || ch == 0x7f) return false;
  return true;
}

inline status json_object(const ordered_json& v, const std::string& what) {
  if (!v.is_object())
    return make_error(errc::invalid_argument,
                      what + " must be a JSON object (got " + kind_of(v) + ")");
  return {};
}

// One member a file may have: its name and the field it fills, whose type gives the rule its
// value follows (an integer that fits in int, a finite number, a name, a dtype, a boolean).
struct member {
  const char* key;
  std::variant<int*, double*, std::string*, plan::precision*, bool*> field;
};

inline status read_value(const ordered_json& v, const std::string& where, int* dst) {
  return json_int(v, where, *dst);
}
inline status read_value(const ordered_json& v, const std::string& where, double* dst) {
  return json_double(v, where, *dst);
}
inline status read_value(const ordered_json& v, const std::string& where, std::string* dst) {
  if (!is_label(v))
    return make_error(errc::invalid_argument,
                      where + " must be a string without control characters");
  *dst = v.get<std::string>();
  return {};
}
inline status read_value(const ordered_json& v, const std::string& where, plan::precision* dst) {
  if (!v.is_string() || (v != "bf16" && v != "fp8"))
    return make_error(errc::invalid_argument, where + " must be \"bf16\" or \"fp8\"");
  *dst = v == "fp8" ? plan::precision::fp8 : plan::precision::bf16;
  return {};
}
inline status read_value(const ordered_json& v, const std::string& where, bool* dst) {
  if (!v.is_boolean()) return make_error(errc::invalid_argument, where + " must be true or false");
  *dst = v.get<bool>();
  return {};
}

// Reads a `what` file ("model", "cluster") into the fields of `members`, members in file order:
// the document must be an object, every member known (the message lists the known ones in the
// order of `members`) and valid, and the `required` ones present.
inline status read_members(const ordered_json& doc, const std::string& what,
                           std::span<const member> members, std::span<const char* const> required) {
  if (auto ok = json_object(doc, "a " + what + " file"); !ok) return ok;
  for (const auto& item : doc.items()) {
    const std::string& key = item.key();
    const ordered_json& v = item.value();
    const std::string where = what + " member " + quoted(key);
    const auto m =
        std::find_if(members.begin(), members.end(), [&](const member& x) { return key == x.key; });
    if (m == members.end()) {
      std::string known;
      for (const auto& x : members) known += (known.empty() ? "" : ", ") + std::string(x.key);
      return make_error(errc::invalid_argument, "unknown " + where + " (known: " + known + ")");
    }
    if (auto ok = std::visit([&](auto* dst) { return read_value(v, where, dst); }, m->field); !ok)
      return ok;
  }
  for (const char* req : required)
    if (!doc.contains(req))
      return make_error(errc::invalid_argument,
                        "the " + what + " file lacks the required member \"" + req + "\"");
  return {};
}

}  // namespace detail

//! A model from JSON: {"name": "..", "layers": 32, "hidden": 4096, ...}. Members are the fields
//! of model_config; "dtype" is "bf16" or "fp8", "gated" a boolean. Required: layers, hidden,
//! heads, vocab; kv_heads defaults to heads.
[[nodiscard]] inline expected<plan::model_config> model_from_json(std::string_view text) {
  auto doc = parse_json_document(text);
  if (!doc) return unexpected<error>(doc.error());
  plan::model_config m;
  m.kv_heads = -1;
  const detail::member members[] = {{"name", &m.name},
                                    {"layers", &m.layers},
                                    {"hidden", &m.hidden},
                                    {"heads", &m.heads},
                                    {"kv_heads", &m.kv_heads},
                                    {"head_dim", &m.head_dim},
                                    {"ffn", &m.ffn},
                                    {"experts", &m.experts},
                                    {"topk", &m.topk},
                                    {"moe_ffn", &m.moe_ffn},
                                    {"shared_ffn", &m.shared_ffn},
                                    {"moe_layer_freq", &m.moe_layer_freq},
                                    {"first_dense_layers", &m.first_dense_layers},
                                    {"vocab", &m.vocab},
                                    {"seq", &m.seq},
                                    {"gbs", &m.gbs},
                                    {"mbs", &m.mbs},
                                    {"dtype", &m.dtype},
                                    {"gated", &m.gated},
                                    {"q_lora_rank", &m.q_lora_rank},
                                    {"kv_lora_rank", &m.kv_lora_rank},
                                    {"qk_rope_dim", &m.qk_rope_dim},
                                    {"v_head_dim", &m.v_head_dim},
                                    {"mtp_layers", &m.mtp_layers},
                                    {"router_groups", &m.router_groups},
                                    {"router_group_topk", &m.router_group_topk}};
  const char* const required[] = {"layers", "hidden", "heads", "vocab"};
  if (auto ok = detail::read_members(*doc, "model", members, required); !ok)
    return unexpected<error>(ok.error());
  if (!doc->contains("kv_heads")) m.kv_heads = m.heads;
  if (auto ok = plan::validate(m); !ok) return unexpected<error>(ok.error());
  return m;
}

//! A cluster from JSON: {"name": "..", "gpus_per_node": 8, "peak_bf16_flops": 989e12, ...}.
//! Members are the fields of cluster_config except gpus (given on the command line; a "gpus"
//! member is accepted as the default). Required: peak_bf16_flops, memory_gib, memory_bw,
//! intra_bw, inter_bw.
[[nodiscard]] inline expected<plan::cluster_config> cluster_from_json(std::string_view text) {
  auto doc = parse_json_document(text);
  if (!doc) return unexpected<error>(doc.error());
  plan::cluster_config c;
  c.gpus = 1;
  const detail::member members[] = {{"name", &c.name},
                                    {"gpus", &c.gpus},
                                    {"gpus_per_node", &c.gpus_per_node},
                                    {"peak_bf16_flops", &c.peak_bf16_flops},
                                    {"peak_fp8_flops", &c.peak_fp8_flops},
                                    {"memory_gib", &c.memory_gib},
                                    {"memory_bw", &c.memory_bw},
                                    {"intra_bw", &c.intra_bw},
                                    {"inter_bw", &c.inter_bw},
                                    {"intra_latency_s", &c.intra_latency_s},
                                    {"inter_latency_s", &c.inter_latency_s}};
  const char* const required[] = {"peak_bf16_flops", "memory_gib", "memory_bw", "intra_bw",
                                  "inter_bw"};
  if (auto ok = detail::read_members(*doc, "cluster", members, required); !ok)
    return unexpected<error>(ok.error());
  if (auto ok = plan::validate(c); !ok) return unexpected<error>(ok.error());
  return c;
}

//! A model as a model file (every member written), which model_from_json reads back.
[[nodiscard]] inline ordered_json model_to_json(const plan::model_config& m) {
  return {{"name", m.name},
          {"layers", m.layers},
          {"hidden", m.hidden},
          {"heads", m.heads},
          {"kv_heads", m.kv_heads},
          {"head_dim", m.head_dim},
          {"ffn", m.ffn},
          {"experts", m.experts},
          {"topk", m.topk},
          {"moe_ffn", m.moe_ffn},
          {"shared_ffn", m.shared_ffn},
          {"moe_layer_freq", m.moe_layer_freq},
          {"first_dense_layers", m.first_dense_layers},
          {"vocab", m.vocab},
          {"seq", m.seq},
          {"gbs", m.gbs},
          {"mbs", m.mbs},
          {"dtype", m.dtype == plan::precision::fp8 ? "fp8" : "bf16"},
          {"gated", m.gated},
          {"q_lora_rank", m.q_lora_rank},
          {"kv_lora_rank", m.kv_lora_rank},
          {"qk_rope_dim", m.qk_rope_dim},
          {"v_head_dim", m.v_head_dim},
          {"mtp_layers", m.mtp_layers},
          {"router_groups", m.router_groups},
          {"router_group_topk", m.router_group_topk}};
}

//! A cluster as a cluster file (without gpus, which the command line gives).
[[nodiscard]] inline ordered_json cluster_to_json(const plan::cluster_config& c) {
  return {{"name", c.name},
          {"gpus_per_node", c.gpus_per_node},
          {"peak_bf16_flops", c.peak_bf16_flops},
          {"peak_fp8_flops", c.peak_fp8_flops},
          {"memory_gib", c.memory_gib},
          {"memory_bw", c.memory_bw},
          {"intra_bw", c.intra_bw},
          {"inter_bw", c.inter_bw},
          {"intra_latency_s", c.intra_latency_s},
          {"inter_latency_s", c.inter_latency_s}};
}

}  // namespace moefold::examples
