// moefold-plan's calibration file (--calibration FILE), read with nlohmann/json into
// plan::calibration (include/moefold/plan/calibration.hpp). JSON Schema:
// docs/planner-calibration.schema.json. The output of shared/bench/calibration_probe.py is
// accepted as it is ({"gemm": [{M, K, N, tflops}], "attn": [{S, B, heads, head_dim, causal,
// fwd_tflops, fwdbwd_tflops}]}); further sections hold what one GPU's probe cannot measure or
// what moefold's own benchmarks and nccl-tests report:
//   "source", "date", "commit": strings, where the numbers come from;
//   "gpu": {"name", "peak_bf16_tflops", "memory_tbs"}: the measured GPU (absent: the planned
//          cluster's GPU);
//   "expert_gemm": [{"rows_per_expert", "N", "K", "tflops"}]: per-expert GEMMs;
//   "memory": {"copy_tbs"}: memory-bound bandwidth (bytes read + written per second);
//   "collectives": [{"op": all_to_all | all_gather | reduce_scatter | all_reduce,
//                    "link": intra | inter, "bytes", "busbw_gbs", "gpus", optional "source"}]:
//          bus bandwidth (nccl-tests' busbw) by message size ("bytes": what nccl-tests calls
//          the size: per rank sent for all_to_all, the whole result for the others). An
//          inter-node all_to_all needs "gpus", the measured group's size: its busbw counts the
//          on-node bytes too, so the NIC's rate is busbw times the off-node share of a rank's
//          peers, (gpus - G) / (gpus - 1) with G GPUs per node of the planned cluster. Ring
//          collectives measured at the same size and link are merged, keeping the slowest.
// Strict like the model and cluster files: unknown members, wrong types, non-positive rates and
// two rates for one size are errors naming the member.
#pragma once

#include <moefold/core/expected.hpp>
#include <moefold/plan/calibration.hpp>

#include "a2a_bench_output.hpp"
#include "json_document.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <string_view>

