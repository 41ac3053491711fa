// The drop policies on an execution context (dispatch/capacity_keep.hpp: dropless, sub_sequence,
// full_sequence's context forms) on host_exec and cpu_exec against the host reference
// (tests/support/host_drop_policy.hpp, the rule of docs/dispatch-semantics.md section 3) on
// fresh random routings (seed printed): the keep mask,
// the kept record, routed / dropped / padded per expert, the dropped pairs and fully dropped
// tokens, the capacity and pad rows, pad mode's filler map; full-sequence dropping over tp-cp
// groups of 2 and 4 thread-world ranks, with sequence_order_keys' keys and in rank order. Bad
// routings and order keys that break the contract (a permutation of [0, M) over the group) are
// errors naming the first bad slot or key on host_exec, on every rank of the group, and lower the
// caller's sticky fault words (kept across later decisions) on host_exec and cpu_exec, where
// they are all the caller learns (device memory: nothing read back); a user policy (one that
// keeps a given set of pairs) models the concept; drop_policy_variant holding each of the three
// decides as the policy it holds.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/sequence_order.hpp>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "../support/context_buffers.hpp"
#include "../support/host_drop_policy.hpp"
#include "../support/simt_test_sizes.hpp"

using namespace moefold;

namespace {

// A routing of N tokens: k distinct experts each, random probabilities (ties included).
struct routing_case {
  int N, k, E;
  std::vector<int> experts;
  std::vector<float> probs;
};
routing_case random_routing(int N, int k, int E, std::mt19937_64& rng) {
  routing_case r{N, k, E, {}, {}};
  std::uniform_int_distribution<int> p(0, 7);
  for (int t = 0; t < N; ++t) {
    std::vector<int> all(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) all[static_cast<std::size_t>(e)] = e;
    // Skewed: low experts more often, so that columns overflow.
    std::shuffle(all.begin(), all.end(), rng);
    std::partial_sort(all.begin(), all.begin() + k, all.end(),
                      [&](int a, int b) { return (a % 3) < (b % 3); });
    for (int i = 0; i < k; ++i) {
      r.experts.push_back(all[static_cast<std::size_t>(i)]);
      r.probs.push_back(0.125f * static_cast<float>(p(rng)));  // eighths: ties
    }
  }
  return r;
}

// What a decision gave, on the host.
struct decided {
  std::vector<std::uint8_t> keep, filler;
  std::vector<int> kept, routed, dropped, padded;
  long long dropped_pairs = 0, fully_dropped = 0;
  std::optional<int> capacity, pad_rows;
};

// The host policy's decision (the reference).
template <class P, class C>
decided host_decision(const P& policy, C& comm, const routing_case& r,
                      const std::vector<std::int64_t>& keys) {
  topk_routing<float> tr{
      .num_tokens = r.N, .num_experts = r.E, .topk = r.k, .indices = r.experts, .probs = r.probs};
  decided d;
  d.keep.assign(r.experts.size(), 7);
  d.filler.assign(static_cast<std::size_t>(r.N) * r.E, 7);
  drop_report rep;
  drop_scratch<float> ws;
  auto counts = counts_into(rep, r.E, d.filler);
  const auto rv = view_of(tr, std::span<std::uint8_t>(d.keep));
  REQUIRE(host_apply(policy, comm, keys, rv, counts, ws));
  for (std::size_t p = 0; p < r.experts.size(); ++p)
    d.kept.push_back(d.keep[p] ? r.experts[p] : -1);
  d.routed = rep.routed;
  d.dropped = rep.dropped;
  d.padded = rep.padded;
  d.dropped_pairs = counts.dropped_pairs;
  d.fully_dropped = counts.fully_dropped_tokens;
  d.capacity = counts.capacity;
  d.pad_rows = counts.pad_rows;
  return d;
}

using test::back;
using test::on;

// The context policy's decision on Exec.
template <class P, class Exec, class C>
expected<decided> context_decision(const P& policy, Exec& x, C& comm, const routing_case& r,
                                   const std::vector<std::int64_t>& keys, int group,
                                   std::vector<int>* faults = nullptr) {
  auto ex = on(x, r.experts, r.N, r.k);
  auto pr = on(x, r.probs, r.N, r.k);
  auto ky = on(x, keys, keys.empty() ? 0 : r.N, keys.empty() ? 0 : 1);
  auto keep = on(x, std::vector<std::uint8_t>(r.experts.size(), 7), r.N, r.k);
  auto kept = on(x, std::vector<int>(r.experts.size(), 7), r.N, r.k);
  auto routed = on(x, std::vector<int>(r.E, 7), 1, r.E),
       dropped = on(x, std::vector<int>(r.E, 7), 1, r.E),
       padded = on(x, std::vector<int>(r.E, 7), 1, r.E);
  auto totals = on(x, std::vector<long long>(2, 7), 1, 2);
  auto filler = on(x, std::vector<std::uint8_t>(static_cast<std::size_t>(r.N) * r.E, 7), r.N, r.E);
  // The caller's sticky fault words [1, 3], carried across calls through *faults.
  auto fw = on(x, faults ? *faults : std::vector<int>(3, 0), 1, 3);
  const drop_shape shape{.max_tokens = r.N, .topk = r.k, .num_experts = r.E, .group = group};
  const std::size_t bytes = policy.template workspace_bytes<float>(shape);
  auto ws = exec_buffer<std::byte, Exec>::make(
      x, 1, static_cast<long long>(std::max<std::size_t>(bytes, 1)));
  REQUIRE(ws);
  using S = typename Exec::memory_space;
  auto dec =
      policy.apply(x, comm,
                   drop_input<float, S>{
                       .experts = ex.cview(),
                       .probs = pr.cview(),
                       .order_keys = keys.empty() ? row_view<const std::int64_t, S>{} : ky.cview()},
                   drop_output<S>{.keep = keep.view(),
                                  .kept = kept.view(),
                                  .routed = routed.view(),
                                  .dropped = dropped.view(),
                                  .padded = padded.view(),
                                  .totals = totals.view(),
                                  .filler_map = filler.view(),
                                  .faults = faults ? fw.view() : row_view<int, S>{}},
                   std::span<std::byte>(ws->view().data(), bytes));
  if (faults) *faults = back(x, fw.cview());
  if (!dec) return unexpected<error>(dec.error());
  decided d;
  d.keep = back(x, keep.cview());
  d.kept = back(x, kept.cview());
  d.routed = back(x, routed.cview());
  d.dropped = back(x, dropped.cview());
  d.padded = back(x, padded.cview());
  d.filler = back(x, filler.cview());
  const auto t = back(x, totals.cview());
  d.dropped_pairs = t[0];
  d.fully_dropped = t[1];
  d.capacity = dec->capacity;
  d.pad_rows = dec->pad_rows;
  return d;
}

void check_same(const decided& a, const decided& b) {
  CHECK(a.keep == b.keep);
  CHECK(a.kept == b.kept);
  CHECK(a.routed == b.routed);
  CHECK(a.dropped == b.dropped);
  CHECK(a.padded == b.padded);
  CHECK(a.dropped_pairs == b.dropped_pairs);
  CHECK(a.fully_dropped == b.fully_dropped);
  CHECK(a.capacity == b.capacity);
  CHECK(a.pad_rows == b.pad_rows);
  if (b.capacity) CHECK(a.filler == b.filler);  // dropless writes zeros, the host nothing
}

// A one-rank group for the local policies (never called).
struct no_group {};

}  // namespace

