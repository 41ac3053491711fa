// The step model's EP dispatch and the training stack's choices, against hand-computed values:
// where a token's expert copies land (distinct nodes and ranks, group-limited routing), the
// all-to-all and DeepEP-class exchange times, fp8 dispatch, fp8 casts, and the EP overlap with
// the schedule's warm-up; and the effects that must be monotonic (more nodes never make an EP
// exchange cheaper, more micro-batches never make the bubble bigger, overlap and fp8 dispatch
// never make a step slower).
#include <moefold/plan/plan.hpp>

#include <doctest/doctest.h>

#include "small_model.hpp"

using namespace moefold;
using namespace moefold::plan;

namespace {

using testing::small_model;

cluster_config eight_gpus() { return testing::h100_gpus(8); }

model_config deepseek_like(bool group_limited) {
  auto m = model_preset("deepseek-v3").value();
  if (!group_limited) m.router_groups = m.router_group_topk = 0;
  return m;
}

// The GPU's side of the step (the host floor has its own test case below).
efficiency with(ep_dispatcher d, bool overlap = false, bool fp8 = false) {
  auto e = testing::gpu_side();
  e.stack = {.dispatcher = d, .fp8_dispatch = fp8, .ep_overlap = overlap};
  return e;
}

}  // namespace

TEST_CASE("distinct parts a token reaches, by hand") {
  // 2 of 8 items, 4 parts of 2: a given part is missed with probability 6/8 * 5/7.
  CHECK(expected_parts_hit(8, 4, 2) == doctest::Approx(4 * (1 - 30.0 / 56)).epsilon(1e-14));
  CHECK(expected_parts_hit(8, 1, 2) == 1.0);
  CHECK(expected_parts_hit(8, 8, 8) == doctest::Approx(8.0));  // every item, every part
  CHECK(expected_parts_hit(8, 4, 0) == 0.0);
  // 4 of 8 groups on 8 nodes (one group each): exactly 4 nodes.
  CHECK(expected_parts_hit(8, 8, 4) == doctest::Approx(4.0).epsilon(1e-14));
}

TEST_CASE("where a token's copies land: uniform and group-limited routing") {
  // DeepSeek-V3: 256 experts, top-8, 8 groups of 32, a token uses 4 groups.
  const auto free = deepseek_like(false);
  const auto limited = deepseek_like(true);
  // EP 64 over 8 nodes: uniform routing reaches 8 * (1 - C(224,8)/C(256,8)) nodes.
  double miss = 1;
  for (int i = 0; i < 8; ++i) miss *= (224.0 - i) / (256.0 - i);
  auto t = spread_of_token(free, 64, 8);
  CHECK(t.nodes == doctest::Approx(8 * (1 - miss)).epsilon(1e-12));
  // Group-limited: one group per node, so exactly the 4 chosen groups' nodes.
  t = spread_of_token(limited, 64, 8);
  CHECK(t.nodes == doctest::Approx(4.0).epsilon(1e-12));
  // Ranks: the 8 picks fall among the 4 groups' 128 experts, 4 per rank, 32 ranks.
  CHECK(t.ranks == doctest::Approx(expected_parts_hit(128, 32, 8)).epsilon(1e-12));
  // EP 128 over 16 nodes: a group spans 2 nodes; the picks fall among 4 * 32 experts on 8 nodes.
  t = spread_of_token(limited, 128, 16);
  CHECK(t.nodes == doctest::Approx(expected_parts_hit(128, 8, 8)).epsilon(1e-12));
  // Never more nodes or ranks than uniform routing reaches.
  for (int nodes : {1, 2, 4, 8}) {
    CHECK(spread_of_token(limited, 64, nodes).nodes <=
          spread_of_token(free, 64, nodes).nodes + 1e-12);
    CHECK(spread_of_token(limited, 64, nodes).ranks <=
          spread_of_token(free, 64, nodes).ranks + 1e-12);
  }
}

