// The keep decision as kernels (kernels/capacity.hpp) on the CPU executor against the host's
// rule (tests/support/host_drop_policy.hpp, detail::keep_within_capacity) on fresh random routings
// (seed printed; MOEFOLD_TEST_SEED replays one): keep mask, routed/dropped/padded counts, filler
// map, dropped pairs and fully dropped rows all equal, outputs poisoned before each launch. Cases:
// drop by probability (with ties: probabilities drawn from a few values) and by position; pad
// mode; row order and a shuffled true order with a counted slice (the full-sequence form);
// tokens 1/7/513, E 1/8/64/256, k 1/2/8, capacity factors that keep all, some and almost none;
// all tokens on one expert (empty experts, most pairs dropped). The expert offsets
// (expert_offsets_kernel) equal the host's prefix sum, and the kept probabilities
// (kept_probs_kernel, fp32 and bf16) are the probabilities where kept, 0 where dropped. Every
// case's launches also run on host_exec (a team of one for drop_totals_kernel's block scans) on the
// same inputs: the same outcome, bit for bit (integer kernels).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <moefold/dispatch/drop_counts.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/kernels/capacity.hpp>
#include <numeric>
#include <random>
#include <vector>

#include "../support/host_drop_policy.hpp"
#include "../support/simt_contexts.hpp"
#include "../support/simt_test_sizes.hpp"

using namespace moefold;
namespace k = moefold::kernels;

