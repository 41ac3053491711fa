// The permutation plan builder as kernels (kernels/permute_plan.hpp) on the CPU executor against
// the host builder (dispatch/permute.hpp, permute_plan::make) on fresh random routing records
// (seed printed): counts, offsets, row_slot and slot_row equal entry for entry, without padding
// and in pad mode with one or several sources (empty ones included); experts empty, one expert
// taking every pair, dropped pairs, every pair dropped; a record with an id outside [-1, E), a
// token naming an expert twice, and pad mode beyond capacity give the lowest offending slot,
// where the host builder refuses the same record. Every run of the four kernels also runs on
// host_exec (a team of one for the tile kernels) on the same record: the same plan and faults,
// entry for entry (integer kernels). The builders' tests (cpu_exec's build_permute_plan and
// enqueue_permute_plan, which launch these kernels) compare cpu_exec with the host builder, which
// is what host_exec's build_permute_plan runs.
#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <moefold/dispatch/permute.hpp>
#include <moefold/dispatch/plan_builders.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/kernels/permute_plan.hpp>
#include <moefold/kernels/record_pair.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "../support/simt_contexts.hpp"
#include "../support/simt_test_sizes.hpp"

using namespace moefold;
namespace k = moefold::kernels;

namespace {

struct device_plan {
  std::vector<int> counts, offsets, row_slot, slot_row;
  int fault_id = INT_MAX, fault_capacity = INT_MAX;
};

// The four launches over the record on `on` (cpu_exec: a fresh seed for each).
device_plan run_kernels_on(test::simt_on on, const std::vector<int>& expert, int N, int K, int E,
                           std::optional<int> capacity, const std::vector<int>& source_tokens,
                           int rows, std::mt19937_64& rng) {
  const auto run = [&](const launch_grid& g, const auto& kernel) {
    REQUIRE(test::simt_launcher{on, rng()}(g, kernel));
  };
  device_plan p;
  const long long slots = static_cast<long long>(N) * K;
  std::vector<int> tile_counts(static_cast<std::size_t>(k::plan_args::tiles_of(slots)) * E + 1, -9);
  p.counts.assign(static_cast<std::size_t>(E), -9);
  p.offsets.assign(static_cast<std::size_t>(E) + 1, -9);
  p.row_slot.assign(static_cast<std::size_t>(rows), -9);
  p.slot_row.assign(static_cast<std::size_t>(slots), -9);
  std::vector<int> fault = {INT_MAX, INT_MAX};
  std::vector<int> source_first;
  if (source_tokens.size() > 1) {
    source_first.push_back(0);
    for (int n : source_tokens) source_first.push_back(source_first.back() + n);
  }
  const k::plan_args a{
      .expert = expert.data(),
      .num_tokens = N,
      .topk = K,
      .num_experts = E,
      .capacity = capacity.value_or(-1),
      .num_sources = static_cast<int>(std::max<std::size_t>(source_tokens.size(), 1)),
      .source_first = source_first.empty() ? nullptr : source_first.data(),
      .rows = rows,
      .tile_counts = tile_counts.data(),
      .counts = p.counts.data(),
      .offsets = p.offsets.data(),
      .row_slot = p.row_slot.data(),
      .slot_row = p.slot_row.data(),
      .fault = fault.data()};
  const int tiles = static_cast<int>(std::max<long long>(a.tiles(), 1));
  run(launch_grid{.blocks = std::min(tiles, 3),
                  .smem_bytes = k::plan_tile_counts_kernel::smem_bytes(E)},
      k::plan_tile_counts_kernel{a});
  run(launch_grid{.blocks = 2}, k::plan_tile_scan_kernel{a});
  run(launch_grid{.blocks = 2}, k::plan_offsets_kernel{a});
  run(launch_grid{.blocks = std::min(tiles, 3), .smem_bytes = k::plan_rows_kernel::smem_bytes},
      k::plan_rows_kernel{a});
  p.fault_id = fault[0];
  p.fault_capacity = fault[1];
  return p;
}

// The four launches on cpu_exec (returned) and on host_exec: the same plan and faults from both.
device_plan run_kernels(const std::vector<int>& expert, int N, int K, int E,
                        std::optional<int> capacity, const std::vector<int>& source_tokens,
                        int rows, std::mt19937_64& rng) {
  const device_plan cpu =
      run_kernels_on(test::simt_on::cpu_exec, expert, N, K, E, capacity, source_tokens, rows, rng);
  const device_plan host =
      run_kernels_on(test::simt_on::host_exec, expert, N, K, E, capacity, source_tokens, rows, rng);
  INFO("host_exec against cpu_exec");
  CHECK(host.counts == cpu.counts);
  CHECK(host.offsets == cpu.offsets);
  CHECK(host.row_slot == cpu.row_slot);
  CHECK(host.slot_row == cpu.slot_row);
  CHECK(host.fault_id == cpu.fault_id);
  CHECK(host.fault_capacity == cpu.fault_capacity);
  return cpu;
}

// A record: each token names min(k, E) distinct experts drawn with a skew (expert 0 favoured
// when skewed), a share of the pairs dropped (-1).
std::vector<int> random_record(int N, int K, int E, double drop, bool skew, std::mt19937_64& rng) {
  std::vector<int> ex(static_cast<std::size_t>(N) * K, -1);
  std::vector<int> perm(static_cast<std::size_t>(E));
  std::uniform_real_distribution<double> u(0, 1);
  for (int t = 0; t < N; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    if (skew) std::iter_swap(perm.begin(), std::find(perm.begin(), perm.end(), 0));
    for (int j = 0; j < std::min(K, E); ++j)
      ex[static_cast<std::size_t>(t) * K + j] =
          u(rng) < drop ? -1 : perm[static_cast<std::size_t>(j)];
  }
  return ex;
}

}  // namespace

