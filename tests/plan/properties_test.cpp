// Properties the step model must have whatever its calibration, checked over many legal
// mappings of several models and clusters: more bandwidth is never slower, the time components
// are never negative and add up to the step, more memory never makes a feasible mapping
// infeasible, and moving EP from inside a node to across nodes never makes a step faster.
#include <moefold/plan/plan.hpp>

#include <doctest/doctest.h>

#include <random>
#include <vector>

using namespace moefold;
using namespace moefold::plan;

namespace {

struct sample {
  model_config model;
  cluster_config cluster;
  mapping map;
};

// Random legal mappings (the search's own enumeration would be circular; these come from
// random sizes filtered by check_mapping).
std::vector<sample> samples(int want) {
  std::mt19937 rng(6);
  const char* models[] = {"mixtral-8x7b", "mixtral-8x22b-g8t8", "qwen2-57b-a14b", "qwen3-235b-a22b",
                          "deepseek-v3"};
  const char* clusters[] = {"h100-sxm", "h200-sxm", "gb200-nvl72"};
  const int worlds[] = {16, 32, 64, 128, 256};
  const int sizes[] = {1, 2, 4, 8, 16};
  std::vector<sample> out;
  for (int iter = 0; iter < 200000 && static_cast<int>(out.size()) < want; ++iter) {
    sample s;
    s.model = model_preset(models[rng() % 5]).value();
    s.model.gbs = 512;
    s.cluster = cluster_preset(clusters[rng() % 3]).value();
    s.cluster.gpus = worlds[rng() % 5];
    s.map = {.tp = sizes[rng() % 4],
             .cp = sizes[rng() % 3],
             .ep = sizes[rng() % 5],
             .etp = sizes[rng() % 3],
             .pp = sizes[rng() % 5],
             .vpp = 1 + static_cast<int>(rng() % 2),
             .mbs = sizes[rng() % 3]};
    if (check_mapping(s.model, s.cluster.gpus, s.map).has_value()) out.push_back(s);
  }
  return out;
}

}  // namespace

TEST_CASE("more bandwidth is never slower") {
  const auto all = samples(300);
  REQUIRE(all.size() == 300);
  int faster = 0;
  for (const auto& s : all) {
    const auto base = evaluate(s.model, s.cluster, s.map).value();
    for (int which = 0; which < 4; ++which) {
      auto c = s.cluster;
      if (which == 0) c.intra_bw *= 2;
      if (which == 1) c.inter_bw *= 2;
      if (which == 2) c.memory_bw *= 2;
      if (which == 3) {
        c.intra_bw *= 1.5;
        c.inter_bw *= 3;
        c.memory_bw *= 1.1;
      }
      const auto more = evaluate(s.model, c, s.map).value();
      INFO(s.model.name, " ", to_string(s.map), " on ", s.cluster.gpus, " ", s.cluster.name);
      CHECK(more.step_time_s <= base.step_time_s);
      CHECK(more.feasible == base.feasible);
      faster += more.step_time_s < base.step_time_s ? 1 : 0;
    }
  }
  CHECK(faster > 600);  // bandwidth matters for most of them: the check is not vacuous
}

TEST_CASE("the time components are never negative and add up to the step") {
  for (const auto& s : samples(300)) {
    for (int stack = 0; stack < 3; ++stack) {
      efficiency e;
      e.stack.ep_overlap = stack == 1;
      e.stack.cuda_graphs = stack == 2;
      const auto r = evaluate(s.model, s.cluster, s.map, e).value();
      INFO(s.model.name, " ", to_string(s.map), " on ", s.cluster.gpus, " ", s.cluster.name,
           " stack ", stack);
      for (const auto& [name, v] : time_components(r.time)) {
        CAPTURE(name);
        CHECK(v >= 0.0);
      }
      CHECK(r.time.total() == doctest::Approx(r.step_time_s).epsilon(1e-12));
      if (e.stack.cuda_graphs) CHECK(r.time.host == 0.0);
    }
  }
}

TEST_CASE("more memory never makes a feasible mapping infeasible") {
  const auto all = samples(300);
  int feasible = 0, infeasible = 0, flipped = 0;
  for (const auto& s : all) {
    const auto base = evaluate(s.model, s.cluster, s.map).value();
    (base.feasible ? feasible : infeasible)++;
    for (double more : {1.01, 1.5, 4.0}) {
      auto c = s.cluster;
      c.memory_gib *= more;
      const auto r = evaluate(s.model, c, s.map).value();
      INFO(s.model.name, " ", to_string(s.map));
      if (base.feasible) {
        CHECK(r.feasible);
        CHECK(r.step_time_s <= base.step_time_s);  // less recomputation, never more
      }
      flipped += !base.feasible && r.feasible ? 1 : 0;
    }
  }
  CHECK(feasible > 50);
  CHECK(infeasible > 20);
  CHECK(flipped > 0);
}

TEST_CASE("moving EP from inside a node to across nodes never makes it faster") {
  // The same mapping with fewer GPUs per node: groups can only spread over more nodes.
  const auto all = samples(200);
  int ep_moved = 0;
  for (const auto& s : all) {
    auto c = s.cluster;
    c.gpus_per_node = 8;
    auto prev = evaluate(s.model, c, s.map).value();
    for (int gpn : {4, 2, 1}) {
      c.gpus_per_node = gpn;
      const auto r = evaluate(s.model, c, s.map).value();
      INFO(s.model.name, " ", to_string(s.map), " gpus per node ", gpn);
      CHECK(r.step_time_s >= prev.step_time_s);
      CHECK(r.time.ep_a2a >= prev.time.ep_a2a);
      ep_moved += r.placement.ep.nodes > prev.placement.ep.nodes ? 1 : 0;
      prev = r;
    }
  }
  CHECK(ep_moved > 50);
  // And directly: one mapping, its EP groups placed inside a node or across two.
  const auto m = model_preset("mixtral-8x22b").value();
  auto c = cluster_preset("h100-sxm").value();
  c.gpus = 128;
  mapping map{.tp = 2, .cp = 1, .ep = 8, .etp = 1, .pp = 8, .vpp = 7, .mbs = 1};
  auto fold = check_mapping(m, c.gpus, map).value();
  auto inside = place_groups(fold, c.gpus_per_node);
  REQUIRE_FALSE(inside.ep.crosses_nodes());
  auto across = inside;
  across.ep = {.size = 8, .nodes = 2, .min_local = 4};
  const auto a = evaluate_placed(m, c, map, inside);
  const auto b = evaluate_placed(m, c, map, across);
  CHECK(b.time.ep_a2a > a.time.ep_a2a);
  CHECK(b.step_time_s > a.step_time_s);
}
