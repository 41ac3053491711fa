// Full-sequence dropping's order kernels (kernels/sequence_order.hpp) on the CPU executor against
// the host reference ranking (sequence_order_keys, then tests/support/host_drop_policy.hpp:
// detail::rank_by_key, the sort full_sequence::apply runs): the group's keys of tp x cp layouts
// gathered in several rank orders, and random permutations (seed printed; MOEFOLD_TEST_SEED
// replays one), outputs poisoned before each launch. Bad keys (outside [0, M), repeated) are
// reported in the fault words, the order falls back to the identity, and the sticky word keeps
// the fault across a later good launch. Every launch also runs on host_exec on the same keys (and
// its own copy of the sticky word): the same order, inverse and fault words (integer kernels).
#include <doctest/doctest.h>

#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/kernels/sequence_order.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "../support/host_drop_policy.hpp"
#include "../support/simt_contexts.hpp"
#include "../support/simt_test_sizes.hpp"

using namespace moefold;

namespace {

constexpr int none = kernels::order_fault_none;

struct order_out {
  std::vector<long long> order, by_order;
  std::vector<int> fault;
};

void check_same(const order_out& got, const order_out& want) {
  CHECK(got.order == want.order);
  CHECK(got.by_order == want.by_order);
  CHECK(got.fault == want.fault);
}

// The three launches over keys [M] with a grid smaller than the rows (the loops stride), the
// outputs poisoned first; `sticky` is carried in and out. On `on` (cpu_exec seeded with seed,
// seed + 1, seed + 2).
order_out run_order_on(test::simt_on on, std::uint64_t seed, const std::vector<std::int64_t>& keys,
                       std::vector<int>& sticky) {
  const auto M = static_cast<long long>(keys.size());
  std::vector<int> counts(keys.size(), 0), fault{none, none};
  order_out o{std::vector<long long>(keys.size(), -7), std::vector<long long>(keys.size(), -7), {}};
  const kernels::order_key_args a{.keys = keys.data(),
                                  .rows = M,
                                  .counts = counts.data(),
                                  .fault = fault.data(),
                                  .sticky = sticky.data(),
                                  .order = o.order.data(),
                                  .by_order = o.by_order.data()};
  const launch_grid grid{.blocks = 2};
  REQUIRE(test::simt_launcher{on, seed}(grid, kernels::order_key_count_kernel{a}));
  REQUIRE(test::simt_launcher{on, seed + 1}(grid, kernels::order_key_check_kernel{a}));
  REQUIRE(test::simt_launcher{on, seed + 2}(grid, kernels::order_from_keys_kernel{a}));
  o.fault = fault;
  return o;
}

// The launches on cpu_exec (returned, `sticky` carried) and on host_exec with a copy of the
// sticky word: the same outputs and sticky word from both.
order_out run_order(std::uint64_t seed, const std::vector<std::int64_t>& keys,
                    std::vector<int>& sticky) {
  std::vector<int> host_sticky = sticky;
  const order_out cpu = run_order_on(test::simt_on::cpu_exec, seed, keys, sticky);
  const order_out host = run_order_on(test::simt_on::host_exec, seed, keys, host_sticky);
  INFO("host_exec against cpu_exec");
  check_same(host, cpu);
  CHECK(host_sticky == sticky);
  return cpu;
}

// The host policy's ranking of distinct keys, and its inverse.
void host_order(const std::vector<std::int64_t>& keys, std::vector<long long>& order,
                std::vector<long long>& by_order) {
  std::vector<std::size_t> by_key;
  REQUIRE(detail::rank_by_key(keys, by_key, order));
  by_order.assign(keys.size(), -1);
  for (std::size_t i = 0; i < order.size(); ++i)
    by_order[static_cast<std::size_t>(order[i])] = static_cast<long long>(i);
}

void check_good(std::uint64_t seed, const std::vector<std::int64_t>& keys) {
  std::vector<long long> want_order, want_by;
  host_order(keys, want_order, want_by);
  std::vector<int> sticky{none, none};
  const auto o = run_order(seed, keys, sticky);
  CHECK(o.fault == std::vector<int>{none, none});
  CHECK(sticky == std::vector<int>{none, none});
  CHECK(o.order == want_order);
  CHECK(o.by_order == want_by);
}

// Each rank of a tp x cp layout (local_seq tokens of batch sequences), in the group order
// `ranks` lists: the concatenation of their sequence_order_keys, as the layer gathers them.
std::vector<std::int64_t> group_keys(int tp, int cp, int local_seq, int batch,
                                     const std::vector<int>& ranks) {
  std::vector<std::int64_t> keys;
  for (int g : ranks) {
    auto k = sequence_order_keys({.tp_rank = g % tp,
                                  .tp = tp,
                                  .cp_rank = g / tp,
                                  .cp = cp,
                                  .local_seq = local_seq,
                                  .batch = batch});
    REQUIRE(k.has_value());
    keys.insert(keys.end(), k->begin(), k->end());
  }
  return keys;
}

}  // namespace