TEST_CASE("drop policies on host_exec and cpu_exec equal the host policies (local decisions)") {
  std::mt19937_64 rng(test::simt_seed() + 51);
  MESSAGE("seed " << test::simt_seed());
  host_exec host;
  cpu_exec cpu(rng());
  int compared = 0;
  for (int N : {1, 7, 40})
    for (int k : {1, 2, 4})
      for (int E : {4, 16}) {
        if (k > E) continue;
        const routing_case r = random_routing(N, k, E, rng);
        no_group g;
        CAPTURE(N);
        CAPTURE(k);
        CAPTURE(E);
        {
          const decided want = host_decision(dropless{}, g, r, {});
          check_same(context_decision(dropless{}, host, g, r, {}, 1).value(), want);
          check_same(context_decision(dropless{}, cpu, g, r, {}, 1).value(), want);
        }
        for (double cf : {0.5, 1.0, 1.5})
          for (bool pad : {false, true})
            for (drop_by by : {drop_by::probs, drop_by::position}) {
              const sub_sequence p{.capacity_factor = cf, .pad_to_capacity = pad, .by = by};
              CAPTURE(cf);
              CAPTURE(pad);
              CAPTURE(static_cast<int>(by));
              const auto cap = expert_capacity(static_cast<long long>(N) * k, E, cf).value();
              if (pad && cap > N) {  // both refuse: no expert can be padded to C
                CHECK(context_decision(p, host, g, r, {}, 1).error().code ==
                      errc::invalid_argument);
                CHECK(context_decision(p, cpu, g, r, {}, 1).error().code == errc::invalid_argument);
                continue;
              }
              const decided want = host_decision(p, g, r, {});
              check_same(context_decision(p, host, g, r, {}, 1).value(), want);
              check_same(context_decision(p, cpu, g, r, {}, 1).value(), want);
              ++compared;
            }
      }
  CHECK(compared > 50);
}