TEST_CASE("permutation plan kernels: the host builder's plan, entry for entry") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  // N 1 and 300 (1, 2 and 10 tiles of pairs at k 1, 2, 8); under TSan E 8 only.
  const std::vector<int> Ns = {1, 300};
  const std::vector<int> Es =
      test::simt_reduced ? std::vector<int>{8} : std::vector<int>{1, 8, 256};
  long plans = 0;
  for (int N : Ns)
    for (int E : Es)
      for (int K : {1, 2, 8})
        for (int mode = 0; mode < 3; ++mode) {  // 0 no padding, 1 pad, 2 pad over 3 sources
          CAPTURE(N);
          CAPTURE(E);
          CAPTURE(K);
          CAPTURE(mode);
          const double drop = (N + E + K + mode) % 4 == 0 ? 1.0 : 0.2;  // sometimes all dropped
          const auto ex = random_record(N, K, E, drop, mode == 1, rng);
          std::vector<int> sources;
          if (mode == 2) sources = {N / 2, 0, N - N / 2};  // an empty source in between
          // Pad mode: a capacity every (expert, source) fits (the largest count), so that the
          // host builds a plan; overflow has its own case below.
          std::optional<int> cap;
          if (mode > 0) {
            int most = 0;
            std::vector<int> per(static_cast<std::size_t>(E) * 3, 0);
            int t0 = 0;
            for (std::size_t src = 0; src < std::max<std::size_t>(sources.size(), 1); ++src) {
              const int t1 = sources.empty() ? N : t0 + sources[src];
              for (int t = t0; t < t1; ++t)
                for (int j = 0; j < K; ++j) {
                  const int e = ex[static_cast<std::size_t>(t) * K + j];
                  if (e >= 0) most = std::max(most, ++per[src * E + static_cast<std::size_t>(e)]);
                }
              t0 = t1;
            }
            cap = most + (N % 2);
          }
          const permute_args pa{.num_tokens = N,
                                .topk = K,
                                .num_experts = E,
                                .expert = ex,
                                .capacity = cap,
                                .num_sources = mode == 2 ? 3 : 1,
                                .source_tokens = sources};
          std::vector<std::byte> ws(permute_plan::workspace_bytes(pa));
          auto host = permute_plan::make(pa, ws);
          REQUIRE(host);
          const auto dev = run_kernels(ex, N, K, E, cap, sources, host->num_rows(), rng);
          CHECK(dev.fault_id == INT_MAX);
          CHECK(dev.fault_capacity == INT_MAX);
          CHECK(std::equal(dev.counts.begin(), dev.counts.end(), host->counts().begin()));
          CHECK(std::equal(dev.offsets.begin(), dev.offsets.end(), host->offsets().begin()));
          CHECK(std::equal(dev.row_slot.begin(), dev.row_slot.end(), host->row_slot().begin()));
          CHECK(std::equal(dev.slot_row.begin(), dev.slot_row.end(), host->slot_row().begin()));
          ++plans;
        }
  MESSAGE(plans << " plans compared");
}

