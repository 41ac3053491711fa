// Measured rates in the step model (include/moefold/plan/calibration.hpp): a GEMM table equal to
// the built-in curve at its shapes changes nothing; at a measured shape the GEMM runs at the
// measured rate and elsewhere the correction of the nearest shape scales the curve; attention
// and collective tables interpolate in log(size) and hold beyond their ends; an H200 copy
// bandwidth applies to an H100 as the same fraction of HBM; faster measurements never make a
// step slower; bad tables are refused naming the rule.
#include <moefold/plan/plan.hpp>

#include <doctest/doctest.h>

#include "small_model.hpp"

#include <cmath>
#include <vector>

using namespace moefold;
using namespace moefold::plan;

namespace {

using testing::small_model;

cluster_config gpus(int n) { return testing::h100_gpus(n); }

const mapping folded{.tp = 2, .cp = 1, .ep = 4, .etp = 1, .pp = 2, .vpp = 1, .mbs = 1};

}  // namespace

TEST_CASE("calibration: a GEMM table equal to the built-in curve changes nothing") {
  const efficiency base;
  const double peak = 989e12;
  calibration cal;
  cal.measured_peak_flops = peak;
  for (double m : {256.0, 4096.0, 65536.0})
    for (double n : {512.0, 8192.0})
      for (double k : {1024.0, 7168.0})
        cal.gemm.push_back(
            {m, n, k, 2 * m * n * k / plan::detail::gemm_builtin_s(m, n, k, peak, base)});
  cal.expert_gemm = cal.gemm;
  REQUIRE(normalize(cal).has_value());
  efficiency e;
  e.measured = &cal;
  const plan::detail::gemm_table t{&cal.gemm, peak};
  for (double m : {100.0, 3000.0, 20000.0, 1e6})
    for (double n : {300.0, 5000.0})
      for (double k : {700.0, 16384.0})
        CHECK(plan::detail::gemm_s(m, n, k, peak, e, t) ==
              doctest::Approx(plan::detail::gemm_s(m, n, k, peak, base)).epsilon(1e-12));
  const auto c = gpus(8);
  const auto a = evaluate(small_model(), c, folded).value();
  const auto b = evaluate(small_model(), c, folded, e).value();
  CHECK(b.step_time_s == doctest::Approx(a.step_time_s).epsilon(1e-12));
}

TEST_CASE("calibration: measured GEMM rates are used at their shapes, scaled elsewhere") {
  const efficiency base;
  const double peak = 989e12;
  calibration cal;
  cal.measured_peak_flops = peak;
  // Half the built-in rate at (4096, 4096, 4096), and nothing else.
  const double t0 = plan::detail::gemm_builtin_s(4096, 4096, 4096, peak, base);
  const double flops = 2.0 * 4096 * 4096 * 4096;
  cal.gemm.push_back({4096, 4096, 4096, 0.5 * flops / t0});
  efficiency e;
  e.measured = &cal;
  const plan::detail::gemm_table t{&cal.gemm, peak};
  // At the measured shape: the measured rate exactly.
  CHECK(plan::detail::gemm_s(4096, 4096, 4096, peak, e, t) ==
        doctest::Approx(2 * t0).epsilon(1e-12));
  // Elsewhere: the built-in fraction times the correction (1/2), so every GEMM takes twice as
  // long as the built-in curve says.
  for (double m : {64.0, 1000.0, 1e5})
    CHECK(plan::detail::gemm_s(m, 2048, 8192, peak, e, t) ==
          doctest::Approx(2 * plan::detail::gemm_s(m, 2048, 8192, peak, base)).epsilon(1e-12));
  // A measurement on a GPU of another peak is taken as a fraction of that peak: the same
  // fraction on this one (without a call cost, which weighs differently at another peak).
  efficiency no_call;
  no_call.gemm_call_s = 0;
  calibration other = cal;
  other.measured_peak_flops = 2 * peak;
  other.gemm[0].flops *= 2;
  const plan::detail::gemm_table t1{&cal.gemm, peak}, t2{&other.gemm, 2 * peak};
  CHECK(plan::detail::gemm_s(1000, 2048, 8192, peak, no_call, t2) ==
        doctest::Approx(plan::detail::gemm_s(1000, 2048, 8192, peak, no_call, t1)).epsilon(1e-12));
  // The nearest shape decides: two measurements, one slow at small M, one at the built-in
  // rate at large M.
  calibration two;
  two.measured_peak_flops = peak;
  const double ts = plan::detail::gemm_builtin_s(128, 4096, 4096, peak, base);
  two.gemm.push_back({128, 4096, 4096, 0.25 * 2.0 * 128 * 4096 * 4096 / ts});
  two.gemm.push_back(
      {65536, 4096, 4096,
       2.0 * 65536 * 4096 * 4096 / plan::detail::gemm_builtin_s(65536, 4096, 4096, peak, base)});
  const plan::detail::gemm_table tt{&two.gemm, peak};
  CHECK(plan::detail::gemm_s(100, 4096, 4096, peak, e, tt) ==
        doctest::Approx(4 * plan::detail::gemm_s(100, 4096, 4096, peak, base)).epsilon(1e-12));
  CHECK(plan::detail::gemm_s(50000, 4096, 4096, peak, e, tt) ==
        doctest::Approx(plan::detail::gemm_s(50000, 4096, 4096, peak, base)).epsilon(1e-12));
}

