// Drop policies on one rank: capacity, the keep rules (invariant 7), drop accounting (invariant
// 5), padding, reports, the relations between the policies, and bad input.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/exec/host_exec.hpp>
#include "../support/host_drop_policy.hpp"
#include "../support/host_topk_router.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "util.hpp"

using namespace moefold;
using moefold::test::random_vector;

namespace {

constexpr int E = 8;

topk_routing<double> route(int n, int k, std::uint64_t seed,
                           score_function f = score_function::softmax) {
  const auto logits = random_vector<double>(static_cast<std::size_t>(n) * E, seed);
  topk_routing<double> r;
  REQUIRE(host_topk_router<double>::make({.num_experts = E, .topk = k, .score = f})
              .value()
              .route(logits, r));
  return r;
}

// Independent check of one drop result against the rules, written from section 3 of the reference.
void check_rules(const topk_routing<double>& r, const drop_result<double>& d, int C, drop_by by,
                 bool pad) {
  const int N = r.num_tokens, k = r.topk;
  long long kept_total = 0;
  for (int e = 0; e < E; ++e) {
    CAPTURE(e);
    std::vector<int> routed;  // tokens routed to e, in token order
    std::vector<double> p;
    for (int t = 0; t < N; ++t)
      for (int i = 0; i < k; ++i)
        if (r.expert(t, i) == e) {
          routed.push_back(t);
          p.push_back(r.prob(t, i));
        }
    std::vector<int> kept, dropped;
    for (std::size_t j = 0; j < routed.size(); ++j)
      (d.final_map[routed[j] * E + e] ? kept : dropped).push_back(static_cast<int>(j));
    CHECK(static_cast<int>(kept.size()) == std::min<int>(C, static_cast<int>(routed.size())));
    CHECK(d.report.routed[e] == static_cast<int>(routed.size()));
    CHECK(d.report.dropped[e] == static_cast<int>(dropped.size()));
    kept_total += static_cast<long long>(kept.size());
    for (int a : kept)
      for (int b : dropped) {
        if (by == drop_by::position) {
          CHECK(routed[a] < routed[b]);  // the earliest tokens stay
        } else {
          CHECK(p[a] >= p[b]);  // the highest probabilities stay; ties: earlier token
          if (p[a] == p[b]) CHECK(routed[a] < routed[b]);
        }
      }
    // Final probs: survivors unchanged (no renormalisation), everything else exactly 0.
    int column = 0;
    for (int t = 0; t < N; ++t) {
      column += d.final_map[t * E + e];
      bool is_routed = false;
      double prob = 0;
      for (int i = 0; i < k; ++i)
        if (r.expert(t, i) == e) {
          is_routed = true;
          prob = r.prob(t, i);
        }
      if (d.final_map[t * E + e] && is_routed)
        CHECK(d.final_probs[t * E + e] == prob);
      else
        CHECK(d.final_probs[t * E + e] == 0.0);
      if (!pad) CHECK((!d.final_map[t * E + e] || is_routed));
    }
    if (pad) {
      CHECK(column == C);  // exactly C rows per expert
      CHECK(d.report.padded[e] == C - static_cast<int>(kept.size()));
      // Fillers are the earliest non-routed tokens.
      int fillers_seen = 0;
      for (int t = 0; t < N && fillers_seen < d.report.padded[e]; ++t) {
        bool is_routed = std::find(routed.begin(), routed.end(), t) != routed.end();
        if (!is_routed) {
          CHECK(d.final_map[t * E + e] == 1);
          ++fillers_seen;
        }
      }
    } else {
      CHECK(d.report.padded[e] == 0);
    }
  }
  // Invariant 5: sum(final_map) + dropped == N*k (without padding).
  if (!pad) {
    long long m = 0;
    for (auto v : d.final_map) m += v;
    CHECK(m + d.report.dropped_pairs == static_cast<long long>(N) * k);
  }
  CHECK(kept_total + d.report.dropped_pairs == static_cast<long long>(N) * k);
  // Fully dropped tokens: every final prob of the token is 0.
  int fully = 0;
  for (int t = 0; t < N; ++t) {
    int kept_pairs = 0;
    for (int i = 0; i < k; ++i) kept_pairs += d.kept[t * k + i];
    if (kept_pairs == 0) {
      ++fully;
      for (int e = 0; e < E; ++e) CHECK(d.final_probs[t * E + e] == 0.0);
    }
  }
  CHECK(d.report.fully_dropped_tokens == fully);
}

}  // namespace