TEST_CASE("permutation plan kernels: a bad record gives its lowest offending slot") {
  std::mt19937_64 rng(test::simt_seed() + 7);
  const int N = 300, K = 4, E = 16;
  auto ex = random_record(N, K, E, 0.1, false, rng);
  auto refused = [&](const std::vector<int>& rec, std::optional<int> cap) {
    const permute_args pa{
        .num_tokens = N, .topk = K, .num_experts = E, .expert = rec, .capacity = cap};
    std::vector<std::byte> ws(permute_plan::workspace_bytes(pa));
    return !permute_plan::make(pa, ws);
  };
  SUBCASE("an id outside [-1, E) and a repeated expert: the lower slot") {
    auto bad = ex;
    bad[4 * 200 + 2] = E;  // slot 802: out of range
    // Token 290 names expert 5 in slots 0 and 3: slot 1163 repeats it (-1 twice is no repeat).
    bad[4 * 290 + 0] = bad[4 * 290 + 3] = 5;
    bad[4 * 290 + 1] = bad[4 * 290 + 2] = -1;
    CHECK(refused(bad, std::nullopt));
    const auto dev = run_kernels(bad, N, K, E, std::nullopt, {}, N * K, rng);
    CHECK(dev.fault_id == 802);
    // A faulty record gets no rows (ranks past a repeat would collide).
    const auto none = [](const std::vector<int>& v) {
      return std::all_of(v.begin(), v.end(), [](int r) { return r == -1; });
    };
    CHECK(none(dev.slot_row));
    CHECK(none(dev.row_slot));
    bad[4 * 200 + 2] = -2;  // -2 is outside too
    CHECK(run_kernels(bad, N, K, E, std::nullopt, {}, N * K, rng).fault_id == 802);
    bad[4 * 200 + 2] = -1;
    const auto repeat = run_kernels(bad, N, K, E, std::nullopt, {}, N * K, rng);
    CHECK(repeat.fault_id == 4 * 290 + 3);
    CHECK(none(repeat.slot_row));
    CHECK(none(repeat.row_slot));
  }
  SUBCASE("pad mode beyond capacity: the first pair over it") {
    // Expert 3 in slot 0 of tokens 10, 50, 90, ...: with capacity 2 the third (token 90) is over.
    for (int t = 0; t < N; ++t)
      for (int j = 0; j < K; ++j)
        if (ex[static_cast<std::size_t>(t) * K + j] == 3)
          ex[static_cast<std::size_t>(t) * K + j] = -1;
    for (int t = 10; t < N; t += 40) ex[static_cast<std::size_t>(t) * K] = 3;
    std::vector<int> capped = ex;  // the others dropped, so only expert 3 can overflow
    for (auto& e : capped)
      if (e != 3) e = -1;
    CHECK(refused(capped, 2));
    const auto dev = run_kernels(capped, N, K, E, 2, {}, 2 * E, rng);
    CHECK(dev.fault_capacity == 90 * K);
    CHECK(dev.fault_id == INT_MAX);
  }
}