namespace {

struct record {
  int N, K, E;
  std::vector<int> expert;
  std::vector<float> probs;
};

// k distinct experts per token; `skew` sends every token's first pair to expert 0.
record draw_record(int N, int K, int E, bool skew, std::mt19937_64& rng) {
  record r{N, K, E, {}, {}};
  std::vector<int> ids(static_cast<std::size_t>(E));
  std::iota(ids.begin(), ids.end(), 0);
  for (int t = 0; t < N; ++t) {
    std::shuffle(ids.begin(), ids.end(), rng);
    if (skew) std::iter_swap(ids.begin(), std::find(ids.begin(), ids.end(), 0));
    for (int i = 0; i < K; ++i) {
      r.expert.push_back(ids[static_cast<std::size_t>(i)]);
      // Eight distinct values: many ties, which earlier order must break.
      r.probs.push_back(static_cast<float>(rng() % 8) / 8.0f);
    }
  }
  return r;
}

struct outcome {
  std::vector<std::uint8_t> keep, filler;
  std::vector<int> routed, dropped, padded;
  std::vector<int> kept, dispatched;  // the kept record (-1 = dropped), rows per expert
  long long dropped_pairs = 0, fully_dropped = 0;
};

outcome host_rule(const record& r, int C, drop_by by, bool pad, const std::vector<long long>& order,
                  long long first, long long count) {
  outcome o;
  o.keep.assign(r.expert.size(), 0xEE);
  o.filler.assign(static_cast<std::size_t>(count) * r.E, 0xEE);
  o.routed.assign(static_cast<std::size_t>(r.E), -5);
  o.dropped = o.padded = o.routed;
  const routing_view<float> v{.num_tokens = r.N,
                              .topk = r.K,
                              .num_experts = r.E,
                              .expert = r.expert.data(),
                              .probs = r.probs.data(),
                              .keep = o.keep.data()};
  drop_counts c{
      .routed = o.routed, .dropped = o.dropped, .padded = o.padded, .filler_map = o.filler};
  drop_scratch<float> ws;
  detail::keep_within_capacity(v, C, by, pad, order, static_cast<std::size_t>(first),
                               static_cast<std::size_t>(count), c, ws);
  o.dropped_pairs = c.dropped_pairs;
  o.fully_dropped = c.fully_dropped_tokens;
  for (std::size_t p = 0; p < r.expert.size(); ++p)
    o.kept.push_back(o.keep[p] != 0 ? r.expert[p] : -1);
  for (std::size_t e = 0; e < static_cast<std::size_t>(r.E); ++e)
    o.dispatched.push_back(c.dispatched(e));
  return o;
}

// The launches on `on` (cpu_exec: a fresh seed for each).
outcome kernel_rule(test::simt_on on, const record& r, int C, drop_by by, bool pad,
                    const std::vector<long long>& order, long long first, long long count,
                    std::mt19937_64& rng) {
  const auto run = [&](const launch_grid& g, const auto& kernel) {
    REQUIRE(test::simt_launcher{on, rng()}(g, kernel));
  };
  // Offsets of the pairs grouped by expert from their counts (the histogram's: ids outside
  // [0, E) are counted nowhere), by expert_offsets_kernel, against the host's prefix sum.
  std::vector<int> counts(static_cast<std::size_t>(r.E), 0);
  for (int e : r.expert)
    if (e >= 0 && e < r.E) ++counts[static_cast<std::size_t>(e)];
  std::vector<int> want_offsets(static_cast<std::size_t>(r.E) + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), want_offsets.begin() + 1);
  std::vector<int> offsets(static_cast<std::size_t>(r.E) + 1, -6);
  run(launch_grid{.blocks = 1},
      k::expert_offsets_kernel{
          .counts = counts.data(), .num_experts = r.E, .offsets = offsets.data()});
  REQUIRE(offsets == want_offsets);
  std::vector<long long> by_order(order.size());
  for (std::size_t t = 0; t < order.size(); ++t) by_order[static_cast<std::size_t>(order[t])] = t;
  outcome o;
  o.keep.assign(r.expert.size(), 0xEE);
  o.filler.assign(static_cast<std::size_t>(count) * r.E, 0xEE);
  o.routed.assign(static_cast<std::size_t>(r.E), -5);
  o.dropped = o.padded = o.routed;
  std::vector<int> scratch(r.expert.size() + 1, -9);
  std::vector<long long> totals(2, -3);
  const k::keep_args<float> args{.expert = r.expert.data(),
                                 .probs = r.probs.data(),
                                 .order = order.empty() ? nullptr : order.data(),
                                 .by_order = order.empty() ? nullptr : by_order.data(),
                                 .offsets = offsets.data(),
                                 .scratch = scratch.data(),
                                 .num_tokens = r.N,
                                 .topk = r.K,
                                 .num_experts = r.E,
                                 .capacity = C,
                                 .by = by,
                                 .pad = pad,
                                 .first = first,
                                 .count = count,
                                 .keep = o.keep.data(),
                                 .routed = o.routed.data(),
                                 .dropped = o.dropped.data(),
                                 .padded = o.padded.data(),
                                 .filler_map = o.filler.data()};
  run(launch_grid{.blocks = 2}, k::expert_lists_kernel<float>{args});
  run(launch_grid{.blocks = 3}, k::keep_rank_kernel<float>{args});
  const k::drop_totals_kernel totals_k{.keep = o.keep.data(),
                                       .dropped = o.dropped.data(),
                                       .topk = r.K,
                                       .num_experts = r.E,
                                       .first = first,
                                       .count = count,
                                       .totals = totals.data()};
  run(launch_grid{.blocks = 1, .smem_bytes = k::drop_totals_kernel::smem_bytes}, totals_k);
  o.dropped_pairs = totals[0];
  o.fully_dropped = totals[1];
  o.kept.assign(r.expert.size(), -7);
  o.dispatched.assign(static_cast<std::size_t>(r.E), -7);
  const k::kept_record_kernel record{.expert = r.expert.data(),
                                     .keep = o.keep.data(),
                                     .pairs = static_cast<long long>(r.expert.size()),
                                     .kept = o.kept.data(),
                                     .routed = o.routed.data(),
                                     .dropped = o.dropped.data(),
                                     .padded = o.padded.data(),
                                     .num_experts = r.E,
                                     .dispatched = o.dispatched.data()};
  run(launch_grid{.blocks = 2}, record);
  // The kept pairs' probabilities as they travel to the experts (fp32 and bf16: the test's
  // probabilities are multiples of 1/8, exact in both): probs where kept, 0 where dropped.
  std::vector<float> pf(r.probs.size(), -1.f);
  std::vector<bfloat16> pb(r.probs.size(), bfloat16(-1.f));
  const auto pairs = static_cast<long long>(r.probs.size());
  run(launch_grid{.blocks = 2},
      k::kept_probs_kernel<float, float>{
          .kept = o.kept.data(), .probs = r.probs.data(), .pairs = pairs, .out = pf.data()});
  run(launch_grid{.blocks = 3},
      k::kept_probs_kernel<float, bfloat16>{
          .kept = o.kept.data(), .probs = r.probs.data(), .pairs = pairs, .out = pb.data()});
  for (std::size_t p = 0; p < r.probs.size(); ++p) {
    const float want = o.kept[p] == -1 ? 0.f : r.probs[p];
    if (pf[p] != want || static_cast<float>(pb[p]) != want) {
      CHECK(pf[p] == want);
      CHECK(static_cast<float>(pb[p]) == want);
    }
  }
  return o;
}

void check_same(const outcome& got, const outcome& want) {
  CHECK(got.keep == want.keep);
  CHECK(got.routed == want.routed);
  CHECK(got.dropped == want.dropped);
  CHECK(got.padded == want.padded);
  CHECK(got.filler == want.filler);
  CHECK(got.dropped_pairs == want.dropped_pairs);
  CHECK(got.fully_dropped == want.fully_dropped);
  CHECK(got.kept == want.kept);
  CHECK(got.dispatched == want.dispatched);
}

// The kernels on cpu_exec (returned) and on host_exec, the same outcome from both.
outcome kernel_rule_both(const record& r, int C, drop_by by, bool pad,
                         const std::vector<long long>& order, long long first, long long count,
                         std::mt19937_64& rng) {
  outcome cpu = kernel_rule(test::simt_on::cpu_exec, r, C, by, pad, order, first, count, rng);
  const outcome host =
      kernel_rule(test::simt_on::host_exec, r, C, by, pad, order, first, count, rng);
  INFO("host_exec against cpu_exec");
  check_same(host, cpu);
  return cpu;
}

}  // namespace