TEST_CASE("capacity: ceil(tokens*k/E * cf), and the factor must be positive") {
  CHECK(expert_capacity(64 * 2, 8, 1.0).value() == 16);
  CHECK(expert_capacity(10 * 2, 8, 1.0).value() == 3);  // ceil(2.5)
  CHECK(expert_capacity(10 * 3, 8, 0.5).value() == 2);  // ceil(1.875)
  CHECK(expert_capacity(0, 8, 1.0).value() == 0);
  CHECK(expert_capacity(12, 8, 0.0).error().code == errc::invalid_argument);
  CHECK(expert_capacity(12, 8, -1.0).error().code == errc::invalid_argument);
  CHECK(expert_capacity(12, 8, NAN).error().code == errc::invalid_argument);
  CHECK(expert_capacity(12, 8, INFINITY).error().code == errc::invalid_argument);
  CHECK(expert_capacity(1ll << 40, 1, 4.0).error().code == errc::overflow);
}

TEST_CASE("sub-sequence dropping follows the keep rules (invariants 5 and 7)") {
  for (int k : {1, 2, 3})
    for (double cf : {0.25, 0.5, 1.0, 1.5})
      for (auto by : {drop_by::probs, drop_by::position})
        for (bool pad : {false, true}) {
          const int N = 40;
          CAPTURE(k);
          CAPTURE(cf);
          CAPTURE(static_cast<int>(by));
          CAPTURE(pad);
          const auto r = route(N, k, 200 + static_cast<std::uint64_t>(k), score_function::sigmoid);
          const int C = expert_capacity(static_cast<long long>(N) * k, E, cf).value();
          drop_result<double> d;
          REQUIRE(host_apply(sub_sequence{.capacity_factor = cf, .pad_to_capacity = pad, .by = by},
                             r, d));
          CHECK(d.report.capacity == C);
          check_rules(r, d, C, by, pad);
        }
}

TEST_CASE("ties are deterministic: equal probabilities keep the earlier token") {
  // Every token routes to experts 0 and 1 with probability 0.5: a total tie.
  topk_routing<double> r{.num_tokens = 10, .num_experts = E, .topk = 2, .indices = {}, .probs = {}};
  for (int t = 0; t < 10; ++t) {
    r.indices.insert(r.indices.end(), {0, 1});
    r.probs.insert(r.probs.end(), {0.5, 0.5});
  }
  for (auto by : {drop_by::probs, drop_by::position}) {
    drop_result<double> d;
    REQUIRE(
        host_apply(sub_sequence{.capacity_factor = 1.0, .by = by}, r, d));  // C = ceil(20/8) = 3
    for (int t = 0; t < 10; ++t) {
      CHECK(d.final_map[t * E + 0] == (t < 3));
      CHECK(d.final_map[t * E + 1] == (t < 3));
    }
    CHECK(d.report.dropped[0] == 7);
    CHECK(d.report.fully_dropped_tokens == 7);
  }
}