TEST_CASE(
    "the record rule (kernels/record_pair.hpp): one verdict for the host builder and the "
    "kernels, on every token of three slots") {
  // Every token [3] over ids -2..3 with E = 3: the rule written out independently (an id outside
  // [-1, E), or an expert an earlier slot of its token named), then bad_record_pair, the host
  // builder's refusal and the plan kernels' lowest bad slot, all against it.
  const int K = 3, E = 3;
  std::mt19937_64 rng(test::simt_seed() + 11);
  int bad_tokens = 0;
  for (int code = 0; code < 6 * 6 * 6; ++code) {
    const std::vector<int> tok = {code % 6 - 2, code / 6 % 6 - 2, code / 36 - 2};
    int first_bad = INT_MAX;
    for (int j = K - 1; j >= 0; --j) {
      const int e = tok[static_cast<std::size_t>(j)];
      const bool repeated = e >= 0 && std::find(tok.begin(), tok.begin() + j, e) != tok.begin() + j;
      const bool bad = e < -1 || e >= E || repeated;
      CAPTURE(code);
      CAPTURE(j);
      CHECK(k::bad_record_pair(tok.data(), j, K, E) == bad);
      if (bad) first_bad = j;
    }
    bad_tokens += first_bad != INT_MAX ? 1 : 0;
    const permute_args pa{.num_tokens = 1, .topk = K, .num_experts = E, .expert = tok};
    std::vector<std::byte> ws(permute_plan::workspace_bytes(pa));
    CHECK(static_cast<bool>(permute_plan::make(pa, ws)) == (first_bad == INT_MAX));
    CHECK(run_kernels(tok, 1, K, E, std::nullopt, {}, K, rng).fault_id == first_bad);
  }
  // Good tokens use ids -1..2 with no expert twice: by the number of -1 slots (3, 2, 1, 0),
  // 1 + 3 * 3 + 3 * (3 * 2) + 3 * 2 * 1.
  CHECK(bad_tokens == 216 - (1 + 9 + 18 + 6));
}

TEST_CASE("cpu_exec's build_permute_plan runs the kernels: the host builder's plans and errors") {
  std::mt19937_64 rng(test::simt_seed() + 11);
  const int N = 90, K = 4, E = 16;
  const std::vector<int> sources = {30, 0, 60};
  using S = cpu_exec::memory_space;
  cpu_exec x(rng());
  // Host and cpu_exec builders on one record: equal plans, or the same error message.
  auto both = [&](const std::vector<int>& rec, std::optional<int> cap, bool several) {
    const permute_args pa{
        .num_tokens = N,
        .topk = K,
        .num_experts = E,
        .expert = rec,
        .capacity = cap,
        .num_sources = several ? 3 : 1,
        .source_tokens = several ? std::span<const int>(sources) : std::span<const int>()};
    std::vector<std::byte> ws(permute_plan::workspace_bytes(pa)), dws(ws.size());
    auto host = permute_plan::make(pa, ws);
    const plan_input<S> in{.num_tokens = N,
                           .topk = K,
                           .num_experts = E,
                           .expert = row_view<const int, S>(rec.data(), N, K),
                           .capacity = cap,
                           .num_sources = pa.num_sources,
                           .source_tokens = pa.source_tokens};
    x.reset_copies();
    auto dev = build_permute_plan(x, in, dws);
    REQUIRE(host.has_value() == dev.has_value());
    // The builder reads back only through the context's copies: the status row (counts and
    // faults), and on an error the record for the message's words.
    CHECK(x.copies().to_host == (host ? 1 : 2));
    // Nothing goes to the context by copy: each source's first token is stored by a kernel
    // carrying the values (store_host_values), and the plan below equals the host's.
    CHECK(x.copies().to_device == 0);
    if (!host) {
      CHECK(host.error().message == dev.error().message);
      return host.error().message;
    }
    CHECK(host->num_rows() == dev->num_rows());
    const std::vector<int> a(host->slot_row().begin(), host->slot_row().end());
    CHECK(std::equal(a.begin(), a.end(), dev->slot_rows().data()));
    CHECK(std::equal(host->row_slot().begin(), host->row_slot().end(), dev->row_slots().data()));
    for (int e = 0; e <= E; ++e) CHECK(host->offset(e) == dev->offset(e));
    return std::string();
  };
  auto rec = random_record(N, K, E, 0.2, true, rng);
  CHECK(both(rec, std::nullopt, false).empty());
  CHECK(both(rec, 90, false).empty());
  CHECK(both(rec, 60, true).empty());
  // Expert 0 is every token's first choice (skewed): 3 pairs per source fit nowhere.
  CHECK(both(rec, 3, true).find("from source 0, more than the capacity 3") != std::string::npos);
  auto late = rec;  // only the third source's tokens overflow expert 0
  for (int t = 0; t < 30; ++t) late[static_cast<std::size_t>(t) * K] = -1;
  CHECK(both(late, 20, true).find("from source 2, more than the capacity 20") != std::string::npos);
  auto bad = rec;
  bad[7 * K + 1] = E + 3;
  CHECK(both(bad, std::nullopt, false).find("token 7 slot 1 names expert 19") != std::string::npos);
  bad[7 * K + 1] = bad[7 * K + 2] = 2;
  bad[7 * K + 0] = bad[7 * K + 3] = -1;
  CHECK(both(bad, std::nullopt, false).find("token 7 names expert 2 twice") != std::string::npos);
}

