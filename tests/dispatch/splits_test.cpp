// Split consistency over a whole simulated tp-ep group (docs/dispatch-semantics.md invariant 9),
// with the chunk counts checked against a direct count of which rows go where.
#include <moefold/dispatch/splits.hpp>

#include <doctest/doctest.h>

#include <numeric>
#include <random>
#include <vector>

using namespace moefold;
using namespace moefold::dispatch;  // the permutation, chunk-sort and split building blocks

namespace {
struct rank_splits {
  std::vector<int> in, out, out_tp, per_expert, chunks;
};
}  // namespace

TEST_CASE("splits are consistent across every rank of the tp-ep group") {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 60; ++trial) {
    const int ep = 1 + static_cast<int>(rng() % 5), etp = 1 + static_cast<int>(rng() % 3);
    const int L = 1 + static_cast<int>(rng() % 4), E = ep * L;
    const int ranks = ep * etp;
    // counts[rank][e]: rows the rank routes to expert e (zeros and empty ranks included).
    std::vector<int> counts(static_cast<std::size_t>(ranks * E));
    for (auto& c : counts) c = rng() % 4 == 0 ? 0 : static_cast<int>(rng() % 9);
    if (trial % 5 == 0)
      for (int e = 0; e < E; ++e) counts[static_cast<std::size_t>(e)] = 0;  // rank 0 routes nothing
    std::vector<rank_splits> s(static_cast<std::size_t>(ranks));
    for (int j = 0; j < ep; ++j)
      for (int t = 0; t < etp; ++t) {
        auto& r = s[static_cast<std::size_t>(j * etp + t)];
        r.in.resize(static_cast<std::size_t>(ep));
        r.out.resize(static_cast<std::size_t>(ep));
        r.out_tp.resize(static_cast<std::size_t>(etp));
        r.per_expert.resize(static_cast<std::size_t>(L));
        r.chunks.resize(static_cast<std::size_t>(etp * ep * L));
        REQUIRE(compute_splits({.ep = ep,
                                .etp = etp,
                                .num_experts = E,
                                .my_ep = j,
                                .my_etp = t,
                                .gathered_counts = counts},
                               {.input_splits = r.in,
                                .output_splits = r.out,
                                .output_splits_tp = r.out_tp,
                                .tokens_per_local_expert = r.per_expert,
                                .chunk_counts = r.chunks}));
      }
    long long global_local = 0, routed = 0;
    for (int c : counts) routed += c;
    for (int j = 0; j < ep; ++j)
      for (int t = 0; t < etp; ++t) {
        const auto& r = s[static_cast<std::size_t>(j * etp + t)];
        // sum(input_splits) = rows this rank routes.
        int mine = 0;
        for (int e = 0; e < E; ++e) mine += counts[static_cast<std::size_t>((j * etp + t) * E + e)];
        CHECK(std::accumulate(r.in.begin(), r.in.end(), 0) == mine);
        // output_splits[i] on rank j = input_splits[j] on EP rank i (same etp index).
        for (int i = 0; i < ep; ++i)
          CHECK(r.out[static_cast<std::size_t>(i)] ==
                s[static_cast<std::size_t>(i * etp + t)].in[static_cast<std::size_t>(j)]);
        // sum over ETP peers = rows the local experts compute.
        CHECK(std::accumulate(r.out_tp.begin(), r.out_tp.end(), 0) ==
              std::accumulate(r.per_expert.begin(), r.per_expert.end(), 0));
        // output_splits_tp[my etp] = what my own All-to-All received.
        CHECK(r.out_tp[static_cast<std::size_t>(t)] ==
              std::accumulate(r.out.begin(), r.out.end(), 0));
        // Chunk (u, i, l) = rows tp-ep rank (ep i, etp u) routes to my local expert l.
        for (int u = 0; u < etp; ++u)
          for (int i = 0; i < ep; ++i)
            for (int l = 0; l < L; ++l)
              CHECK(r.chunks[static_cast<std::size_t>((u * ep + i) * L + l)] ==
                    counts[static_cast<std::size_t>((i * etp + u) * E + j * L + l)]);
        for (int v : r.per_expert) global_local += v;
      }
    // Every routed row is computed once per ETP rank of its expert's owner.
    CHECK(global_local == routed * etp);
  }
}

TEST_CASE("bad split inputs are rejected") {
  std::vector<int> counts(8, 1), a(2), b(2), c(1), d(2), e(4);
  const split_view out{a, b, c, d, e};
  CHECK(compute_splits({.ep = 2, .etp = 1, .num_experts = 3, .gathered_counts = counts}, out)
            .error()
            .message.find("not divisible by ep") != std::string::npos);
  CHECK(compute_splits({.ep = 2, .etp = 1, .num_experts = 4, .my_ep = 2, .gathered_counts = counts},
                       out)
            .error()
            .code == errc::rank_out_of_range);
  CHECK(compute_splits({.ep = 2, .etp = 1, .num_experts = 4, .gathered_counts = {counts.data(), 7}},
                       out)
            .error()
            .code == errc::shape_mismatch);
  counts[3] = -1;
  CHECK(compute_splits({.ep = 2, .etp = 1, .num_experts = 4, .gathered_counts = counts}, out)
            .error()
            .code == errc::invalid_argument);
  counts[3] = 2147483647;
  CHECK(compute_splits({.ep = 2, .etp = 1, .num_experts = 4, .gathered_counts = counts}, out)
            .error()
            .code == errc::overflow);
  counts[3] = 1;
  REQUIRE(compute_splits({.ep = 2, .etp = 1, .num_experts = 4, .gathered_counts = counts}, out));
  CHECK(a == std::vector<int>{2, 2});
}