TEST_CASE("a worked example: who is dropped and why (docs/routing.md)") {
  // 6 tokens, 4 experts, top-1, capacity factor 1: C = ceil(6*1/4 * 1) = 2.
  topk_routing<double> r{.num_tokens = 6,
                         .num_experts = 4,
                         .topk = 1,
                         .indices = {0, 0, 1, 0, 0, 2},
                         .probs = {0.5, 0.9, 0.6, 0.7, 0.4, 0.8}};
  drop_result<double> byp, bypos, pad;
  REQUIRE(host_apply(sub_sequence{.capacity_factor = 1.0, .by = drop_by::probs}, r, byp));
  REQUIRE(host_apply(sub_sequence{.capacity_factor = 1.0, .by = drop_by::position}, r, bypos));
  REQUIRE(host_apply(sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true}, r, pad));
  // Expert 0 got tokens 0, 1, 3, 4 (probs .5 .9 .7 .4): probs keeps 1 and 3, position keeps 0, 1.
  CHECK(byp.kept == std::vector<std::uint8_t>{0, 1, 1, 1, 0, 1});
  CHECK(bypos.kept == std::vector<std::uint8_t>{1, 1, 1, 0, 0, 1});
  CHECK(byp.report.dropped == std::vector<int>{2, 0, 0, 0});
  CHECK(byp.kept_experts(r) == std::vector<int>{-1, 0, 1, 0, -1, 2});
  CHECK(byp.kept_probs(r) == std::vector<double>{0.0, 0.9, 0.6, 0.7, 0.0, 0.8});

  // Pad: expert 1 (token 2) gets filler token 0, expert 2 (token 5) filler 0, expert 3 tokens 0, 1.
  CHECK(pad.report.padded == std::vector<int>{0, 1, 1, 2});
  CHECK(pad.final_map[0 * 4 + 1] == 1);
  CHECK(pad.final_probs[0 * 4 + 1] == 0.0);
  CHECK(pad.final_map[1 * 4 + 3] == 1);
}

TEST_CASE("capacity >= tokens: sub- and full-sequence dropping equal dropless") {
  const int N = 12, k = 2;
  const auto r = route(N, k, 301);
  drop_result<double> none, sub, full;
  REQUIRE(host_apply(dropless{}, r, none));
  CHECK(!none.report.capacity);  // dropless: no capacity
  CHECK(none.report.dropped_pairs == 0);
  CHECK(none.final_probs == r.dense_probs());
  CHECK(none.final_map == r.dense_map());
  // cf = E/k makes C = N.
  REQUIRE(host_apply(sub_sequence{.capacity_factor = 4.0, .by = drop_by::position}, r, sub));
  CHECK(sub.report.capacity == N);
  CHECK(sub.final_map == none.final_map);
  CHECK(sub.final_probs == none.final_probs);
  const auto st = run_thread_world(1, [&](thread_communicator& c) {
    return host_apply(full_sequence{.capacity_factor = 10.0}, c, {}, r, full);
  });
  REQUIRE(st[0]);
  CHECK(full.final_map == none.final_map);
  CHECK(full.final_probs == none.final_probs);
}

TEST_CASE("full-sequence dropping on one rank equals sub-sequence dropping") {
  const int N = 30;
  for (auto by : {drop_by::probs, drop_by::position})
    for (bool pad : {false, true}) {
      const auto r = route(N, 2, 311);
      drop_result<double> sub, full;
      REQUIRE(host_apply(sub_sequence{.capacity_factor = 0.6, .pad_to_capacity = pad, .by = by}, r,
                         sub));
      const auto st = run_thread_world(1, [&](thread_communicator& c) {
        return host_apply(full_sequence{.capacity_factor = 0.6, .pad_to_capacity = pad, .by = by},
                          c, {}, r, full);
      });
      REQUIRE(st[0]);
      CHECK(full.final_map == sub.final_map);
      CHECK(full.final_probs == sub.final_probs);
      CHECK(full.kept == sub.kept);
      CHECK(full.report.dropped == sub.report.dropped);
      CHECK(full.report.padded == sub.report.padded);
    }
}

TEST_CASE("no tokens: nothing to drop, no error") {
  topk_routing<double> r{.num_tokens = 0, .num_experts = E, .topk = 2, .indices = {}, .probs = {}};
  drop_result<double> d;
  REQUIRE(host_apply(sub_sequence{.capacity_factor = 1.0}, r, d));
  CHECK(d.report.capacity == 0);
  CHECK(d.final_map.empty());
  REQUIRE(host_apply(dropless{}, r, d));
}

