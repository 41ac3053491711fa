//! @file drop_policy.hpp
//! @brief The drop-policy concept and what every policy shares: expert capacity, the keep rule
//! (drop_by probs or position, optional padding to capacity), and the report of what was dropped.
//! Semantics: docs/dispatch-semantics.md section 3.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../core/drop_by.hpp"
#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../routing/routing_view.hpp"
#include "../routing/topk_routing.hpp"
#include "expert_capacity.hpp"

namespace moefold {
inline namespace v0_1 {

//! What a policy dropped, per expert, for logging and tests.
struct drop_report {
  std::optional<int> capacity{};  //!< C per expert; unset when unbounded (dropless)
  std::vector<int> routed{};      //!< [E] pairs the router sent to each expert
  std::vector<int> dropped{};     //!< [E] routed pairs beyond capacity
  std::vector<int> padded{};      //!< [E] zero-probability filler rows (pad mode)
  long long dropped_pairs = 0;    //!< sum of dropped
  int fully_dropped_tokens = 0;   //!< tokens that lost all k experts
};

//! Where a policy writes what it decided, besides the keep mask: caller storage, so that a step
//! allocates nothing. `routed`, `dropped` and `padded` [E] are required; `filler_map` [N, E] is
//! optional (empty: not wanted) and marks the pad-mode filler rows, which Megatron-Core's dense
//! `routing_map` holds (tests compare it).
struct drop_counts {
  std::span<int> routed{};               //!< [E] pairs the router sent to each expert
  std::span<int> dropped{};              //!< [E] routed pairs beyond capacity
  std::span<int> padded{};               //!< [E] zero-probability filler rows (pad mode)
  std::span<std::uint8_t> filler_map{};  //!< [N, E] or empty: 1 where a filler row sits
  std::optional<int> capacity{};         //!< C per expert; unset when unbounded (dropless)
  //! Pad mode: the rows per expert the dispatcher pads this rank's column to (its kept pairs,
  //! then zero rows of probability 0, which contribute nothing: docs/dispatch-semantics.md 3.3),
  //! giving static shapes; unset without padding. Sub-sequence: C. Full-sequence: the group's C,
  //! because a rank may hold up to all C kept rows of a column (static shapes cost |TP x CP| x the
  //! rows). dispatch_input::capacity takes it.
  std::optional<int> pad_rows{};
  long long dropped_pairs = 0;   //!< sum of dropped
  int fully_dropped_tokens = 0;  //!< tokens that lost all k experts

  //! The rows expert e receives from this rank's tokens: kept pairs plus fillers (what
  //! Megatron-Core's post-drop map counts, and the expert bias learns from).
  [[nodiscard]] int dispatched(std::size_t e) const noexcept {
    return routed[e] - dropped[e] + padded[e];
  }
  //! An owning copy, for logging and tests (allocates).
  [[nodiscard]] drop_report to_report() const {
    return {.capacity = capacity,
            .routed = {routed.begin(), routed.end()},
            .dropped = {dropped.begin(), dropped.end()},
            .padded = {padded.begin(), padded.end()},
            .dropped_pairs = dropped_pairs,
            .fully_dropped_tokens = fully_dropped_tokens};
  }
};

//! drop_counts over a drop_report's vectors (resized to E; no allocation once they have grown).
[[nodiscard]] inline drop_counts counts_into(drop_report& r, int num_experts,
                                             std::span<std::uint8_t> filler_map = {}) {
  const auto E = static_cast<std::size_t>(num_experts < 0 ? 0 : num_experts);
  r.routed.resize(E);
  r.dropped.resize(E);
  r.padded.resize(E);
  return {.routed = r.routed, .dropped = r.dropped, .padded = r.padded, .filler_map = filler_map};
}

//! What a policy works in during one call, kept by the caller across calls: vectors that grow to
//! the largest step and are then reused, so the steady state allocates nothing. Contents are
//! dead between calls.
template <class T>
struct drop_scratch {
  std::vector<std::size_t> pairs{};      // [pairs] pair indices grouped by expert
  std::vector<std::size_t> col_start{};  // [E + 1] where each expert's pairs start in `pairs`
  std::vector<std::size_t> next{};       // [E] the next free place of each expert in `pairs`
  std::vector<std::size_t> by_order{};   // [rows] rows in true sequence order
  // Full-sequence: the gathered record of the TP x CP group, and the exchange's small arrays.
  std::vector<int> expert{};            // [group rows, k]
  std::vector<T> probs{};               // [group rows, k]
  std::vector<std::uint8_t> keep{};     // [group rows, k]
  std::vector<std::int64_t> keys{};     // [group rows]
  std::vector<long long> order{};       // [group rows] row -> rank in true order
  std::vector<int> header{};            // [4 * G]
  std::vector<int> rows{}, pairs_of{};  // [G] rows and pairs per rank
};

namespace detail {

//! Checks a routing record before a policy uses it: sizes, expert ids in range and distinct per
//! token, finite probabilities, a keep mask to write.
template <class T>
[[nodiscard]] status check_routing(const routing_view<T>& r) {
  if (r.num_tokens < 0 || r.num_experts < 1 || r.topk < 1 || r.topk > r.num_experts)
    return make_error(errc::invalid_size,
                      "routing: need num_tokens >= 0, 1 <= topk <= num_experts");
  if (r.pairs() > 0 && (r.expert == nullptr || r.probs == nullptr || r.keep == nullptr))
    return make_error(errc::shape_mismatch,
                      "routing: expert ids, probabilities and the keep mask must each hold "
                      "num_tokens*topk = " +
                          to_decimal(static_cast<long long>(r.pairs())) + " entries");
  const auto K = static_cast<std::size_t>(r.topk);
  for (std::size_t t = 0; t < static_cast<std::size_t>(r.num_tokens); ++t)
    for (std::size_t i = 0; i < K; ++i) {
      const int e = r.expert_of(t * K + i);
      if (e < 0 || e >= r.num_experts)
        return make_error(errc::invalid_argument,
                          "routing: token " + to_decimal(static_cast<long long>(t)) +
                              " has expert id " + to_decimal(e) + " outside [0, " +
                              to_decimal(r.num_experts) + ")");
      for (std::size_t j = 0; j < i; ++j)
        if (r.expert_of(t * K + j) == e)
          return make_error(errc::invalid_argument,
                            "routing: token " + to_decimal(static_cast<long long>(t)) +
                                " names expert " + to_decimal(e) + " twice");
      if (!std::isfinite(r.prob(t * K + i)))
        return make_error(errc::non_finite_input, "routing: token " +
                                                      to_decimal(static_cast<long long>(t)) +
                                                      " has a NaN or infinite probability");
    }
  return {};
}

//! A top-k routing's vectors hold N*k entries each.
template <class T>
[[nodiscard]] status check_routing_sizes(const topk_routing<T>& r) {
  if (r.num_tokens < 0 || r.topk < 1)
    return make_error(errc::invalid_size,
                      "routing: need num_tokens >= 0, 1 <= topk <= num_experts");
  const auto n = static_cast<std::size_t>(r.num_tokens) * static_cast<std::size_t>(r.topk);
  if (r.indices.size() != n || r.probs.size() != n)
    return make_error(errc::shape_mismatch,
                      "routing: indices and probs must hold num_tokens*topk = " +
                          to_decimal(static_cast<long long>(n)) + " entries");
  return {};
}

//! The count arrays hold E entries and the filler map is empty or [N, E].
[[nodiscard]] inline status check_counts(const drop_counts& c, int num_tokens, int num_experts) {
  const auto E = static_cast<std::size_t>(num_experts);
  if (c.routed.size() != E || c.dropped.size() != E || c.padded.size() != E ||
      (!c.filler_map.empty() && c.filler_map.size() != static_cast<std::size_t>(num_tokens) * E))
    return make_error(errc::shape_mismatch,
                      "drop counts: routed, dropped and padded must hold num_experts = " +
                          to_decimal(num_experts) +
                          " entries each, and filler_map num_tokens*num_experts or none");
  return {};
}

// Row t of the record names expert e.
template <class T>
[[nodiscard]] bool routes_to(const routing_view<T>& r, std::size_t t, int e) noexcept {
  const auto K = static_cast<std::size_t>(r.topk);
  for (std::size_t i = 0; i < K; ++i)
    if (r.expert_of(t * K + i) == e) return true;
  return false;
}

//! Counts of rows [first, first + count) of `r` from its keep mask: routed, dropped, dropped
//! pairs, fully dropped tokens; padded set to 0 and the filler map cleared.
template <class T>
void count_kept(const routing_view<T>& r, std::size_t first, std::size_t count, drop_counts& out) {
  const auto K = static_cast<std::size_t>(r.topk);
  std::fill(out.routed.begin(), out.routed.end(), 0);
  std::fill(out.dropped.begin(), out.dropped.end(), 0);
  std::fill(out.padded.begin(), out.padded.end(), 0);
  std::fill(out.filler_map.begin(), out.filler_map.end(), std::uint8_t{0});
  out.dropped_pairs = 0;
  out.fully_dropped_tokens = 0;
  for (std::size_t t = first; t < first + count; ++t) {
    std::size_t kept_pairs = 0;
    for (std::size_t i = 0; i < K; ++i) {
      const auto e = static_cast<std::size_t>(r.expert_of(t * K + i));
      ++out.routed[e];
      if (r.kept(t * K + i)) {
        ++kept_pairs;
      } else {
        ++out.dropped[e];
        ++out.dropped_pairs;
      }
    }
    if (kept_pairs == 0) ++out.fully_dropped_tokens;
  }
}

//! The keep rule, shared by every capacity policy, over the rows of `r` (one rank's, or the
//! gathered group's); `order[t]` is row t's rank in true sequence order (empty: row order). Per
//! expert: if at most C pairs are routed, all are kept; else `probs` keeps the C highest
//! probabilities (ties: earlier in order) and `position` the C earliest. Writes r.keep, then the
//! counts of rows [first, first + count) (this rank's, inside the group). With pad, the
//! lowest-order rows not routed to an expert fill its column to exactly C (C <= rows, checked by
//! the policies); those of this rank are counted in padded (and marked in filler_map).
template <class T>
void keep_within_capacity(const routing_view<T>& r, int capacity, drop_by by, bool pad,
                          std::span<const long long> order, std::size_t first, std::size_t count,
                          drop_counts& out, drop_scratch<T>& ws) {
  const auto N = static_cast<std::size_t>(r.num_tokens),
             E = static_cast<std::size_t>(r.num_experts), K = static_cast<std::size_t>(r.topk);
  const auto C = static_cast<std::size_t>(capacity);
  const auto ord = [&](std::size_t t) {
    return order.empty() ? static_cast<long long>(t) : order[t];
  };
  // The pairs grouped by expert (a counting sort: pair order kept inside an expert).
  ws.col_start.assign(E + 1, 0);
  for (std::size_t p = 0; p < N * K; ++p)
    ++ws.col_start[static_cast<std::size_t>(r.expert_of(p)) + 1];
  for (std::size_t e = 0; e < E; ++e) ws.col_start[e + 1] += ws.col_start[e];
  ws.pairs.resize(N * K);
  ws.next.assign(ws.col_start.begin(), ws.col_start.end() - 1);
  for (std::size_t p = 0; p < N * K; ++p)
    ws.pairs[ws.next[static_cast<std::size_t>(r.expert_of(p))]++] = p;
  std::fill(r.keep, r.keep + N * K, std::uint8_t{0});
  for (std::size_t e = 0; e < E; ++e) {
    const auto b = ws.pairs.begin() + ws.col_start[e], end = ws.pairs.begin() + ws.col_start[e + 1];
    auto last = end;
    if (static_cast<std::size_t>(end - b) > C) {
      // Pair order breaks the remaining ties, so this equals a stable sort.
      if (by == drop_by::probs)
        std::sort(b, end, [&](std::size_t x, std::size_t y) {
          if (r.prob(x) != r.prob(y)) return r.prob(x) > r.prob(y);
          if (ord(x / K) != ord(y / K)) return ord(x / K) < ord(y / K);
          return x < y;
        });
      else
        std::sort(b, end, [&](std::size_t x, std::size_t y) {
          if (ord(x / K) != ord(y / K)) return ord(x / K) < ord(y / K);
          return x < y;
        });
      last = b + static_cast<std::ptrdiff_t>(C);
    }
    for (auto it = b; it != last; ++it) r.keep[*it] = 1;
  }
  count_kept(r, first, count, out);
  if (!pad) return;
  // Rows in true order: order is a permutation of [0, N) (or the identity).
  ws.by_order.resize(N);
  for (std::size_t t = 0; t < N; ++t) ws.by_order[static_cast<std::size_t>(ord(t))] = t;
  for (std::size_t e = 0; e < E; ++e) {
    const auto routed = static_cast<std::size_t>(ws.col_start[e + 1] - ws.col_start[e]);
    std::size_t need = routed < C ? C - routed : 0;
    for (std::size_t j = 0; j < N && need > 0; ++j) {
      const std::size_t t = ws.by_order[j];
      if (routes_to(r, t, static_cast<int>(e))) continue;
      --need;
      if (t < first || t >= first + count) continue;
      ++out.padded[e];
      if (!out.filler_map.empty()) out.filler_map[(t - first) * E + e] = 1;
    }
  }
}

}  // namespace detail

//! counts[e] += the rows expert e received from this rank (kept pairs and fillers): the expert
//! bias's local_tokens_per_expert, as Megatron-Core sums its post-drop routing map.
[[nodiscard]] inline status add_dispatched_counts(const drop_counts& c, std::span<float> counts) {
  if (counts.size() != c.routed.size() || c.dropped.size() != c.routed.size() ||
      c.padded.size() != c.routed.size())
    return make_error(errc::shape_mismatch,
                      "dispatched counts: the counts and the drop counts must have num_experts "
                      "entries each");
  for (std::size_t e = 0; e < counts.size(); ++e) counts[e] += static_cast<float>(c.dispatched(e));
  return {};
}

//! Fills the counts (routed, dropped, dropped pairs, fully dropped tokens; no padding) from a
//! routing whose keep mask a policy has written, and sets the capacity: for user policies.
template <class T>
[[nodiscard]] status fill_drop_counts(const routing_view<T>& r, std::optional<int> capacity,
                                      drop_counts& out) {
  if (auto s = detail::check_counts(out, r.num_tokens, r.num_experts); !s) return s;
  detail::count_kept(r, 0, static_cast<std::size_t>(r.num_tokens), out);
  out.capacity = capacity;
  out.pad_rows.reset();
  return {};
}

}  // namespace v0_1
}  // namespace moefold