TEST_CASE("EP exchange time of each dispatcher, by hand") {
  auto m = small_model();
  m.experts = 16;
  const auto c = eight_gpus();
  const group_placement g{.size = 16, .nodes = 2, .min_local = 8};
  // all-to-all: every (token, expert) pair is a row of the NCCL all-to-all.
  CHECK(ep_exchange_time(512, 2048, m, g, c, with(ep_dispatcher::alltoall)) ==
        a2a_time(512.0 * 2 * 2048, g, c, efficiency{}));
  // DeepEP: a token reaches 2 * (1 - 8/16 * 7/15) nodes, half of them remote, over RDMA at
  // 50 GB/s x 0.88; and 16 * (1 - 15/16 * 14/15) = 2 ranks, 7/8 of whose copies go over NVLink
  // at 450 GB/s x 0.95. The slower link sets the time, plus two inter-node latencies.
  const double nodes = 2 * (1 - 56.0 / 240), ranks = 2.0;
  const double inter = 512.0 * 2048 * nodes / 2 / (50e9 * 0.88);
  const double intra = 512.0 * 2048 * ranks * 7 / 8 / (450e9 * 0.95);
  const double deepep = std::max(inter, intra) + 2 * 8e-6;
  CHECK(ep_exchange_time(512, 2048, m, g, c, with(ep_dispatcher::deepep)) ==
        doctest::Approx(deepep).epsilon(1e-12));
  CHECK(ep_exchange_time(512, 2048, m, g, c, with(ep_dispatcher::hybridep)) ==
        doctest::Approx(deepep).epsilon(1e-12));
  // Inside one node: NVLink only, to 2 ranks, 15/16 of them peers.
  const group_placement in_node{.size = 16, .nodes = 1, .min_local = 16};
  CHECK(ep_exchange_time(512, 2048, m, in_node, c, with(ep_dispatcher::deepep)) ==
        doctest::Approx(512.0 * 2048 * 2 * 15 / 16 / (450e9 * 0.95) + 2 * 3e-6).epsilon(1e-12));
  CHECK(ep_exchange_time(512, 2048, m, {.size = 1, .nodes = 1, .min_local = 1}, c,
                         with(ep_dispatcher::deepep)) == 0.0);
}

TEST_CASE("more nodes never make an EP exchange cheaper") {
  const auto c = testing::h100_gpus(512);
  for (bool limited : {false, true}) {
    const auto m = deepseek_like(limited);
    for (auto d : {ep_dispatcher::alltoall, ep_dispatcher::deepep, ep_dispatcher::hybridep}) {
      double last = 0;
      for (int nodes : {1, 2, 4, 8}) {
        const group_placement g{.size = 64, .nodes = nodes, .min_local = 64 / nodes};
        const double t = ep_exchange_time(4096, 2.0 * m.hidden, m, g, c, with(d));
        CAPTURE(nodes);
        CAPTURE(limited);
        CHECK(t >= last);
        last = t;
      }
    }
  }
}

TEST_CASE("fp8 dispatch shrinks only the forward dispatch") {
  const auto m = small_model();
  const auto c = eight_gpus();
  const mapping map{.tp = 1, .cp = 1, .ep = 8, .etp = 1, .pp = 1, .vpp = 1, .mbs = 1};
  auto bf16 = evaluate(m, c, map, with(ep_dispatcher::alltoall));
  auto fp8 = evaluate(m, c, map, with(ep_dispatcher::alltoall, false, true));
  REQUIRE(bf16.has_value());
  REQUIRE(fp8.has_value());
  // 1 micro-batch, 4 MoE layers, 4 exchanges each; one of the four carries H*(1 + 4/128) bytes
  // per row instead of 2H. Each exchange: T_m = 1024 tokens to 2 experts, 7/8 of it to peers.
  const efficiency e{};
  const auto x = [&](double row) {
    return 1024.0 * 2 * row * 7 / 8 / (450e9 * e.a2a_intra) + 2 * 3e-6;
  };
  CHECK(bf16->time.ep_a2a == doctest::Approx(4 * 4 * x(2048)).epsilon(1e-12));
  CHECK(fp8->time.ep_a2a ==
        doctest::Approx(4 * (3 * x(2048) + x(1024 * (1 + 4.0 / 128)))).epsilon(1e-12));
}