TEST_CASE("bad input: capacity factor, pad beyond the tokens, malformed routings") {
  const auto r = route(8, 2, 321);
  drop_result<double> d;
  CHECK(host_apply(sub_sequence{.capacity_factor = 0.0}, r, d).error().code ==
        errc::invalid_argument);
  CHECK(host_apply(sub_sequence{.capacity_factor = -1.0}, r, d).error().code ==
        errc::invalid_argument);
  // Pad with C = ceil(8*2/8 * 5) = 10 > 8 tokens.
  auto s = host_apply(sub_sequence{.capacity_factor = 5.0, .pad_to_capacity = true}, r, d);
  CHECK(s.error().code == errc::invalid_argument);
  CHECK(s.error().message.find("10") != std::string::npos);
  auto bad = r;
  bad.indices[3] = E;
  CHECK(host_apply(sub_sequence{}, bad, d).error().code == errc::invalid_argument);
  bad = r;
  bad.indices[3] = bad.indices[2];
  CHECK(host_apply(dropless{}, bad, d).error().code == errc::invalid_argument);
  bad = r;
  bad.probs[5] = NAN;
  CHECK(host_apply(sub_sequence{}, bad, d).error().code == errc::non_finite_input);
  bad = r;
  bad.probs.pop_back();
  CHECK(host_apply(sub_sequence{}, bad, d).error().code == errc::shape_mismatch);
  std::vector<double> dfinal(8 * E), dprobs(3);
  REQUIRE(host_apply(sub_sequence{}, r, d));
  CHECK(d.mask_gradient(r, dfinal, dprobs).error().code == errc::shape_mismatch);
  // full_sequence: keys of the wrong length, duplicate keys.
  const auto st = run_thread_world(1, [&](thread_communicator& c) {
    std::vector<std::int64_t> keys(7, 0);
    CHECK(host_apply(full_sequence{}, c, keys, r, d).error().code == errc::shape_mismatch);
    keys.assign(8, 3);
    CHECK(host_apply(full_sequence{}, c, keys, r, d).error().code == errc::invalid_argument);
  });
  REQUIRE(st[0]);
  CHECK(sequence_order_keys({.tp_rank = 2, .tp = 2, .local_seq = 4}).error().code ==
        errc::invalid_argument);
  CHECK(sequence_order_keys({.tp = 1, .cp_rank = 0, .cp = 2, .local_seq = 3}).error().code ==
        errc::invalid_argument);  // odd CP part cannot be split in two chunks
}

TEST_CASE("a user policy in the host form: the dense form follows its mask") {
  // (The drop-policy concept on a context, the library's policies and a user's:
  // tests/dispatch/drop_policy_context_test.cpp.)
  struct keep_first_token_only {  // a user policy: each token keeps only its first expert
    status apply(thread_communicator&, std::span<const std::int64_t>, const routing_view<double>& r,
                 drop_counts& out, drop_scratch<double>&) const {
      for (std::size_t p = 0; p < r.pairs(); ++p)
        r.keep[p] = p % static_cast<std::size_t>(r.topk) == 0 ? 1 : 0;
      return fill_drop_counts(r, std::nullopt, out);
    }
  };
  static_assert(drop_policy<dropless, double, host_exec, thread_communicator>);
  static_assert(drop_policy<sub_sequence, float, host_exec, thread_communicator>);
  static_assert(drop_policy<full_sequence, double, host_exec, thread_communicator>);
  static_assert(!drop_policy<keep_first_token_only, double, host_exec, thread_communicator>);
  static_assert(!drop_policy<int, double, host_exec, thread_communicator>);
  const auto r = route(10, 2, 331);
  drop_result<double> d;
  const auto st = run_thread_world(
      1, [&](thread_communicator& c) { return apply_dense(keep_first_token_only{}, c, {}, r, d); });
  REQUIRE(st[0]);
  for (int t = 0; t < 10; ++t) {  // the dense form follows the mask
    CHECK(d.kept[static_cast<std::size_t>(t) * 2 + 1] == 0);
    CHECK(d.final_map[static_cast<std::size_t>(t) * E + static_cast<std::size_t>(r.expert(t, 1))] ==
          0);
    CHECK(d.final_map[static_cast<std::size_t>(t) * E + static_cast<std::size_t>(r.expert(t, 0))] ==
          1);
  }
  CHECK(d.report.dropped_pairs == 10);
  int second = 0;
  for (int t = 0; t < 10; ++t) second += r.expert(t, 1) == 3;
  CHECK(d.report.dropped[3] == second);
}