TEST_CASE(
    "full-sequence dropping on host_exec and cpu_exec equals the host policy over the group, and "
    "drop_policy_variant decides as the policy it holds") {
  std::mt19937_64 seed_rng(test::simt_seed() + 52);
  MESSAGE("seed " << test::simt_seed());
  for (int G : {2, 4})
    for (bool with_keys : {false, true})
      for (bool pad : {false, true}) {
        CAPTURE(G);
        CAPTURE(with_keys);
        CAPTURE(pad);
        const int N = 6, k = 2, E = 8;
        std::vector<routing_case> rc;
        for (int r = 0; r < G; ++r) rc.push_back(random_routing(N, k, E, seed_rng));
        const full_sequence p{.capacity_factor = 1.0, .pad_to_capacity = pad, .by = drop_by::probs};
        // Keys: sequence_order_keys with the ranks as a TP group (S_local 3, B 2).
        const auto keys_of = [&](int r) {
          if (!with_keys) return std::vector<std::int64_t>{};
          return sequence_order_keys({.tp_rank = r, .tp = G, .local_seq = 3, .batch = 2}).value();
        };
        // The variant holding each policy, on the same routings: full_sequence (collective),
        // then sub_sequence and dropless (local) against their host references.
        const sub_sequence sub{
            .capacity_factor = 1.0, .pad_to_capacity = pad, .by = drop_by::probs};
        const drop_policy_variant vp[] = {p, sub, dropless{}};
        const std::vector<std::int64_t> no_keys;
        using per_rank = std::vector<decided>;
        per_rank want(static_cast<std::size_t>(G)), got_h(want.size()), got_d(want.size());
        std::vector<per_rank> want_v(3, per_rank(want.size())), got_hv = want_v, got_dv = want_v;
        std::mutex m;
        const auto sh = run_thread_world(G, [&](thread_communicator& c) -> status {
          const int r = c.rank();
          const auto& rr = rc[static_cast<std::size_t>(r)];
          auto d = host_decision(p, c, rr, keys_of(r));
          host_exec x;
          auto h = context_decision(p, x, c, rr, keys_of(r), G);
          if (!h) return unexpected<error>(h.error());
          std::vector<decided> wv = {d, host_decision(sub, c, rr, {}),
                                     host_decision(dropless{}, c, rr, {})},
                               hv;
          for (std::size_t i = 0; i < 3; ++i) {  // keys are for full-sequence dropping only
            auto hvi = context_decision(vp[i], x, c, rr, i == 0 ? keys_of(r) : no_keys, G);
            if (!hvi) return unexpected<error>(hvi.error());
            hv.push_back(*hvi);
          }
          std::lock_guard lk(m);
          want[static_cast<std::size_t>(r)] = d;
          got_h[static_cast<std::size_t>(r)] = *h;
          for (std::size_t i = 0; i < 3; ++i) {
            want_v[i][static_cast<std::size_t>(r)] = wv[i];
            got_hv[i][static_cast<std::size_t>(r)] = hv[i];
          }
          return {};
        });
        const auto sd = run_thread_world(G, [&](thread_communicator& c) -> status {
          auto dw = std::move(c).in_space<cpu_device_space>();
          const int r = dw.rank();
          cpu_exec x(static_cast<std::uint64_t>(r) + 1);
          auto h = context_decision(p, x, dw, rc[static_cast<std::size_t>(r)], keys_of(r), G);
          if (!h) return unexpected<error>(h.error());
          std::vector<decided> dv;
          for (std::size_t i = 0; i < 3; ++i) {
            auto dvi = context_decision(vp[i], x, dw, rc[static_cast<std::size_t>(r)],
                                        i == 0 ? keys_of(r) : no_keys, G);
            if (!dvi) return unexpected<error>(dvi.error());
            dv.push_back(*dvi);
          }
          std::lock_guard lk(m);
          got_d[static_cast<std::size_t>(r)] = *h;
          for (std::size_t i = 0; i < 3; ++i) got_dv[i][static_cast<std::size_t>(r)] = dv[i];
          return {};
        });
        for (int r = 0; r < G; ++r) {
          CAPTURE(r);
          REQUIRE_MESSAGE(sh[static_cast<std::size_t>(r)].has_value(),
                          sh[static_cast<std::size_t>(r)].error().message);
          REQUIRE_MESSAGE(sd[static_cast<std::size_t>(r)].has_value(),
                          sd[static_cast<std::size_t>(r)].error().message);
          check_same(got_h[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)]);
          check_same(got_d[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)]);
          for (std::size_t i = 0; i < 3; ++i) {
            CAPTURE(i);
            check_same(got_hv[i][static_cast<std::size_t>(r)],
                       want_v[i][static_cast<std::size_t>(r)]);
            check_same(got_dv[i][static_cast<std::size_t>(r)],
                       want_v[i][static_cast<std::size_t>(r)]);
          }
        }
      }
}