namespace moefold::examples {

namespace detail {

// A number member of `v` named `key`, positive and finite.
inline status calibration_number(const ordered_json& v, const std::string& where, const char* key,
                                 double& out) {
  if (!v.contains(key)) return make_error(errc::invalid_argument, where + " lacks \"" + key + "\"");
  const auto& x = v[key];
  if (!x.is_number() || !(x.get<double>() > 0) || !std::isfinite(x.get<double>()))
    return make_error(errc::invalid_argument,
                      where + " member \"" + key + "\" must be a positive number (got " +
                          x.dump(-1, ' ', false, ordered_json::error_handler_t::replace) + ")");
  out = x.get<double>();
  return {};
}

inline status calibration_members(const ordered_json& v, const std::string& where,
                                  std::initializer_list<std::string_view> allowed) {
  if (!v.is_object()) return make_error(errc::invalid_argument, where + " must be an object");
  for (const auto& [k, x] : v.items()) {
    bool ok = false;
    for (auto a : allowed) ok = ok || k == a;
    if (!ok)
      return make_error(errc::invalid_argument,
                        "unknown " + where + " member " + detail::quoted(k));
  }
  return {};
}

}  // namespace detail

//! The calibration in `text`; `gpus_per_node` is the planned cluster's (for inter-node
//! all-to-all, see above).
[[nodiscard]] inline expected<plan::calibration> calibration_from_json(std::string_view text,
                                                                       int gpus_per_node) {
  auto doc = parse_json_document(text);
  if (!doc) return unexpected<error>(doc.error());
  const ordered_json& d = *doc;
  if (auto s = detail::calibration_members(d, "calibration",
                                           {"source", "date", "commit", "gpu", "gemm", "attn",
                                            "expert_gemm", "memory", "collectives"});
      !s)
    return unexpected<error>(s.error());
  plan::calibration c;
  for (const char* k : {"source", "date", "commit"})
    if (d.contains(k)) {
      if (!d[k].is_string())
        return make_error(errc::invalid_argument,
                          std::string("calibration member \"") + k + "\" must be a string");
      c.source += (c.source.empty() ? "" : ", ") + d[k].get<std::string>();
    }
  const auto array = [&](const char* key) -> expected<const ordered_json*> {
    if (!d.contains(key)) return static_cast<const ordered_json*>(nullptr);
    if (!d[key].is_array())
      return make_error(errc::invalid_argument,
                        std::string("calibration member \"") + key + "\" must be an array");
    return &d[key];
  };
  if (d.contains("gpu")) {
    const auto& g = d["gpu"];
    if (auto s = detail::calibration_members(g, "gpu", {"name", "peak_bf16_tflops", "memory_tbs"});
        !s)
      return unexpected<error>(s.error());
    if (g.contains("name") && !g["name"].is_string())
      return make_error(errc::invalid_argument, "gpu member \"name\" must be a string");
    for (auto [key, dst, unit] : {std::tuple{"peak_bf16_tflops", &c.measured_peak_flops, 1e12},
                                  std::tuple{"memory_tbs", &c.measured_memory_bw, 1e12}}) {
      if (!g.contains(key)) continue;
      if (auto s = detail::calibration_number(g, "gpu", key, *dst); !s)
        return unexpected<error>(s.error());
      *dst *= unit;
    }
  }
  auto gemm = array("gemm");
  if (!gemm) return unexpected<error>(gemm.error());
  if (*gemm)
    for (std::size_t i = 0; i < (*gemm)->size(); ++i) {
      const auto& v = (**gemm)[i];
      const std::string where = "gemm[" + std::to_string(i) + "]";
      if (auto s = detail::calibration_members(v, where, {"M", "K", "N", "tflops"}); !s)
        return unexpected<error>(s.error());
      plan::gemm_rate r;
      for (auto [key, dst] : {std::pair{"M", &r.m}, std::pair{"K", &r.k}, std::pair{"N", &r.n},
                              std::pair{"tflops", &r.flops}})
        if (auto s = detail::calibration_number(v, where, key, *dst); !s)
          return unexpected<error>(s.error());
      r.flops *= 1e12;
      c.gemm.push_back(r);
    }
  auto expert = array("expert_gemm");
  if (!expert) return unexpected<error>(expert.error());
  if (*expert)
    for (std::size_t i = 0; i < (*expert)->size(); ++i) {
      const auto& v = (**expert)[i];
      const std::string where = "expert_gemm[" + std::to_string(i) + "]";
      if (auto s = detail::calibration_members(v, where, {"rows_per_expert", "N", "K", "tflops"});
          !s)
        return unexpected<error>(s.error());
      plan::gemm_rate r;
      for (auto [key, dst] : {std::pair{"rows_per_expert", &r.m}, std::pair{"K", &r.k},
                              std::pair{"N", &r.n}, std::pair{"tflops", &r.flops}})
        if (auto s = detail::calibration_number(v, where, key, *dst); !s)
          return unexpected<error>(s.error());
      r.flops *= 1e12;
      c.expert_gemm.push_back(r);
    }
  auto attn = array("attn");
  if (!attn) return unexpected<error>(attn.error());
  if (*attn)
    for (std::size_t i = 0; i < (*attn)->size(); ++i) {
      const auto& v = (**attn)[i];
      const std::string where = "attn[" + std::to_string(i) + "]";
      if (auto s = detail::calibration_members(
              v, where, {"S", "B", "heads", "head_dim", "causal", "fwd_tflops", "fwdbwd_tflops"});
          !s)
        return unexpected<error>(s.error());
      if (v.contains("causal") && v["causal"] != true)
        return make_error(errc::invalid_argument,
                          where + ": only causal attention is modelled (\"causal\": true)");
      plan::sized_rate r;
      if (auto s = detail::calibration_number(v, where, "S", r.size); !s)
        return unexpected<error>(s.error());
      if (auto s = detail::calibration_number(v, where, "fwdbwd_tflops", r.value); !s)
        return unexpected<error>(s.error());
      r.value *= 1e12;
      c.attention.push_back(r);
    }
  if (d.contains("memory")) {
    if (auto s = detail::calibration_members(d["memory"], "memory", {"copy_tbs"}); !s)
      return unexpected<error>(s.error());
    if (auto s = detail::calibration_number(d["memory"], "memory", "copy_tbs", c.copy_bw); !s)
      return unexpected<error>(s.error());
    c.copy_bw *= 1e12;
  }
  auto coll = array("collectives");
  if (!coll) return unexpected<error>(coll.error());
  if (*coll)
    for (std::size_t i = 0; i < (*coll)->size(); ++i) {
      const auto& v = (**coll)[i];
      const std::string where = "collectives[" + std::to_string(i) + "]";
      if (auto s = detail::calibration_members(
              v, where, {"op", "link", "bytes", "busbw_gbs", "gpus", "source"});
          !s)
        return unexpected<error>(s.error());
      const std::string op =
          v.contains("op") && v["op"].is_string() ? v["op"].get<std::string>() : "";
      const std::string link =
          v.contains("link") && v["link"].is_string() ? v["link"].get<std::string>() : "";
      const bool a2a = op == "all_to_all";
      if (!a2a && op != "all_gather" && op != "reduce_scatter" && op != "all_reduce")
        return make_error(errc::invalid_argument,
                          where +
                              " member \"op\" must be all_to_all, all_gather, reduce_scatter "
                              "or all_reduce");
      if (link != "intra" && link != "inter")
        return make_error(errc::invalid_argument,
                          where + " member \"link\" must be intra or inter");
      if (v.contains("source") && !v["source"].is_string())
        return make_error(errc::invalid_argument, where + " member \"source\" must be a string");
      double gpus = 1;
      if (v.contains("gpus") || (a2a && link == "inter"))
        if (auto s = detail::calibration_number(v, where, "gpus", gpus); !s)
          return unexpected<error>(s.error());
      plan::sized_rate r;
      if (auto s = detail::calibration_number(v, where, "bytes", r.size); !s)
        return unexpected<error>(s.error());
      if (auto s = detail::calibration_number(v, where, "busbw_gbs", r.value); !s)
        return unexpected<error>(s.error());
      r.value *= 1e9;
      if (a2a && link == "inter") {
        if (gpus <= gpus_per_node)
          return make_error(errc::invalid_argument, where + ": an inter-node all_to_all of " +
                                                        std::to_string(gpus) +
                                                        " GPUs must span more than one node of " +
                                                        std::to_string(gpus_per_node) + " GPUs");
        r.value *= (gpus - gpus_per_node) / (gpus - 1);  // the NIC's share of the traffic
      }
      auto& t = link == "intra" ? (a2a ? c.collectives.a2a_intra : c.collectives.ring_intra)
                                : (a2a ? c.collectives.a2a_inter : c.collectives.ring_inter);
      if (!a2a) {  // all-gather, reduce-scatter and all-reduce at one size: the slowest counts
        auto same = std::find_if(t.begin(), t.end(),
                                 [&](const plan::sized_rate& x) { return x.size == r.size; });
        if (same != t.end()) {
          same->value = std::min(same->value, r.value);
          continue;
        }
      }
      t.push_back(r);
    }
  if (auto s = plan::normalize(c); !s) return unexpected<error>(s.error());
  if (c.measured_sections().empty())
    return make_error(errc::invalid_argument,
                      "a calibration file must hold at least one measured rate (gemm, attn, "
                      "expert_gemm, memory or collectives)");
  return c;
}

//! A calibration file as moefold-plan --calibration reads it: bench-comm-a2av-mpi's text output
//! as it is (a2a_bench_output.hpp), or the JSON above.
[[nodiscard]] inline expected<plan::calibration> calibration_from_file_text(std::string_view text,
                                                                            int gpus_per_node) {
  if (is_a2a_bench_output(text)) return calibration_from_a2a_bench(text);
  return calibration_from_json(text, gpus_per_node);
}

}  // namespace moefold::examples