TEST_CASE("fp8 GEMM operands are cast: the elementwise time it adds, by hand") {
  auto m = small_model();
  const auto c = eight_gpus();
  const mapping map{.tp = 1, .cp = 1, .ep = 8, .etp = 1, .pp = 1, .vpp = 1, .mbs = 1};
  auto bf16 = evaluate(m, c, map);
  m.dtype = precision::fp8;
  auto fp8 = evaluate(m, c, map);
  REQUIRE(bf16.has_value());
  REQUIRE(fp8.has_value());
  REQUIRE(bf16->rc == fp8->rc);
  // T_a = 1024 tokens, H = q = kv = 1024, 2048 expert rows of F = 2048. Per layer: attention
  // inputs 1024*(1024 + 1024), output gradients 1024*(3072 + 1024); experts inputs
  // 2048*(1024 + 2048), output gradients 2048*(4096 + 1024). 4 layers, 1 micro-batch, 6 bytes
  // each at 80% of 3.35 TB/s.
  const double per_layer = 1024.0 * 2048 + 1024.0 * 4096 + 2048.0 * 3072 + 2048.0 * 5120;
  CHECK(per_layer == 23'068'672.0);
  CHECK(fp8->time.elementwise - bf16->time.elementwise ==
        doctest::Approx(4 * per_layer * 6 / (3.35e12 * 0.8)).epsilon(1e-9));
}

TEST_CASE("EP overlap: hidden behind the other micro-batch, except in warm-up and cool-down") {
  const auto m = small_model();
  const auto c = eight_gpus();
  auto plain = with(ep_dispatcher::alltoall);
  auto overlap = with(ep_dispatcher::alltoall, true);
  // pp 1: one micro-batch warms up alone; with gbs 32 over dp 8, 4 micro-batches, 3 overlap.
  auto m32 = m;
  m32.gbs = 32;
  const mapping flat{.tp = 1, .cp = 1, .ep = 8, .etp = 1, .pp = 1, .vpp = 1, .mbs = 1};
  auto r0 = evaluate(m32, c, flat, plain);
  auto r1 = evaluate(m32, c, flat, overlap);
  REQUIRE(r0.has_value());
  REQUIRE(r1.has_value());
  REQUIRE(r0->rc == recompute::none);
  const double f = 16.0 / 132;  // NCCL's SMs of the 132
  // Per MoE layer, each transfer beside its partner sub-module of the other micro-batch.
  const auto exposed_layer = [&](const mapping& map) {
    mapping mm = map;
    auto fold = check_mapping(m32, 8, mm);
    REQUIRE(fold.has_value());
    const auto lc =
        plan::detail::layer_costs(m32, mm, make_shapes(m32, mm), c, place_groups(*fold, 8), plain);
    const auto w = [](const pass_cost& p) { return p.gemm + p.attention + p.elementwise; };
    const double comm[4] = {lc.ep_exchange, lc.ep_dispatch, lc.ep_exchange, lc.ep_exchange};
    const double work[4] = {w(lc.attn_fwd), w(lc.moe_bwd), w(lc.moe_fwd), w(lc.attn_bwd)};
    double x = 0;
    for (int i = 0; i < 4; ++i)
      x += std::max(0.0, comm[i] - work[i]) + f * std::min(comm[i], work[i]);
    return x;
  };
  // 4 MoE layers on the one stage, 4 micro-batches, the first alone.
  const double micro = 4, comm = r0->time.ep_a2a / micro;
  CHECK(r1->time.ep_a2a ==
        doctest::Approx(comm + (micro - 1) * 4 * exposed_layer(flat)).epsilon(1e-12));
  CHECK(r1->step_time_s < r0->step_time_s);
  // Interleaved pp 2, vpp 2 with 8 micro-batches (dp 4): warm-up 2*(2-1) + (2-1)*2 = 4 of 16
  // units.
  const mapping inter{.tp = 1, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = 2, .mbs = 1};
  r0 = evaluate(m32, c, inter, plain);
  r1 = evaluate(m32, c, inter, overlap);
  REQUIRE(r0.has_value());
  REQUIRE(r1.has_value());
  REQUIRE(r0->microbatches == 8);
  REQUIRE(r0->rc == recompute::none);
  // The slowest stage (2 MoE layers): a quarter of the units alone, the rest overlapped.
  const double comm2 = r0->time.ep_a2a / 8;
  CHECK(r1->time.ep_a2a ==
        doctest::Approx(8 * (0.25 * comm2 + 0.75 * 2 * exposed_layer(inter))).epsilon(1e-12));
  // Megatron-Core needs an interleaved schedule with pp > 1: with vpp 1 nothing changes.
  const mapping one_f_one_b{.tp = 1, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = 1, .mbs = 1};
  r0 = evaluate(m32, c, one_f_one_b, plain);
  r1 = evaluate(m32, c, one_f_one_b, overlap);
  REQUIRE(r0.has_value());
  REQUIRE(r1.has_value());
  CHECK(r1->time.ep_a2a == r0->time.ep_a2a);
}

