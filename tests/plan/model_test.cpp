// Models and clusters: parameter counts against hand arithmetic and the published sizes, the
// Megatron-Core model-FLOPs formula against a hand-computed small case, presets, JSON files.
#include <moefold/plan/cluster.hpp>
#include <moefold/plan/config_json.hpp>
#include <moefold/plan/model.hpp>
#include <moefold/plan/model_flops.hpp>
#include <moefold/plan/model_presets.hpp>

#include <doctest/doctest.h>

#include <string>

using namespace moefold;
using namespace moefold::plan;

TEST_CASE("Mixtral-8x7B parameter count by hand and as published") {
  const auto m = model_preset("mixtral-8x7b").value();
  // Per layer: q 4096x4096, k and v 4096x1024 each, o 4096x4096, two norms of 4096, router
  // 4096x8, 8 experts of 3 x 4096x14336. Plus embedding and output 32000x4096, final norm.
  const double attn = 4096.0 * 4096 + 2 * 4096.0 * 1024 + 4096.0 * 4096 + 4096;
  const double moe = 4096.0 * 8 + 8 * 3 * 4096.0 * 14336 + 4096;
  const double total = 32 * (attn + moe) + 2 * 32000.0 * 4096 + 4096;
  CHECK(m.total_params() == doctest::Approx(total).epsilon(1e-12));
  CHECK(total == 46'702'792'704.0);  // Mistral's "46.7B total"
  const double active =
      32 * (attn + 4096.0 * 8 + 2 * 3 * 4096.0 * 14336 + 4096) + 2 * 32000.0 * 4096 + 4096;
  CHECK(m.active_params() == doctest::Approx(active).epsilon(1e-12));
  CHECK(active / 1e9 == doctest::Approx(12.9).epsilon(0.01));  // "12.9B active"
}

TEST_CASE("published sizes of the other presets") {
  struct want {
    const char* name;
    double total_b, active_b;
  };
  // Totals and active counts as the model cards state them (DeepSeek-V3: 671B + 14B MTP module).
  const want w[] = {{"mixtral-8x22b", 141, 39},
                    {"qwen2-57b-a14b", 57, 14},
                    {"qwen3-235b-a22b", 235, 22},
                    {"deepseek-v3", 685, 37},
                    {"llama3-8x70b", 465, 127}};
  for (const auto& x : w) {
    INFO(x.name);
    const auto m = model_preset(x.name).value();
    CHECK(validate(m).has_value());
    CHECK(m.total_params() / 1e9 == doctest::Approx(x.total_b).epsilon(0.02));
    CHECK(m.active_params() / 1e9 == doctest::Approx(x.active_b).epsilon(0.04));
  }
  for (auto n : model_preset_names) CHECK(model_preset(n).has_value());
  CHECK_FALSE(model_preset("mixtral-8x7").has_value());
  const auto g = model_preset("mixtral-8x22b-g8t8").value();
  CHECK(g.experts * g.moe_ffn == 8 * 16384);  // same expert parameters as Mixtral-8x22B
  CHECK(g.topk * g.moe_ffn == 16384);
  CHECK(model_preset("deepseek-v3")->moe_layers() == 58);
}

TEST_CASE("Megatron-Core model FLOPs of a small MoE model, by hand") {
  model_config m;
  m.layers = 2;
  m.hidden = 8;
  m.heads = 2;
  m.kv_heads = 1;
  m.ffn = 16;
  m.experts = 4;
  m.topk = 2;
  m.moe_ffn = 8;
  m.shared_ffn = 4;
  m.moe_layer_freq = 2;  // layer 0 is MoE, layer 1 dense
  m.vocab = 10;
  m.seq = 4;
  m.gbs = 3;
  REQUIRE(validate(m).has_value());
  // Per token (6 = 3 for forward and two backward GEMMs x 2 for FMA, as in training.py):
  // MLP: 6*8*(16*3*1 + 8*2*3*1 + 4*3*1) = 48*108 = 5184
  // attention (q = 8, kv = 4): 6*(8*(8+8) + 8*4/2*2 + 8*8) = 6*(128 + 32 + 64) = 1344, x 2 layers
  // logits: 6*8*10 = 480
  const double per_token = 5184 + 2 * 1344 + 480;
  CHECK(megatron_model_flops(m, 3) == doctest::Approx(3 * 4 * per_token).epsilon(1e-12));
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
      {"{\"layers\": 2,", "malformed JSON at line 1"},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    auto m = model_from_json(c.text);
    REQUIRE_FALSE(m.has_value());
    CHECK(m.error().message.find(c.says) != std::string::npos);
  }
}

TEST_CASE("cluster presets and JSON files") {
  for (auto n : cluster_preset_names) {
    auto c = cluster_preset(n).value();
    c.gpus = 8;
    CHECK(validate(c).has_value());
  }
  auto c = cluster_from_json(R"({"name": "mine", "gpus_per_node": 4, "peak_bf16_flops": 3e14,
      "memory_gib": 40, "memory_bw": 1.5e12, "intra_bw": 3e11, "inter_bw": 2.5e10})");
  REQUIRE(c.has_value());
  CHECK(c->gpus_per_node == 4);
  CHECK(c->peak_bf16_flops == 3e14);
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
  cluster_config zero = cluster_preset("h100-sxm").value();
  zero.gpus = 0;
  auto z = validate(zero);
  REQUIRE_FALSE(z.has_value());
  CHECK(z.error().message.find("GPUs must be >= 1") != std::string::npos);
}
