// The step model against hand-computed values on a small model: memory per GPU (every
// component), where the real EP groups of a fold fall, the all-to-all time of a mapping, the
// pipeline bubble fraction of 1F1B and of the interleaved schedule.
#include <moefold/plan/plan.hpp>

#include <doctest/doctest.h>

#include "small_model.hpp"

using namespace moefold;
using namespace moefold::plan;

namespace {

using testing::small_model;

cluster_config eight_gpus() { return testing::h100_gpus(8); }

}  // namespace

TEST_CASE("memory per GPU of a small model, every component by hand") {
  const auto m = small_model();
  mapping map{.tp = 2, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = 1, .mbs = 1};
  auto fold = check_mapping(m, 8, map);
  REQUIRE(fold.has_value());
  CHECK(map.dp == 2);
  CHECK(map.edp == 1);
  const auto s = make_shapes(m, map);
  CHECK(s.micro == 4);
  CHECK(s.moe_tokens == 512);
  CHECK(s.expert_rows == 1024);
  // Parameters per rank. Attention 4*1024^2 + 1024 = 4,195,328 per layer, /tp. Router 8*1024
  // + norm 1024 = 9,216, /tp. Experts 8*3*1024*2048 = 50,331,648 per layer, /(ep*etp) = /4.
  // Embedding (first) and output layer + final norm (last): 32000*1024/2 = 16,384,000 (+1,024).
  const auto first = params_on_stage(m, map, 2, 2, true, false);
  CHECK(first.dense == 20'588'544.0);
  CHECK(first.expert == 25'165'824.0);
  const auto last = params_on_stage(m, map, 2, 2, false, true);
  CHECK(last.dense == 20'589'568.0);
  // Activations per layer and micro-batch: attention 2*512*2048 + 2*1024*4096/2 + 4*1024*4 =
  // 6,307,840; MoE 2*512*2048 + 8*512*8 + 2*1024*1024 + 2*1024*3*2048 + 2*1024*1024 =
  // 18,907,136.
  const auto a = activations_per_layer(m, map, s);
  CHECK(a.attention == 6'307'840.0);
  CHECK(a.moe == 18'907'136.0);
  // The last stage is the larger one: its fp32 logits (2 x 4 B x 1024 x 32000 / 2) outweigh
  // the second micro-batch the first stage keeps.
  const auto b = memory_for(m, map, s, recompute::none);
  CHECK(b.weights == 91'510'784.0);      // 2 B x 45,755,392
  CHECK(b.grads == 183'021'568.0);       // 4 B
  CHECK(b.optimizer == 425'527'296.0);   // 12 B x (20,589,568 / (dp*cp = 2) + 25,165,824 / 1)
  CHECK(b.activations == 50'429'952.0);  // 2 layers x 1 micro-batch x 25,214,976
  CHECK(b.transient == 131'072'000.0);   // logits
  CHECK(b.reserved == 3.0 * gib);
  CHECK(b.total() == 4'102'787'072.0);
  // Full recomputation keeps only each layer's input, 2 B x 512 x 1024.
  CHECK(memory_for(m, map, s, recompute::full).activations == 2.0 * 1'048'576.0);
  CHECK(memory_for(m, map, s, recompute::moe).activations == 2.0 * (6'307'840.0 + 1'048'576.0));
  // The first stage: two micro-batches in flight, no logits.
  map.pp = 2;
  const double first_total =
      91'508'736.0 + 183'017'472.0 + 425'521'152.0 + 100'859'904.0 + 4'194'304.0 + 3.0 * gib;
  CHECK(first_total < b.total());
  // Infeasible on a GPU that is too small, with the reason.
  auto tiny = eight_gpus();
  tiny.memory_gib = 3.5;
  auto r = evaluate(m, tiny, map);
  REQUIRE(r.has_value());
  CHECK_FALSE(r->feasible);
  CHECK(r->reason.find("out of memory") == 0);
  CHECK(r->reason.find("the GPU has 3.5 GiB") != std::string::npos);
  // 3.821 GiB without recomputation, 3.788 with the MoE layers recomputed, 3.776 with all.
  tiny.memory_gib = 3.79;
  r = evaluate(m, tiny, map);
  REQUIRE(r.has_value());
  CHECK(r->feasible);
  CHECK(r->rc == recompute::moe);
  CHECK(r->time.recompute > 0.0);
  tiny.memory_gib = 3.78;
  r = evaluate(m, tiny, map);
  REQUIRE(r.has_value());
  CHECK(r->feasible);
  CHECK(r->rc == recompute::full);
  tiny.memory_gib = 3.83;
  r = evaluate(m, tiny, map);
  REQUIRE(r.has_value());
  CHECK(r->rc == recompute::none);
  CHECK(r->time.recompute == 0.0);
}

TEST_CASE("where the real EP groups of a fold fall") {
  auto place = [](int world, int tp, int ep, int etp, int gpn) {
    auto f = make_folded({.world = world, .tp = tp, .ep = ep, .etp = etp}).value();
    return place_groups(f, gpn);
  };
  // EP 8 with ETP 1 on 16 GPUs: two groups of 8 consecutive ranks, each inside a node.
  auto p = place(16, 2, 8, 1, 8);
  CHECK(p.ep.size == 8);
  CHECK_FALSE(p.ep.crosses_nodes());
  CHECK(p.ep.off_node_fraction() == 0.0);
  // EP 8 with ETP 2: EP groups are strided by etp, [0,2,..,14], so they span both nodes, half
  // of each member's 7 peers are elsewhere (4 of 7).
  p = place(16, 2, 8, 2, 8);
  CHECK(p.ep.nodes == 2);
  CHECK(p.ep.off_node_fraction() == doctest::Approx(4.0 / 7.0));
  CHECK_FALSE(p.etp.crosses_nodes());
  // EP 16 on two nodes of 8: 8 of 15 peers are on the other node.
  p = place(16, 1, 16, 1, 8);
  CHECK(p.ep.off_node_fraction() == doctest::Approx(8.0 / 15.0));
  CHECK(p.dp_cp.crosses_nodes());
}

TEST_CASE("all-to-all time of a group, by hand") {
  const auto c = eight_gpus();
  const efficiency e{};
  group_placement g{.size = 16, .nodes = 2, .min_local = 8};
  // 1 GB per rank: 15/16 leaves; 8/15 of that to the other node at 50 GB/s x 0.85, the rest
  // over NVLink at 450 GB/s x 0.72, at the same time; plus two inter-node latencies.
  const double expect = 0.5e9 / (50e9 * 0.85) + 2 * 8e-6;
  CHECK(a2a_time(1e9, g, c, e) == doctest::Approx(expect).epsilon(1e-12));
  g = {.size = 8, .nodes = 1, .min_local = 8};
  CHECK(a2a_time(1e9, g, c, e) == doctest::Approx(0.875e9 / (450e9 * 0.72) + 2 * 3e-6));
  g = {.size = 1, .nodes = 1, .min_local = 1};
  CHECK(a2a_time(1e9, g, c, e) == 0.0);
}

TEST_CASE("EP all-to-all time of a mapping, by hand") {
  const auto m = small_model();
  const auto c = eight_gpus();
  auto r = evaluate(m, c, {.tp = 2, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = 1, .mbs = 1});
  REQUIRE(r.has_value());
  // Each rank routes T_m = 512 tokens to 2 experts: 512*2*1024*2 B = 2,097,152 B, 3/4 of which
  // leave for the 3 peers of its EP group (inside the node). Dispatch + combine, forward and
  // backward: 4 all-to-alls per MoE layer, 2 MoE layers per stage, 4 micro-batches.
  const double one = 2'097'152.0 * 3 / 4 / (450e9 * 0.72) + 2 * 3e-6;
  CHECK(r->time.ep_a2a == doctest::Approx(32 * one).epsilon(1e-12));
  CHECK(r->time.etp_comm == 0.0);
  CHECK(r->time.cp_comm == 0.0);
}

TEST_CASE("pipeline bubble fraction of 1F1B and of the interleaved schedule") {
  const auto m = small_model();
  const auto c = eight_gpus();
  const auto gpu_only = testing::gpu_side();  // the small model is host-bound otherwise
  for (int vpp : {1, 2}) {
    auto r = evaluate(m, c, {.tp = 2, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = vpp, .mbs = 1},
                      gpu_only);
    REQUIRE(r.has_value());
    const double busy = r->time.gemm + r->time.attention + r->time.elementwise + r->time.tp_comm +
                        r->time.cp_comm + r->time.ep_a2a + r->time.etp_comm + r->time.sync_idle +
                        r->time.recompute;
    // (pp-1)/vpp idle stage-micro-batch slots against m = 4 busy ones.
    const double want = (1.0 / vpp) / (4.0 + 1.0 / vpp);
    CHECK(r->time.bubble / (r->time.bubble + busy) == doctest::Approx(want).epsilon(1e-12));
  }
  auto flat = evaluate(m, c, {.tp = 2, .cp = 1, .ep = 4, .etp = 1, .pp = 1, .vpp = 1, .mbs = 1});
  REQUIRE(flat.has_value());
  CHECK(flat->time.bubble == 0.0);
  CHECK(flat->time.pp_p2p == 0.0);
}

TEST_CASE("MFU is Megatron's model FLOPs over time, GPUs and peak") {
  const auto m = model_preset("mixtral-8x22b").value();
  auto c = cluster_preset("h100-sxm").value();
  c.gpus = 128;
  auto r = evaluate(m, c, {.tp = 2, .cp = 1, .ep = 8, .etp = 1, .pp = 8, .vpp = 7, .mbs = 1});
  REQUIRE(r.has_value());
  CHECK(r->feasible);
  CHECK(r->mfu == doctest::Approx(megatron_model_flops(m, 256) / (r->step_time_s * 128 * 989e12)));
  CHECK(r->step_time_s == doctest::Approx(r->time.total()));
  CHECK(r->tflops_per_gpu == doctest::Approx(r->mfu * 989.0));
}

TEST_CASE("illegal mappings are errors naming the rule") {
  const auto m = model_preset("mixtral-8x22b").value();
  auto c = cluster_preset("h100-sxm").value();
  c.gpus = 128;
  struct bad_case {
    mapping map;
    const char* says;
  };
  const bad_case cases[] = {
      {{.tp = 3}, "not divisible"},
      {{.tp = 16, .etp = 16}, "tp must divide the attention heads"},
      {{.tp = 2, .ep = 16, .etp = 1}, "ep must divide the experts"},
      {{.tp = 1, .pp = 1, .vpp = 2}, "needs pp > 1"},
      {{.tp = 2, .ep = 8, .etp = 1, .pp = 8, .vpp = 8}, "pp*vpp exceeds the layers"},
      {{.tp = 1, .ep = 8, .etp = 1, .mbs = 4}, "must divide the global batch"},
      {{.tp = 1, .ep = 8, .etp = 1, .pp = 128}, "not divisible"},
      {{.tp = 1, .cp = 2048}, "not divisible"},
      {{.tp = 1, .mbs = 0}, "must be >= 1"},
  };
  for (const auto& x : cases) {
    INFO(to_string(x.map));
    auto r = evaluate(m, c, x.map);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().message.find(x.says) != std::string::npos);
  }
}