TEST_CASE("the GPU idles at each MoE layer forward's host synchronisation, by hand") {
  const auto c = eight_gpus();
  auto m32 = small_model();
  m32.gbs = 32;
  const efficiency e{};
  // The measured idle: 1.893 s of a 24.714 s step over 64 micro-batches x 48 MoE layers.
  CHECK(e.dispatch_sync_s == doctest::Approx(1.893 / 3072).epsilon(1e-12));
  for (auto d : {ep_dispatcher::alltoall, ep_dispatcher::deepep, ep_dispatcher::hybridep}) {
    CAPTURE(to_string(d));
    // pp 1, dp 8: 4 micro-batches, 4 MoE layers, one forward each; the backward does not wait.
    const mapping flat{.tp = 1, .cp = 1, .ep = 8, .etp = 1, .pp = 1, .vpp = 1, .mbs = 1};
    auto r0 = evaluate(m32, c, flat, with(d));
    REQUIRE(r0.has_value());
    REQUIRE(r0->rc == recompute::none);
    CHECK(r0->time.sync_idle == doctest::Approx(4 * 4 * e.dispatch_sync_s).epsilon(1e-12));
    // It is on the critical path: the step is longer by it than the same model without it.
    auto no_sync = with(d);
    no_sync.dispatch_sync_s = 0;
    auto r_free = evaluate(m32, c, flat, no_sync);
    REQUIRE(r_free.has_value());
    CHECK(r_free->time.sync_idle == 0.0);
    CHECK(r0->step_time_s - r_free->step_time_s ==
          doctest::Approx(r0->time.sync_idle).epsilon(1e-9));
    // Under the EP overlap only the micro-batch that warms up alone leaves the GPU idle.
    auto r1 = evaluate(m32, c, flat, with(d, true));
    REQUIRE(r1.has_value());
    CHECK(r1->time.sync_idle == doctest::Approx(4 * e.dispatch_sync_s).epsilon(1e-12));
    CHECK(r1->time.sync_idle <= r0->time.sync_idle);
    // Interleaved pp 2, vpp 2, 8 micro-batches: the slowest stage's 2 MoE layers; with the
    // overlap, warm-up 4 of 16 units alone. The bubble carries the idle too.
    const mapping inter{.tp = 1, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = 2, .mbs = 1};
    r0 = evaluate(m32, c, inter, with(d));
    r1 = evaluate(m32, c, inter, with(d, true));
    REQUIRE(r0.has_value());
    REQUIRE(r1.has_value());
    REQUIRE(r0->microbatches == 8);
    CHECK(r0->time.sync_idle == doctest::Approx(8 * 2 * e.dispatch_sync_s).epsilon(1e-12));
    CHECK(r1->time.sync_idle == doctest::Approx(0.25 * 8 * 2 * e.dispatch_sync_s).epsilon(1e-12));
  }
  // A recomputed MoE forward dispatches, and so waits, again: counted under recompute.
  auto m = model_preset("qwen3-235b-a22b").value();
  const auto big = testing::h100_gpus(256);
  auto rc = evaluate(m, big, {.tp = 2, .cp = 1, .ep = 32, .etp = 1, .pp = 8, .vpp = 4, .mbs = 1});
  REQUIRE(rc.has_value());
  REQUIRE(rc->rc == recompute::moe);  // it does not fit otherwise
  auto no_sync = efficiency{};
  no_sync.dispatch_sync_s = 0;
  auto free = evaluate(m, big, {.tp = 2, .cp = 1, .ep = 32, .etp = 1, .pp = 8, .vpp = 4, .mbs = 1},
                       no_sync);
  REQUIRE(free.has_value());
  REQUIRE(free->rc == recompute::moe);
  // 12 MoE layers on the fullest stage, 64 micro-batches (dp 16, the preset's gbs 1024): one
  // more wait each.
  CHECK(rc->time.recompute - free->time.recompute ==
        doctest::Approx(64 * 12 * efficiency{}.dispatch_sync_s).epsilon(1e-9));
}

