// Models and clusters: parameter counts against hand arithmetic and the published sizes, the
// Megatron-Core model-FLOPs formula against a hand-computed small case, presets (JSON files:
// plan_files_test.cpp).
#include <moefold/plan/cluster.hpp>
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

TEST_CASE("cluster presets") {
  for (auto n : cluster_preset_names) {
    auto c = cluster_preset(n).value();
    c.gpus = 8;
    CHECK(validate(c).has_value());
  }
  cluster_config zero = cluster_preset("h100-sxm").value();
  zero.gpus = 0;
  auto z = validate(zero);
  REQUIRE_FALSE(z.has_value());
  CHECK(z.error().message.find("GPUs must be >= 1") != std::string::npos);
}
