// moefold-plan's model and cluster files (examples/plan_files.hpp, nlohmann/json): valid files
// give the preset's numbers, and every kind of bad file, malformed JSON included, is an error that
// says what is wrong (with line and column where the text itself is malformed).
#include <moefold/plan/cluster.hpp>
#include <moefold/plan/model_flops.hpp>
#include <moefold/plan/model_presets.hpp>

#include <doctest/doctest.h>

#include <string>

#include "calibration_file.hpp"
#include "plan_files.hpp"

using namespace moefold;
using namespace moefold::plan;
using moefold::examples::cluster_from_json;
using moefold::examples::model_from_json;
using moefold::examples::parse_json_document;

TEST_CASE("valid documents parse to the values written, members in file order") {
  auto v = parse_json_document(
      R"( {"z": [1, -2.5e3, 0, true, false, null], "b": {"c": "x\"\\\/\n\u00e9\ud83d\ude00"},
      "d": []} )");
  REQUIRE(v.has_value());
  REQUIRE(v->is_object());
  REQUIRE(v->size() == 3);
  CHECK(v->begin().key() == "z");
  const auto& a = (*v)["z"];
  REQUIRE(a.size() == 6);
  CHECK(a[0].is_number_integer());
  CHECK(a[1].get<double>() == -2500.0);
  CHECK_FALSE(a[1].is_number_integer());
  CHECK(a[3].get<bool>());
  CHECK(a[5].is_null());
  // x, quote, backslash, slash, newline, e-acute (2 bytes), U+1F600 (4 bytes).
  CHECK((*v)["b"]["c"].get<std::string>() == std::string("x\"\\/\n\xC3\xA9\xF0\x9F\x98\x80"));
  CHECK((*v)["d"].empty());
}

TEST_CASE("malformed documents are errors, with line and column where the text is malformed") {
  struct bad_case {
    const char* text;
    const char* says;
  };
  const bad_case cases[] = {
      {"", "at line 1, column 1: syntax error while parsing value - unexpected end of input"},
      {"{\"a\": 1,}", "at line 1, column 9"},
      {"[1, 2,]", "unexpected ']'"},
      {"{\"a\": 01}", "at line 1, column 8"},
      {"{\"a\": 1, \"a\": 2}", "duplicate member name \"a\""},
      {"{\"x\": {\"a\": 1, \"b\": {\"a\": 2}, \"a\": 3}}", "duplicate member name \"a\""},
      {"{\"a\": \"abc", "missing closing quote"},
      {"{\"a\": \"a\tb\"}", "control character U+0009"},
      {"{\"a\": NaN}", "invalid literal"},
      {"{\"a\": 1} x", "expected end of input"},
      {"{\"a\" 1}", "expected ':'"},
      {"[1 2]", "expected ']'"},
      {"-", "expected digit after '-'"},
      {"1.", "expected digit after '.'"},
      {"1e+", "expected digit after exponent sign"},
      {"\"\\x\"", "forbidden character after backslash"},
      {"\"\\u12g4\"", "must be followed by 4 hex digits"},
      {"\"\\ud800\"", "must be followed by U+DC00..U+DFFF"},
      {"\"\\udc00\"", "must follow U+D800..U+DBFF"},
      {"tru", "invalid literal"},
      {"1e999", "number overflow"},
      {"// comment\n{}", "at line 1, column 1"},
      {"{\n  \"a\": 1,\n  \"b\": [1,,2]\n}", "at line 3, column 11"},
      // A member name given twice: where the second one begins (its opening quote).
      {"{\"a\": 1,\n \"a\": 2}", "at line 2, column 2: duplicate member name \"a\""},
      {"{\"x\\\"\": 1, \"x\\\"\": 2}", "at line 1, column 12: duplicate member name \"x\\\"\""},
      {"\xEF\xBB\xBF{\"a\":1,\"a\":2}", "at line 1, column 11: duplicate member name"},
  };
  for (const auto& c : cases) {
    auto v = parse_json_document(c.text);
    INFO(c.text);
    REQUIRE_FALSE(v.has_value());
    CHECK(v.error().code == errc::invalid_argument);
    CHECK(v.error().message.find("malformed JSON") == 0);
    CHECK(v.error().message.find(c.says) != std::string::npos);
    CHECK(v.error().message.find('\n') == std::string::npos);
  }
}