TEST_CASE("eager Megatron-Core is host-bound below a floor per MoE layer, by hand") {
  const auto c = eight_gpus();
  auto m32 = small_model();
  m32.gbs = 32;
  const efficiency e{};
  // The constant: the ModelZoo run's 29.0 s step, 256 micro-batches and 7/4 bubble slots of 12
  // MoE layers.
  CHECK(e.host_moe_layer_s == doctest::Approx(29.0 / (257.75 * 12)).epsilon(1e-12));
  // pp 1, dp 8: 4 micro-batches of 4 MoE layers, whose GPU work is far below 4 floors: each
  // micro-batch takes the host's 4 * host_moe_layer_s, the GPU waits for the rest.
  const mapping flat{.tp = 1, .cp = 1, .ep = 8, .etp = 1, .pp = 1, .vpp = 1, .mbs = 1};
  auto eager = evaluate(m32, c, flat, efficiency{});
  auto gpu = evaluate(m32, c, flat, with(ep_dispatcher::alltoall));
  REQUIRE(eager.has_value());
  REQUIRE(gpu.has_value());
  const auto& t = eager->time;
  REQUIRE(gpu->step_time_s < 0.5 * 16 * e.host_moe_layer_s);
  CHECK(t.host > 0);
  CHECK(eager->step_time_s - t.dp_comm - t.optimizer ==
        doctest::Approx(4 * 4 * e.host_moe_layer_s).epsilon(1e-12));
  CHECK(t.gemm + t.attention + t.elementwise + t.tp_comm + t.cp_comm + t.ep_a2a + t.etp_comm +
            t.sync_idle + t.recompute + t.host ==
        doctest::Approx(4 * 4 * e.host_moe_layer_s).epsilon(1e-12));
  // With CUDA graphs (and for the GPU alone) there is no floor: the GPU's own time.
  auto graphs = efficiency{};
  graphs.stack.cuda_graphs = true;
  auto graphed = evaluate(m32, c, flat, graphs);
  REQUIRE(graphed.has_value());
  CHECK(graphed->time.host == 0.0);
  CHECK(graphed->step_time_s == doctest::Approx(gpu->step_time_s).epsilon(1e-12));
  // Interleaved pp 2, vpp 2, 8 micro-batches: 2 MoE layers a stage; the bubble's 1/2 slot is a
  // host-bound micro-batch too.
  const mapping inter{.tp = 1, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = 2, .mbs = 1};
  auto r = evaluate(m32, c, inter, efficiency{});
  REQUIRE(r.has_value());
  REQUIRE(r->microbatches == 8);
  CHECK(r->time.bubble == doctest::Approx(0.5 * 2 * e.host_moe_layer_s).epsilon(1e-12));
  CHECK(r->step_time_s - r->time.bubble - r->time.pp_p2p - r->time.dp_comm - r->time.optimizer ==
        doctest::Approx(8 * 2 * e.host_moe_layer_s).epsilon(1e-12));
  // The run the constant comes from: its 29.0 s step (and 167 TFLOP/s) to within the DP,
  // pipeline and optimizer time the derivation leaves out.
  const auto big = testing::h100_gpus(256);
  auto q = model_preset("qwen3-235b-a22b").value();
  q.gbs = 2048;
  auto deepep = efficiency{};
  deepep.stack.dispatcher = ep_dispatcher::deepep;
  auto zoo =
      evaluate(q, big, {.tp = 4, .cp = 1, .ep = 8, .etp = 1, .pp = 8, .vpp = 4, .mbs = 1}, deepep);
  REQUIRE(zoo.has_value());
  REQUIRE(zoo->rc == recompute::none);
  CHECK(zoo->step_time_s == doctest::Approx(29.0).epsilon(0.01));
  CHECK(zoo->time.host > 0);
}

