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

#include <nlohmann/json.hpp>

#include <climits>
#include <cmath>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace moefold::examples {

using ordered_json = nlohmann::ordered_json;

//! Deepest nesting of arrays and objects a file may have.
inline constexpr int max_json_depth = 64;

namespace detail {
// A member name as it appears in a message: JSON-quoted, so that control characters and invalid
// UTF-8 cannot split or garble the one error line.
inline std::string quoted(const std::string& key) {
  return ordered_json(key).dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}
}  // namespace detail

//! The document in `text`, members in file order.
[[nodiscard]] inline expected<ordered_json> parse_json_document(std::string_view text) {
  std::vector<std::set<std::string>> open;  // the member names of each open object
  std::string problem;
  const ordered_json::parser_callback_t check = [&](int depth, ordered_json::parse_event_t event,
                                                    ordered_json& parsed) {
    using ev = ordered_json::parse_event_t;
    if ((event == ev::object_start || event == ev::array_start) && depth >= max_json_depth &&
        problem.empty())
      problem = "nesting deeper than " + std::to_string(max_json_depth) + " levels";
    if (event == ev::object_start) open.emplace_back();
    if (event == ev::object_end && !open.empty()) open.pop_back();
    if (event == ev::key && !open.empty() &&
        !open.back().insert(parsed.get<std::string>()).second && problem.empty())
      problem = "duplicate member name " + detail::quoted(parsed.get<std::string>()) +
                " (rule: each member at most once per object)";
    return true;
  };
  try {
    auto doc = ordered_json::parse(text.begin(), text.end(), check);
    if (!problem.empty()) return make_error(errc::invalid_argument, "malformed JSON: " + problem);
    return doc;
  } catch (const ordered_json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error ..."
    std::string what = e.what();
    const auto at = what.find(" at line ");
    what = at == std::string::npos ? what : what.substr(at + 1);
    return make_error(errc::invalid_argument, "malformed JSON " + what);
  } catch (const ordered_json::exception& e) {
    // "[json.exception.out_of_range.406] number overflow parsing '1e999'"
    std::string what = e.what();
    const auto end = what.find("] ");
    return make_error(
        errc::invalid_argument,
        "malformed JSON: " + (end == std::string::npos ? what : what.substr(end + 2)));
  }
}

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

}  // namespace detail

//! A model from JSON: {"name": "..", "layers": 32, "hidden": 4096, ...}. Members are the fields
//! of model_config; "dtype" is "bf16" or "fp8", "gated" a boolean. Required: layers, hidden,
//! heads, vocab; kv_heads defaults to heads.
[[nodiscard]] inline expected<plan::model_config> model_from_json(std::string_view text) {
  auto doc = parse_json_document(text);
  if (!doc) return unexpected<error>(doc.error());
  if (auto ok = detail::json_object(*doc, "a model file"); !ok)
    return unexpected<error>(ok.error());
  plan::model_config m;
  m.kv_heads = -1;
  struct int_field {
    const char* key;
    int* dst;
  };
  const int_field ints[] = {{"layers", &m.layers},
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
                            {"q_lora_rank", &m.q_lora_rank},
                            {"kv_lora_rank", &m.kv_lora_rank},
                            {"qk_rope_dim", &m.qk_rope_dim},
                            {"v_head_dim", &m.v_head_dim},
                            {"mtp_layers", &m.mtp_layers}};
  for (const auto& [key, v] : doc->items()) {
    const std::string where = "model member " + detail::quoted(key);
    bool known = false;
    for (const auto& f : ints)
      if (key == f.key) {
        if (auto ok = detail::json_int(v, where, *f.dst); !ok) return unexpected<error>(ok.error());
        known = true;
      }
    if (known) continue;
    if (key == "name") {
      if (!detail::is_label(v))
        return make_error(errc::invalid_argument,
                          where + " must be a string without control characters");
      m.name = v.get<std::string>();
    } else if (key == "dtype") {
      if (!v.is_string() || (v != "bf16" && v != "fp8"))
        return make_error(errc::invalid_argument, where + " must be \"bf16\" or \"fp8\"");
      m.dtype = v == "fp8" ? plan::precision::fp8 : plan::precision::bf16;
    } else if (key == "gated") {
      if (!v.is_boolean())
        return make_error(errc::invalid_argument, where + " must be true or false");
      m.gated = v.get<bool>();
    } else {
      return make_error(errc::invalid_argument,
                        "unknown " + where +
                            " (known: name, layers, hidden, heads, kv_heads, head_dim, ffn, "
                            "experts, topk, moe_ffn, shared_ffn, moe_layer_freq, "
                            "first_dense_layers, vocab, seq, gbs, mbs, dtype, gated, q_lora_rank, "
                            "kv_lora_rank, qk_rope_dim, v_head_dim, mtp_layers)");
    }
  }
  for (const char* req : {"layers", "hidden", "heads", "vocab"})
    if (!doc->contains(req))
      return make_error(errc::invalid_argument,
                        std::string("the model file lacks the required member \"") + req + "\"");
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
  if (auto ok = detail::json_object(*doc, "a cluster file"); !ok)
    return unexpected<error>(ok.error());
  plan::cluster_config c;
  c.gpus = 1;
  struct dbl_field {
    const char* key;
    double* dst;
  };
  const dbl_field dbls[] = {{"peak_bf16_flops", &c.peak_bf16_flops},
                            {"peak_fp8_flops", &c.peak_fp8_flops},
                            {"memory_gib", &c.memory_gib},
                            {"memory_bw", &c.memory_bw},
                            {"intra_bw", &c.intra_bw},
                            {"inter_bw", &c.inter_bw},
                            {"intra_latency_s", &c.intra_latency_s},
                            {"inter_latency_s", &c.inter_latency_s}};
  for (const auto& [key, v] : doc->items()) {
    const std::string where = "cluster member " + detail::quoted(key);
    bool known = false;
    for (const auto& f : dbls)
      if (key == f.key) {
        if (auto ok = detail::json_double(v, where, *f.dst); !ok)
          return unexpected<error>(ok.error());
        known = true;
      }
    if (known) continue;
    if (key == "name") {
      if (!detail::is_label(v))
        return make_error(errc::invalid_argument,
                          where + " must be a string without control characters");
      c.name = v.get<std::string>();
    } else if (key == "gpus_per_node") {
      if (auto ok = detail::json_int(v, where, c.gpus_per_node); !ok)
        return unexpected<error>(ok.error());
    } else if (key == "gpus") {
      if (auto ok = detail::json_int(v, where, c.gpus); !ok) return unexpected<error>(ok.error());
    } else {
      return make_error(errc::invalid_argument,
                        "unknown " + where +
                            " (known: name, gpus, gpus_per_node, peak_bf16_flops, "
                            "peak_fp8_flops, memory_gib, memory_bw, intra_bw, inter_bw, "
                            "intra_latency_s, inter_latency_s)");
    }
  }
  for (const char* req : {"peak_bf16_flops", "memory_gib", "memory_bw", "intra_bw", "inter_bw"})
    if (!doc->contains(req))
      return make_error(errc::invalid_argument,
                        std::string("the cluster file lacks the required member \"") + req + "\"");
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
          {"mtp_layers", m.mtp_layers}};
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