TEST_CASE("nesting is bounded") {
  std::string deep(65, '['), ok(64, '[');
  deep += std::string(65, ']');
  ok += std::string(64, ']');
  CHECK(parse_json_document(ok).has_value());
  auto v = parse_json_document(deep);
  REQUIRE_FALSE(v.has_value());
  CHECK(v.error().message.find("at line 1, column 65: nesting deeper than 64") !=
        std::string::npos);
  std::string huge(100000, '[');
  CHECK_FALSE(parse_json_document(huge).has_value());
}

TEST_CASE("model JSON: the preset's fields reproduce the preset") {
  const char* text = R"({"name": "mixtral-8x7b", "layers": 32, "hidden": 4096, "heads": 32,
    "kv_heads": 8, "ffn": 14336, "experts": 8, "topk": 2, "moe_ffn": 14336, "vocab": 32000,
    "seq": 4096, "gbs": 256, "mbs": 1, "dtype": "bf16", "gated": true})";
  auto m = model_from_json(text);
  REQUIRE(m.has_value());
  const auto p = model_preset("mixtral-8x7b").value();
  CHECK(m->total_params() == p.total_params());
  CHECK(megatron_model_flops(*m, 1) == megatron_model_flops(p, 1));
  CHECK(model_from_json(R"({"layers": 2, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8})")
            ->kv_heads == 2);
}

TEST_CASE("model JSON: every kind of bad file is a clear error") {
  struct bad_case {
    const char* text;
    const char* says;
  };
  const bad_case cases[] = {
      {"[1]", "must be a JSON object"},
      {R"({"layers": 2, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8, "colour": 1})",
       "unknown model member \"colour\""},
      {R"({"layers": 2.5, "hidden": 8, "heads": 2, "vocab": 10})", "must be an integer"},
      {R"({"layers": "2", "hidden": 8, "heads": 2, "vocab": 10})", "must be an integer"},
      {R"({"layers": 1e3, "hidden": 8, "heads": 2, "vocab": 10})", "must be an integer"},
      {R"({"layers": 4294967296, "hidden": 8, "heads": 2, "vocab": 10})", "does not fit"},
      {R"({"layers": -4294967296, "hidden": 8, "heads": 2, "vocab": 10})", "does not fit"},
      {R"({"hidden": 8, "heads": 2, "vocab": 10})", "lacks the required member \"layers\""},
      {R"({"layers": 2, "hidden": 8, "heads": 3, "kv_heads": 2, "vocab": 10, "ffn": 8})",
       "multiple of kv_heads"},
      {R"({"layers": 0, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8})", "layers must be >= 1"},
      {R"({"layers": 2000000000, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8})",
       "layers must be <= 10000"},
      {R"({"layers": 2, "hidden": 8, "heads": 2, "vocab": 10, "experts": 4, "topk": 5,
          "moe_ffn": 8})",
       "topk = 5 exceeds experts = 4"},
      {R"({"layers": 2, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8, "dtype": "fp16"})",
       "\"bf16\" or \"fp8\""},
      {R"({"layers": 2, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8, "gated": 1})",
       "true or false"},
      {R"({"layers": 2, "hidden": 8, "heads": 2, "vocab": 10})", "ffn must be >= 1"},
      {R"({"layers": 2, "layers": 3, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8})",
       "duplicate member name \"layers\""},
      {"{\"layers\": 2,", "malformed JSON at line 1"},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    auto m = model_from_json(c.text);
    REQUIRE_FALSE(m.has_value());
    CHECK(m.error().message.find(c.says) != std::string::npos);
  }
}