TEST_CASE("drop policies on a context refuse bad routings and keys, naming the first bad one") {
  std::mt19937_64 rng(test::simt_seed() + 53);
  host_exec x;
  no_group g;
  routing_case r = random_routing(5, 2, 4, rng);
  // An expert outside [0, E) at pair 3 (token 1), then one named twice at token 3.
  routing_case bad = r;
  bad.experts[3] = 9;
  // The caller's sticky fault words take the first bad pair and keep it across later decisions
  // (how a GPU context, which reads nothing back, reports it), on both CPU contexts.
  const int none = kernels::order_fault_none;
  std::vector<int> faults = {none, none, none};
  const auto e1 = context_decision(sub_sequence{}, x, g, bad, {}, 1, &faults);
  REQUIRE_FALSE(e1);
  CHECK(e1.error().message.find("routing pair 3 (token 1)") != std::string::npos);
  CHECK(faults == std::vector<int>{3, none, none});
  REQUIRE(context_decision(sub_sequence{}, x, g, r, {}, 1, &faults));
  CHECK(faults == std::vector<int>{3, none, none});
  bad = r;
  bad.experts[7] = bad.experts[6];
  const auto e2 = context_decision(dropless{}, x, g, bad, {}, 1);
  REQUIRE_FALSE(e2);
  CHECK(e2.error().message.find("routing pair 7 (token 3)") != std::string::npos);
  // On device memory (cpu_exec stands for a GPU context) nothing is read back: the decision
  // returns, and the sticky words hold the first bad pair for the caller's device status.
  cpu_exec cx;
  std::vector<int> cpu_faults = {none, none, none};
  REQUIRE(context_decision(sub_sequence{}, cx, g, bad, {}, 1, &cpu_faults));
  CHECK(cpu_faults == std::vector<int>{7, none, none});
  REQUIRE(context_decision(sub_sequence{}, cx, g, r, {}, 1, &cpu_faults));
  CHECK(cpu_faults == std::vector<int>{7, none, none});
  // Keys for a local policy.
  const auto e3 = context_decision(sub_sequence{}, x, g, r, std::vector<std::int64_t>(5, 0), 1);
  REQUIRE_FALSE(e3);
  CHECK(e3.error().message.find("order keys are for full-sequence dropping") != std::string::npos);
  // Keys that are not a permutation of [0, M) over the group: every rank gets the same error.
  for (int which : {0, 1}) {
    CAPTURE(which);
    std::vector<std::string> msgs(2);
    std::vector<std::vector<int>> words(2);
    const auto st = run_thread_world(2, [&](thread_communicator& c) -> status {
      host_exec hx;
      std::vector<std::int64_t> keys = {0, 1, 2, 3, 4};
      for (auto& k : keys) k += 5 * c.rank();
      if (c.rank() == 1) keys[2] = which == 0 ? 12 : 3;  // outside [0, 10); key 3 twice, 7 none
      std::vector<int> f = {none, none, none};
      auto d = context_decision(full_sequence{}, hx, c, r, keys, 2, &f);
      msgs[static_cast<std::size_t>(c.rank())] = d ? "" : d.error().message;
      words[static_cast<std::size_t>(c.rank())] = f;
      return {};
    });
    for (const auto& s : st) REQUIRE(s.has_value());
    CHECK(msgs[0] == msgs[1]);
    // Both ranks' sticky words hold the group's faults: row 7's key outside [0, 10) (so key 7
    // is held by no row), or the key 3 held twice.
    const std::vector<int> want =
        which == 0 ? std::vector<int>{none, 7, 7} : std::vector<int>{none, none, 3};
    CHECK(words[0] == want);
    CHECK(words[1] == want);
    CHECK(msgs[0].find(which == 0 ? "the group's row 7 has a key outside it"
                                  : "the key 3 is held by no row or by two") != std::string::npos);
  }
  // One rank without keys: every rank refuses (the header), none hangs.
  std::vector<std::string> msgs(2);
  const auto st = run_thread_world(2, [&](thread_communicator& c) -> status {
    host_exec hx;
    std::vector<std::int64_t> keys;
    if (c.rank() == 0) keys = {0, 1, 2, 3, 4};
    auto d = context_decision(full_sequence{}, hx, c, r, keys, 2);
    msgs[static_cast<std::size_t>(c.rank())] = d ? "" : d.error().message;
    return {};
  });
  for (const auto& s : st) REQUIRE(s.has_value());
  CHECK(!msgs[0].empty());
  CHECK(!msgs[1].empty());
}