TEST_CASE("capacity keep kernels equal the host's keep rule") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  long cases = 0, records = 0, dropped_somewhere = 0, padded_somewhere = 0;
  const std::vector<int> tokens =
      test::simt_reduced ? std::vector<int>{1, 7, 64} : std::vector<int>{1, 7, 513};
  for (int N : tokens)
    for (int E : {1, 8, 64, 256})
      for (int K : {1, 2, 8}) {
        if (K > E) continue;
        for (double cf : {0.25, 1.0, 1.5}) {
          for (bool skew : {false, true}) {
            // Under TSan: every E and k; skewed routing at factor 1, uniform at 0.25.
            if (test::simt_reduced && (skew ? cf != 1.0 : cf != 0.25)) continue;
            const record r = draw_record(N, K, E, skew, rng);
            const int C = *expert_capacity(static_cast<long long>(N) * K, E, cf);
            // Every combination of (by, pad, true order) for 7 tokens over 8 experts, k = 2; one
            // of them per record otherwise, in turn (each launch on the CPU executor starts its
            // threads afresh: about 40 ms).
            const bool small = N == 7 && E == 8 && K == 2;
            const int pick = static_cast<int>(records++ % 8);
            for (int combo = 0; combo < 8; ++combo) {
              if (!small && combo != pick) continue;
              const drop_by by = (combo & 1) != 0 ? drop_by::position : drop_by::probs;
              const bool pad = (combo & 2) != 0, shuffled = (combo & 4) != 0;
              if (pad && C > N) continue;  // the policies refuse it
              std::vector<long long> order;
              long long first = 0, count = N;
              if (shuffled) {  // a gathered group: true order shuffled, a middle slice counted
                order.resize(static_cast<std::size_t>(N));
                std::iota(order.begin(), order.end(), 0LL);
                std::shuffle(order.begin(), order.end(), rng);
                first = N / 3;
                count = N - N / 3 - N / 4;
              }
              CAPTURE(N);
              CAPTURE(E);
              CAPTURE(K);
              CAPTURE(cf);
              CAPTURE(C);
              CAPTURE(skew);
              CAPTURE(by == drop_by::probs);
              CAPTURE(pad);
              CAPTURE(shuffled);
              const outcome want = host_rule(r, C, by, pad, order, first, count);
              const outcome got = kernel_rule_both(r, C, by, pad, order, first, count, rng);
              check_same(got, want);
              ++cases;
              dropped_somewhere += want.dropped_pairs > 0;
              padded_somewhere +=
                  std::any_of(want.padded.begin(), want.padded.end(), [](int p) { return p > 0; });
            }
          }
        }
      }
  MESSAGE(cases << " cases; " << dropped_somewhere << " dropped pairs, " << padded_somewhere
                << " padded");
  CHECK(dropped_somewhere > 0);
  CHECK(padded_somewhere > 0);
}

TEST_CASE("capacity keep kernels: an expert id outside [0, E) stays in bounds and passes through") {
  // A router fed NaN names expert INT_MAX: the histogram counts it nowhere, so it is in no list;
  // the ranks run over the listed pairs only (no read or write past them: ASan checks), its keep
  // byte stays unwritten, and the kept record passes the id on for the dispatcher to report. The
  // other pairs obey the rule: each expert keeps min(routed, C) of its pairs, the most probable.
  std::mt19937_64 rng(test::simt_seed());
  record r = draw_record(7, 2, 8, true, rng);
  const int C = 1;  // expert 0 holds every token's first pair: most are dropped
  const std::size_t bad = 5;
  r.expert[bad] = 2147483647;
  const outcome got = kernel_rule_both(r, C, drop_by::probs, false, {}, 0, r.N, rng);
  CHECK(got.keep[bad] == 0xEE);  // never written
  CHECK(got.kept[bad] == 2147483647);
  for (int e = 0; e < r.E; ++e) {
    CAPTURE(e);
    int routed = 0, kept = 0;
    float lowest_kept = 2.0f, highest_dropped = -1.0f;
    for (std::size_t p = 0; p < r.expert.size(); ++p) {
      if (r.expert[p] != e) continue;
      ++routed;
      CHECK(got.kept[p] == (got.keep[p] != 0 ? e : -1));
      if (got.keep[p] != 0) {
        ++kept;
        lowest_kept = std::min(lowest_kept, r.probs[p]);
      } else {
        highest_dropped = std::max(highest_dropped, r.probs[p]);
      }
    }
    const auto i = static_cast<std::size_t>(e);
    CHECK(got.routed[i] == routed);
    CHECK(kept == std::min(routed, C));
    CHECK(got.dropped[i] == routed - kept);
    CHECK(got.dispatched[i] == kept);
    CHECK(lowest_kept >= highest_dropped);
  }
  CHECK(got.dropped_pairs > 0);
}