TEST_CASE(
    "enqueue_permute_plan reads nothing back; resolve_permute_plan completes it from its status "
    "row") {
  std::mt19937_64 rng(test::simt_seed() + 12);
  const int N = 70, K = 2, E = 8;
  using S = cpu_exec::memory_space;
  cpu_exec x(rng());
  auto rec = random_record(N, K, E, 0.3, false, rng);
  for (const std::optional<int> cap : {std::optional<int>(), std::optional<int>(N)}) {
    CAPTURE(cap.has_value());
    const permute_args pa{
        .num_tokens = N, .topk = K, .num_experts = E, .expert = rec, .capacity = cap};
    std::vector<std::byte> ws(permute_plan::workspace_bytes(pa)), dws(ws.size());
    auto host = permute_plan::make(pa, ws);
    REQUIRE(host);
    const plan_input<S> in{.num_tokens = N,
                           .topk = K,
                           .num_experts = E,
                           .expert = row_view<const int, S>(rec.data(), N, K),
                           .capacity = cap};
    x.reset_copies();
    auto dev = enqueue_permute_plan(x, in, dws);
    REQUIRE(dev);
    CHECK(x.copies().to_host == 0);
    // Dropless: the rows are bounded by N k until the counts are known; pad mode: exact.
    CHECK(dev->num_rows() == (cap ? host->num_rows() : N * K));
    std::vector<int> status(static_cast<std::size_t>(E) + 2);
    REQUIRE(x.copy(dev->status_row(), row_view<int>(status.data(), 1, E + 2)));
    CHECK(std::equal(host->counts().begin(), host->counts().end(), status.begin()));
    CHECK(status[E] == INT_MAX);
    CHECK(status[E + 1] == INT_MAX);
    REQUIRE(resolve_permute_plan(x, in, *dev, status));
    CHECK(dev->num_rows() == host->num_rows());
    CHECK(std::equal(host->row_slot().begin(), host->row_slot().end(), dev->row_slots().data()));
    // The host builder's status row says the same (no faults), so a dispatcher can gather it on
    // every context.
    host_exec hx;
    const auto hs = host->status_row();
    CHECK(std::equal(hs.data(), hs.data() + E + 2, status.begin()));
    CHECK(
        resolve_permute_plan(hx,
                             plan_input<host_space>{.num_tokens = N,
                                                    .topk = K,
                                                    .num_experts = E,
                                                    .expert = row_view<const int>(rec.data(), N, K),
                                                    .capacity = cap},
                             *host, std::span<const int>(hs.data(), E + 2)));
    // A faulty record: no rows, the fault in the status row, the host builder's error on resolve.
    auto bad = rec;
    bad[5 * K + 1] = bad[5 * K];
    if (bad[5 * K] < 0) bad[5 * K] = bad[5 * K + 1] = 3;
    const plan_input<S> bin{.num_tokens = N,
                            .topk = K,
                            .num_experts = E,
                            .expert = row_view<const int, S>(bad.data(), N, K),
                            .capacity = cap};
    auto faulty = enqueue_permute_plan(x, bin, dws);
    REQUIRE(faulty);
    REQUIRE(x.copy(faulty->status_row(), row_view<int>(status.data(), 1, E + 2)));
    CHECK(status[E] == 5 * K + 1);
    for (int s = 0; s < N * K; ++s) CHECK(faulty->slot_rows().data()[s] == -1);
    const auto st = resolve_permute_plan(x, bin, *faulty, status);
    REQUIRE_FALSE(st);
    CHECK(st.error().message.find("token 5 names expert") != std::string::npos);
    CHECK(st.error().message.find("twice") != std::string::npos);
    // A status row of the wrong size is refused.
    CHECK_FALSE(resolve_permute_plan(x, in, *dev, std::span<const int>(status.data(), 3)));
  }
}