namespace {
// A user policy that keeps a given set of pairs (as the Megatron-Core reference test needs for
// drop-by-position, where torch chose the survivors): it writes the mask and the counts itself.
struct keep_given {
  std::vector<std::uint8_t> keep;  // [N * k] the pairs to keep
  template <class R>
  [[nodiscard]] std::size_t workspace_bytes(const drop_shape&) const {
    return 0;
  }
  template <class R, class Comm>
  [[nodiscard]] expected<drop_decision> apply(host_exec&, Comm&,
                                              const drop_input<R, host_space>& in,
                                              const drop_output<host_space>& out,
                                              std::span<std::byte>) const {
    const int E = out.routed.width();
    std::fill(out.routed.data(), out.routed.data() + E, 0);
    std::fill(out.dropped.data(), out.dropped.data() + E, 0);
    std::fill(out.padded.data(), out.padded.data() + E, 0);
    const long long pairs = static_cast<long long>(in.experts.rows()) * in.experts.width();
    long long dropped = 0;
    for (long long p = 0; p < pairs; ++p) {
      const int e = in.experts.data()[p];
      out.keep.data()[p] = keep[static_cast<std::size_t>(p)];
      out.kept.data()[p] = keep[static_cast<std::size_t>(p)] ? e : -1;
      ++out.routed.data()[e];
      if (!keep[static_cast<std::size_t>(p)]) ++out.dropped.data()[e], ++dropped;
    }
    out.totals.data()[0] = dropped;
    out.totals.data()[1] = 0;
    return drop_decision{};
  }
};
static_assert(drop_policy<keep_given, float, host_exec, no_group>);
static_assert(drop_policy<sub_sequence, float, cpu_exec, no_group>);
static_assert(drop_policy<full_sequence, double, host_exec, thread_communicator>);
}  // namespace

TEST_CASE("a user drop policy that keeps a given set of pairs models the concept") {
  std::mt19937_64 rng(test::simt_seed() + 54);
  const routing_case r = random_routing(6, 2, 4, rng);
  keep_given p;
  for (std::size_t i = 0; i < r.experts.size(); ++i) p.keep.push_back(i % 3 != 0 ? 1 : 0);
  host_exec x;
  no_group g;
  const decided d = context_decision(p, x, g, r, {}, 1).value();
  CHECK(d.keep == p.keep);
  for (std::size_t i = 0; i < r.experts.size(); ++i)
    CHECK(d.kept[i] == (p.keep[i] ? r.experts[i] : -1));
  CHECK(d.dropped_pairs == 4);
}
