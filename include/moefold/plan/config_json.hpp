//! @file config_json.hpp
//! @brief Model and cluster descriptions from JSON text. Strict: every member must be known,
//! integers must be written as integers in range, required members must be present, and the
//! result is validated like a preset.
#pragma once

#include <cmath>
#include <string>
#include <string_view>

#include "../core/expected.hpp"
#include "cluster.hpp"
#include "json.hpp"
#include "model.hpp"

namespace moefold::plan {

namespace detail {

inline status json_int(const json_value& v, std::string_view what, int& out) {
  if (v.type != json_value::kind::number || !v.integral)
    return make_error(
        errc::invalid_argument,
        std::string(what) + " must be an integer (got " +
            (v.type == json_value::kind::number ? v.text : std::string(to_string(v.type))) + ")");
  if (v.number > 2147483647.0 || v.number < -2147483648.0)
    return make_error(errc::invalid_argument,
                      std::string(what) + " = " + v.text + " does not fit in 32 bits");
  out = static_cast<int>(v.number);
  return {};
}

inline status json_double(const json_value& v, std::string_view what, double& out) {
  if (v.type != json_value::kind::number || !std::isfinite(v.number))
    return make_error(errc::invalid_argument, std::string(what) + " must be a number (got " +
                                                  std::string(to_string(v.type)) + ")");
  out = v.number;
  return {};
}

inline status json_object(const json_value& v, std::string_view what) {
  if (v.type != json_value::kind::object)
    return make_error(errc::invalid_argument, std::string(what) + " must be a JSON object (got " +
                                                  std::string(to_string(v.type)) + ")");
  return {};
}

}  // namespace detail

//! A model from JSON: {"name": "..", "layers": 32, "hidden": 4096, ...}. Members are the fields
//! of model_config; "dtype" is "bf16" or "fp8", "gated" a boolean. Required: layers, hidden,
//! heads, vocab; kv_heads defaults to heads.
[[nodiscard]] inline expected<model_config> model_from_json(std::string_view text) {
  auto doc = parse_json(text);
  if (!doc) return unexpected<error>(doc.error());
  if (auto ok = detail::json_object(*doc, "a model file"); !ok)
    return unexpected<error>(ok.error());
  model_config m;
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
  for (const auto& [key, v] : doc->members) {
    const std::string where = "model member \"" + key + "\"";
    bool known = false;
    for (const auto& f : ints)
      if (key == f.key) {
        if (auto ok = detail::json_int(v, where, *f.dst); !ok) return unexpected<error>(ok.error());
        known = true;
      }
    if (known) continue;
    if (key == "name") {
      if (v.type != json_value::kind::string)
        return make_error(errc::invalid_argument, where + " must be a string");
      m.name = v.text;
    } else if (key == "dtype") {
      if (v.type != json_value::kind::string || (v.text != "bf16" && v.text != "fp8"))
        return make_error(errc::invalid_argument, where + " must be \"bf16\" or \"fp8\"");
      m.dtype = v.text == "fp8" ? precision::fp8 : precision::bf16;
    } else if (key == "gated") {
      if (v.type != json_value::kind::boolean)
        return make_error(errc::invalid_argument, where + " must be true or false");
      m.gated = v.boolean;
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
    if (!doc->find(req))
      return make_error(errc::invalid_argument,
                        std::string("the model file lacks the required member \"") + req + "\"");
  if (!doc->find("kv_heads")) m.kv_heads = m.heads;
  if (auto ok = validate(m); !ok) return unexpected<error>(ok.error());
  return m;
}

//! A cluster from JSON: {"name": "..", "gpus_per_node": 8, "peak_bf16_flops": 989e12, ...}.
//! Members are the fields of cluster_config except gpus (given on the command line; a "gpus"
//! member is accepted as the default). Required: peak_bf16_flops, memory_gib, memory_bw,
//! intra_bw, inter_bw.
[[nodiscard]] inline expected<cluster_config> cluster_from_json(std::string_view text) {
  auto doc = parse_json(text);
  if (!doc) return unexpected<error>(doc.error());
  if (auto ok = detail::json_object(*doc, "a cluster file"); !ok)
    return unexpected<error>(ok.error());
  cluster_config c;
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
  for (const auto& [key, v] : doc->members) {
    const std::string where = "cluster member \"" + key + "\"";
    bool known = false;
    for (const auto& f : dbls)
      if (key == f.key) {
        if (auto ok = detail::json_double(v, where, *f.dst); !ok)
          return unexpected<error>(ok.error());
        known = true;
      }
    if (known) continue;
    if (key == "name") {
      if (v.type != json_value::kind::string)
        return make_error(errc::invalid_argument, where + " must be a string");
      c.name = v.text;
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
    if (!doc->find(req))
      return make_error(errc::invalid_argument,
                        std::string("the cluster file lacks the required member \"") + req + "\"");
  if (auto ok = validate(c); !ok) return unexpected<error>(ok.error());
  return c;
}

}  // namespace moefold::plan