TEST_CASE("sequence order keys: SP over TP, load-balanced chunks over CP") {
  // S = 8, B = 1, TP = 1, CP = 2: chunks of 2; CP rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2.
  CHECK(sequence_order_keys({.cp_rank = 0, .cp = 2, .local_seq = 4}).value() ==
        std::vector<std::int64_t>{0, 1, 6, 7});
  CHECK(sequence_order_keys({.cp_rank = 1, .cp = 2, .local_seq = 4}).value() ==
        std::vector<std::int64_t>{2, 3, 4, 5});
  // TP = 2 inside CP rank 1: tp rank 1 holds the second half of {2,3,4,5}.
  CHECK(
      sequence_order_keys({.tp_rank = 1, .tp = 2, .cp_rank = 1, .cp = 2, .local_seq = 2}).value() ==
      std::vector<std::int64_t>{4, 5});
  // B = 2: key = position * B + b.
  CHECK(sequence_order_keys({.tp_rank = 1, .tp = 2, .local_seq = 2, .batch = 2}).value() ==
        std::vector<std::int64_t>{4, 5, 6, 7});
}

TEST_CASE("a worked example over TP = 2: full- vs sub-sequence dropping (docs/routing.md)") {
  // 8 tokens (S = 8, B = 1), 4 experts, top-1, capacity factor 1. Rank 0 holds tokens 0-3,
  // rank 1 tokens 4-7 (sequence parallelism). Expert 0 gets tokens 0, 1, 2 (probs .7 .9 .8).
  const std::vector<int> expert = {0, 0, 0, 1, 1, 2, 3, 3};
  const std::vector<double> prob = {0.7, 0.9, 0.8, 0.6, 0.5, 0.9, 0.4, 0.3};
  auto local = [&](int rank) {
    topk_routing<double> r{
        .num_tokens = 4, .num_experts = 4, .topk = 1, .indices = {}, .probs = {}};
    r.indices.assign(expert.begin() + 4 * rank, expert.begin() + 4 * rank + 4);
    r.probs.assign(prob.begin() + 4 * rank, prob.begin() + 4 * rank + 4);
    return r;
  };
  std::vector<std::vector<std::uint8_t>> kept(2);
  auto run = [&](auto policy) {
    const auto st = run_thread_world(2, [&](thread_communicator& c) {
      const auto keys = sequence_order_keys({.tp_rank = c.rank(), .tp = 2, .local_seq = 4}).value();
      drop_result<double> d;
      const auto r = local(c.rank());
      const status s = host_apply(policy, c, keys, r, d);
      kept[static_cast<std::size_t>(c.rank())] = d.kept;
      return s;
    });
    REQUIRE(st[0]);
    REQUIRE(st[1]);
    std::vector<int> dropped;
    for (int t = 0; t < 8; ++t)
      if (!kept[static_cast<std::size_t>(t / 4)][static_cast<std::size_t>(t % 4)])
        dropped.push_back(t);
    return dropped;
  };
  // Full sequence: C = ceil(8*1/4 * 1) = 2 over all 8 tokens; only expert 0 overflows.
  CHECK(run(full_sequence{.capacity_factor = 1.0, .by = drop_by::probs}) == std::vector<int>{0});
  CHECK(run(full_sequence{.capacity_factor = 1.0, .by = drop_by::position}) == std::vector<int>{2});
  // Sub-sequence: C = ceil(4*1/4 * 1) = 1 per rank; expert 0 keeps one of tokens 0-2 and expert 3
  // one of tokens 6-7.
  CHECK(run(sub_sequence{.capacity_factor = 1.0, .by = drop_by::probs}) ==
        std::vector<int>{0, 2, 7});
  CHECK(run(sub_sequence{.capacity_factor = 1.0, .by = drop_by::position}) ==
        std::vector<int>{1, 2, 7});
}