TEST_CASE("order kernels: the group's sequence keys ranked as the host policy ranks them") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  struct layout {
    int tp, cp, local_seq, batch;
  };
  const layout layouts[] = {{1, 1, 7, 1}, {2, 1, 5, 3}, {1, 2, 6, 2}, {2, 2, 4, 1}, {4, 2, 2, 3}};
  for (const auto& l : layouts) {
    CAPTURE(l.tp);
    CAPTURE(l.cp);
    CAPTURE(l.batch);
    std::vector<int> ranks(static_cast<std::size_t>(l.tp * l.cp));
    std::iota(ranks.begin(), ranks.end(), 0);
    for (int shuffle = 0; shuffle < 3; ++shuffle) {  // the group's rank order is the backend's
      check_good(rng(), group_keys(l.tp, l.cp, l.local_seq, l.batch, ranks));
      std::shuffle(ranks.begin(), ranks.end(), rng);
    }
  }
  // Random permutations of [0, M).
  const long long sizes[] = {1, 7, test::simt_reduced ? 64 : 513};
  for (long long M : sizes) {
    CAPTURE(M);
    std::vector<std::int64_t> keys(static_cast<std::size_t>(M));
    std::iota(keys.begin(), keys.end(), std::int64_t{0});
    std::shuffle(keys.begin(), keys.end(), rng);
    check_good(rng(), keys);
  }
}

TEST_CASE("order kernels: keys that are not a permutation of [0, M) are faults, order identity") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  const long long M = test::simt_reduced ? 40 : 300;
  std::vector<std::int64_t> good(static_cast<std::size_t>(M));
  std::iota(good.begin(), good.end(), std::int64_t{0});
  std::shuffle(good.begin(), good.end(), rng);
  std::vector<long long> identity(static_cast<std::size_t>(M));
  std::iota(identity.begin(), identity.end(), 0LL);
  // The lowest key value held by no row or by two.
  const auto missing_or_twice = [M](const std::vector<std::int64_t>& keys) {
    std::vector<int> n(static_cast<std::size_t>(M), 0);
    for (auto k : keys)
      if (k >= 0 && k < M) ++n[static_cast<std::size_t>(k)];
    for (long long j = 0; j < M; ++j)
      if (n[static_cast<std::size_t>(j)] != 1) return static_cast<int>(j);
    return none;
  };
  struct bad {
    const char* what;
    long long row;
    std::int64_t key;
  };
  const bad cases[] = {{"repeated", 17, -2},
                       {"negative", 5, -1},
                       {"M", M - 1, M},
                       {"huge", 0, std::int64_t{1} << 40}};
  for (const auto& b : cases) {
    CAPTURE(b.what);
    auto keys = good;
    // -2: a copy of another row's key (a repeat); otherwise the key itself.
    keys[static_cast<std::size_t>(b.row)] = b.key == -2 ? keys[3] : b.key;
    const int want_row =
        (keys[static_cast<std::size_t>(b.row)] < 0 || keys[static_cast<std::size_t>(b.row)] >= M)
            ? static_cast<int>(b.row)
            : none;
    std::vector<int> sticky{none, none};
    const auto o = run_order(rng(), keys, sticky);
    const std::vector<int> want{want_row, missing_or_twice(keys)};
    CHECK(want[1] != none);  // a bad key always leaves a value missing
    CHECK(o.fault == want);
    CHECK(sticky == want);
    CHECK(o.order == identity);
    CHECK(o.by_order == identity);
    // A later good launch orders by its keys and leaves the sticky fault for the host to read.
    const auto after = run_order(rng(), good, sticky);
    CHECK(after.fault == std::vector<int>{none, none});
    CHECK(sticky == want);
    std::vector<long long> want_order, want_by;
    host_order(good, want_order, want_by);
    CHECK(after.order == want_order);
  }
}