TEST_CASE("calibration: attention and collective tables interpolate in log(size)") {
  const std::vector<sized_rate> t = {{1024, 100}, {4096, 300}, {16384, 400}};
  CHECK(plan::detail::interpolate_log(t, 512) == 100);    // held below the range
  CHECK(plan::detail::interpolate_log(t, 65536) == 400);  // and above it
  CHECK(plan::detail::interpolate_log(t, 4096) == 300);   // at a point
  CHECK(plan::detail::interpolate_log(t, 2048) ==
        doctest::Approx(200).epsilon(1e-12));  // log-midpoint
  CHECK(plan::detail::interpolate_log(t, 8192) == doctest::Approx(350).epsilon(1e-12));

  const auto c = gpus(16);
  calibration cal;
  cal.collectives.ring_intra = {{1e6, 100e9}, {1e8, 300e9}};
  cal.collectives.a2a_inter = {{1e6, 10e9}, {1e8, 40e9}};
  efficiency e;
  e.measured = &cal;
  const group_placement in_node{.size = 8, .nodes = 1, .min_local = 8};
  const group_placement two_nodes{.size = 16, .nodes = 2, .min_local = 8};
  // Ring inside a node: (n-1)/n bytes at the measured bus bandwidth, no latency added.
  CHECK(ring_time(1e7, in_node, c, e) == doctest::Approx(7.0 / 8 * 1e7 / 200e9).epsilon(1e-12));
  // Across nodes there is no inter-node ring table: the built-in rate and latency stay.
  CHECK(ring_time(1e7, two_nodes, c, e) == ring_time(1e7, two_nodes, c, efficiency{}));
  // All-to-all over two nodes: the off-node share at the measured inter-node bus bandwidth;
  // the intra-node side has no table and keeps the built-in rate.
  const double leaving = 1e8 * 15.0 / 16, off = 8.0 / 15;
  const double want =
      std::max(leaving * (1 - off) / (c.intra_bw * efficiency{}.a2a_intra), leaving * off / 40e9);
  CHECK(a2a_time(1e8, two_nodes, c, e) == doctest::Approx(want).epsilon(1e-12));

  // Attention: the measured fwd+bwd rate as a fraction of the measured GPU's peak.
  calibration attn;
  attn.measured_peak_flops = 989e12;
  attn.attention = {{1024, 0.25 * 989e12}, {8192, 0.5 * 989e12}};
  efficiency ea;
  ea.measured = &attn;
  auto m = small_model();
  const auto base = evaluate(m, gpus(8), folded).value();
  const auto cal_r = evaluate(m, gpus(8), folded, ea).value();
  // seq 1024 / cp 1: 25% of peak, against the built-in 0.5 * 1024 / (1024 + 512) = 33.3%.
  CHECK(cal_r.time.attention ==
        doctest::Approx(base.time.attention * (0.5 * 1024 / 1536) / 0.25).epsilon(1e-9));
}

TEST_CASE("calibration: an H200 copy bandwidth applies to an H100 as a fraction of HBM") {
  calibration cal;
  cal.copy_bw = 4.21e12;
  cal.measured_memory_bw = 4.8e12;
  efficiency e;
  e.measured = &cal;
  const auto h100 = gpus(8);
  CHECK(plan::detail::memory_bound_bw(h100, e) ==
        doctest::Approx(h100.memory_bw * 4.21 / 4.8).epsilon(1e-12));
  // Without the measured GPU's bandwidth the copy rate is taken as this cluster's.
  cal.measured_memory_bw = 0;
  CHECK(plan::detail::memory_bound_bw(h100, e) == doctest::Approx(4.21e12).epsilon(1e-12));
}

TEST_CASE("calibration: faster measurements never make a step slower") {
  const auto m = small_model();
  const auto c = gpus(8);
  calibration slow, fast;
  for (auto* cal : {&slow, &fast}) {
    const double f = cal == &slow ? 1.0 : 1.5;
    cal->measured_peak_flops = 989e12;
    cal->gemm = {{1024, 1024, 1024, f * 300e12}, {8192, 4096, 1024, f * 600e12}};
    cal->expert_gemm = {{512, 4096, 1024, f * 250e12}};
    cal->attention = {{1024, f * 200e12}, {4096, f * 350e12}};
    cal->copy_bw = f * 2e12;
    cal->measured_memory_bw = 4.8e12;
    cal->collectives.a2a_intra = {{1e5, f * 50e9}, {1e8, f * 150e9}};
    cal->collectives.ring_intra = {{1e5, f * 60e9}, {1e8, f * 250e9}};
    REQUIRE(normalize(*cal).has_value());
  }
  efficiency es, ef;
  es.measured = &slow;
  ef.measured = &fast;
  for (const mapping& map :
       {folded, mapping{.tp = 1, .cp = 1, .ep = 8, .etp = 1, .pp = 1, .vpp = 1, .mbs = 1},
        mapping{.tp = 4, .cp = 2, .ep = 2, .etp = 2, .pp = 1, .vpp = 1, .mbs = 1}}) {
    const auto a = evaluate(m, c, map, es).value();
    const auto b = evaluate(m, c, map, ef).value();
    CHECK(b.step_time_s < a.step_time_s);
  }
}

TEST_CASE("calibration: tables that break a rule are refused, naming it") {
  calibration dup;
  dup.attention = {{4096, 1e14}, {4096, 2e14}};
  auto st = normalize(dup);
  REQUIRE(!st);
  CHECK(st.error().message.find("two rates for size") != std::string::npos);
  calibration neg;
  neg.gemm = {{1024, 1024, -1, 1e14}};
  st = normalize(neg);
  REQUIRE(!st);
  CHECK(st.error().message.find("positive and finite") != std::string::npos);
  calibration unsorted;
  unsorted.collectives.a2a_intra = {{1e8, 2e11}, {1e6, 1e11}};
  REQUIRE(normalize(unsorted).has_value());
  CHECK(unsorted.collectives.a2a_intra.front().size == 1e6);  // sorted for interpolation
  CHECK(unsorted.measured_sections().size() == 1);
  CHECK(unsorted.builtin_sections().size() == 7);
}