TEST_CASE("cluster JSON files") {
  auto c = cluster_from_json(R"({"name": "mine", "gpus_per_node": 4, "peak_bf16_flops": 3e14,
      "memory_gib": 40, "memory_bw": 1.5e12, "intra_bw": 3e11, "inter_bw": 2.5e10})");
  REQUIRE(c.has_value());
  CHECK(c->gpus_per_node == 4);
  CHECK(c->peak_bf16_flops == 3e14);
  CHECK(c->memory_gib == 40.0);
  CHECK(c->inter_latency_s == cluster_config{}.inter_latency_s);
  const char* bad[] = {
      R"({"gpus_per_node": 4, "memory_gib": 40, "memory_bw": 1.5e12, "intra_bw": 3e11,
          "inter_bw": 2.5e10})",
      R"({"peak_bf16_flops": 3e14, "memory_gib": -40, "memory_bw": 1.5e12, "intra_bw": 3e11,
          "inter_bw": 2.5e10})",
      R"({"peak_bf16_flops": 3e14, "memory_gib": 40, "memory_bw": 1.5e12, "intra_bw": 3e11,
          "inter_bw": 2.5e10, "gpus_per_node": 0})",
      R"({"peak_bf16_flops": 3e14, "memory_gib": 40, "memory_bw": 1.5e12, "intra_bw": 3e11,
          "inter_bw": 2.5e10, "nvlink": 1})",
      R"({"peak_bf16_flops": "fast", "memory_gib": 40, "memory_bw": 1.5e12, "intra_bw": 3e11,
          "inter_bw": 2.5e10})"};
  for (const char* t : bad) {
    INFO(t);
    CHECK_FALSE(cluster_from_json(t).has_value());
  }
}

TEST_CASE("calibration files: units, the NIC share of an inter-node all-to-all, merged rings") {
  const auto c = moefold::examples::calibration_from_json(R"({
    "gpu": {"name": "H200", "peak_bf16_tflops": 989, "memory_tbs": 4.8},
    "gemm": [{"M": 8192, "K": 8192, "N": 8192, "tflops": 779}],
    "attn": [{"S": 4096, "causal": true, "fwdbwd_tflops": 400}],
    "memory": {"copy_tbs": 4.21},
    "collectives": [
      {"op": "all_to_all", "link": "inter", "bytes": 1e6, "busbw_gbs": 30, "gpus": 16},
      {"op": "all_gather", "link": "intra", "bytes": 1e6, "busbw_gbs": 90},
      {"op": "all_reduce", "link": "intra", "bytes": 1e6, "busbw_gbs": 80}]})",
                                                          8);
  REQUIRE(c.has_value());
  CHECK(c->measured_peak_flops == 989e12);
  CHECK(c->measured_memory_bw == 4.8e12);
  CHECK(c->gemm.at(0).flops == 779e12);
  CHECK(c->attention.at(0).value == 400e12);
  CHECK(c->copy_bw == 4.21e12);
  // 16 GPUs over nodes of 8: 8 of a rank's 15 peers are off-node, so its NIC carries 8/15 of
  // the bytes the bus bandwidth counts.
  CHECK(c->collectives.a2a_inter.at(0).value == doctest::Approx(30e9 * 8 / 15).epsilon(1e-15));
  REQUIRE(c->collectives.ring_intra.size() == 1);  // one size: the slower of the two ops
  CHECK(c->collectives.ring_intra[0].value == 80e9);
  // Nested deeper than the limit: refused at once, naming the rule.
  const auto deep = moefold::examples::calibration_from_json(
      std::string(100000, '[') + std::string(100000, ']'), 8);
  REQUIRE(!deep);
  CHECK(deep.error().message.find("nesting deeper than") != std::string::npos);
}