TEST_CASE("the host floor: CUDA graphs and the EP overlap never make a step slower") {
  const auto c = testing::h100_gpus(256);
  for (const char* name : {"qwen3-235b-a22b", "mixtral-8x22b", "deepseek-v3"}) {
    auto m = model_preset(name).value();
    for (int gbs : {256, 2048}) {
      m.gbs = gbs;
      for (const mapping& map :
           {mapping{.tp = 4, .cp = 1, .ep = 8, .etp = 1, .pp = 8, .vpp = 4, .mbs = 1},
            mapping{.tp = 2, .cp = 1, .ep = 32, .etp = 1, .pp = 4, .vpp = 2, .mbs = 1}}) {
        mapping legal = map;
        if (!check_mapping(m, c.gpus, legal)) continue;
        for (auto d : {ep_dispatcher::alltoall, ep_dispatcher::deepep}) {
          efficiency eager, overlap, graphs;
          eager.stack.dispatcher = overlap.stack.dispatcher = graphs.stack.dispatcher = d;
          overlap.stack.ep_overlap = true;
          graphs.stack.cuda_graphs = true;
          auto a = evaluate(m, c, map, eager);
          auto b = evaluate(m, c, map, overlap);
          auto g = evaluate(m, c, map, graphs);
          REQUIRE(a.has_value());
          REQUIRE(b.has_value());
          REQUIRE(g.has_value());
          CAPTURE(name);
          CAPTURE(gbs);
          CAPTURE(to_string(map));
          CHECK(b->step_time_s <= a->step_time_s);
          CHECK(g->step_time_s <= a->step_time_s);
          CHECK(g->time.host == 0.0);
          // The floor binds at least the steady state (of the stage with the fewest MoE layers).
          const auto sh = make_shapes(m, legal);
          const int fewest = std::min(sh.stage_moe_layers, sh.last_stage_moe);
          CHECK(a->step_time_s >=
                static_cast<double>(a->microbatches) * fewest * eager.host_moe_layer_s);
        }
      }
    }
  }
}

TEST_CASE(
    "overlap and fp8 dispatch never make a step slower; more micro-batches never a bigger "
    "bubble") {
  const auto c = testing::h100_gpus(256);
  const auto m = model_preset("qwen3-235b-a22b").value();
  for (auto d : {ep_dispatcher::alltoall, ep_dispatcher::deepep}) {
    for (int ep : {8, 32}) {
      const mapping map{.tp = 2, .cp = 1, .ep = ep, .etp = 1, .pp = 8, .vpp = 4, .mbs = 1};
      auto plain = evaluate(m, c, map, with(d));
      auto fp8 = evaluate(m, c, map, with(d, false, true));
      auto both = evaluate(m, c, map, with(d, true, true));
      REQUIRE(plain.has_value());
      REQUIRE(fp8.has_value());
      REQUIRE(both.has_value());
      CAPTURE(ep);
      CHECK(fp8->step_time_s <= plain->step_time_s);
      CHECK(both->step_time_s <= fp8->step_time_s);
    }
  }
  // The bubble is (pp-1)/vpp stage micro-batch times whatever the count; more micro-batches
  // only shrink its share.
  double last_bubble = 1e300, last_share = 1;
  for (int gbs : {256, 512, 1024, 2048}) {
    auto mm = m;
    mm.gbs = gbs;
    auto r = evaluate(mm, c, {.tp = 2, .cp = 1, .ep = 8, .etp = 1, .pp = 8, .vpp = 4, .mbs = 1});
    REQUIRE(r.has_value());
    CAPTURE(gbs);
    CHECK(r->time.bubble <= last_bubble * (1 + 1e-12));
    CHECK(r->time.bubble / r->step_time_s < last_share);
    last_bubble = r->time.bubble;
    last_share = r->time.bubble / r->step_time_s;
  }
}
