//! @file host_drop_policy.hpp
//! @brief The drop policies' host reference (tests only): the keep rule of
//! docs/dispatch-semantics.md section 3 as plain loops over one routing record (a counting sort
//! by expert, std::sort for the drop order, a scan for pad mode's fillers), for dropless,
//! sub_sequence and full_sequence (the tp-cp group's record gathered with the communicator's host
//! collectives, keys ranked by std::sort), and Megatron-Core's dense form of a decision
//! (`drop_result`: final_map and final_probs [N, E]). The library decides on a context
//! (dispatch/capacity_keep.hpp); the tests hold that against this, and this against the rules.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <moefold/comm/communicator.hpp>
#include <moefold/core/drop_by.hpp>
#include <moefold/core/error.hpp>
#include <moefold/core/expected.hpp>
#include <moefold/dispatch/drop_counts.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/dispatch/expert_capacity.hpp>
#include <moefold/routing/topk_routing.hpp>

#include "routing_view.hpp"

namespace moefold {
inline namespace v0_1 {

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

//! order[i] = the rank of keys[i] among all keys (its place in true sequence order); two equal
//! keys are an error. `by_key` is scratch.
[[nodiscard]] inline status rank_by_key(std::span<const std::int64_t> keys,
                                        std::vector<std::size_t>& by_key,
                                        std::vector<long long>& order) {
  by_key.resize(keys.size());
  std::iota(by_key.begin(), by_key.end(), std::size_t{0});
  std::sort(by_key.begin(), by_key.end(), [&](std::size_t a, std::size_t b) {
    return keys[a] != keys[b] ? keys[a] < keys[b] : a < b;
  });
  order.resize(keys.size());
  for (std::size_t i = 0; i < by_key.size(); ++i) {
    if (i > 0 && keys[by_key[i]] == keys[by_key[i - 1]])
      return make_error(errc::invalid_argument,
                        "full_sequence: two tokens of the group have the same order key " +
                            to_decimal(static_cast<long long>(keys[by_key[i]])));
    order[by_key[i]] = static_cast<long long>(i);
  }
  return {};
}

//! The communicator argument of a local policy's dense form (ignored).
struct no_comm {};

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

//! The reference decisions: each writes r.keep and this rank's counts (see
//! detail::keep_within_capacity), and the policy's capacity and pad rows.
template <class T>
[[nodiscard]] status host_apply(const dropless&, const routing_view<T>& r, drop_counts& out,
                                drop_scratch<T>&) {
  if (auto s = detail::check_routing(r); !s) return s;
  if (auto s = detail::check_counts(out, r.num_tokens, r.num_experts); !s) return s;
  std::fill(r.keep, r.keep + r.pairs(), std::uint8_t{1});
  detail::count_kept(r, 0, static_cast<std::size_t>(r.num_tokens), out);
  out.capacity.reset();
  out.pad_rows.reset();
  return {};
}
template <class T>
[[nodiscard]] status host_apply(const sub_sequence& p, const routing_view<T>& r, drop_counts& out,
                                drop_scratch<T>& ws) {
  if (auto s = detail::check_routing(r); !s) return s;
  if (auto s = detail::check_counts(out, r.num_tokens, r.num_experts); !s) return s;
  auto c = expert_capacity(static_cast<long long>(r.num_tokens) * r.topk, r.num_experts,
                           p.capacity_factor);
  if (!c) return unexpected<error>(c.error());
  if (p.pad_to_capacity && *c > r.num_tokens)
    return make_error(errc::invalid_argument,
                      "pad_to_capacity: capacity " + detail::to_decimal(*c) + " exceeds the " +
                          detail::to_decimal(r.num_tokens) +
                          " tokens, so no expert can be padded to it (lower capacity_factor "
                          "to at most num_experts/topk)");
  detail::keep_within_capacity(r, *c, p.by, p.pad_to_capacity, {}, 0,
                               static_cast<std::size_t>(r.num_tokens), out, ws);
  out.capacity = *c;
  out.pad_rows = p.pad_to_capacity ? std::optional<int>(*c) : std::nullopt;
  return {};
}
template <class C, class T>
[[nodiscard]] status host_apply(const dropless& p, C&, std::span<const std::int64_t>,
                                const routing_view<T>& r, drop_counts& out, drop_scratch<T>& ws) {
  return host_apply(p, r, out, ws);
}
template <class C, class T>
[[nodiscard]] status host_apply(const sub_sequence& p, C&, std::span<const std::int64_t>,
                                const routing_view<T>& r, drop_counts& out, drop_scratch<T>& ws) {
  return host_apply(p, r, out, ws);
}

//! `order_keys` [N]: the true sequence-order key of each local token (sequence_order_keys), or
//! empty to take the group's rank order (rank 0's tokens first) as the sequence order; all ranks
//! must agree on which. Collective over tp_cp: every rank calls it, and every rank gets the same
//! error when one rank's input is bad. Writes r.keep and the counts of this rank's tokens;
//! `ws` holds the group's gathered record between calls (no allocation once grown).
template <communicator C, class T>
[[nodiscard]] status host_apply(const full_sequence& p, C& tp_cp,
                                std::span<const std::int64_t> order_keys, const routing_view<T>& r,
                                drop_counts& out, drop_scratch<T>& ws) {
  using detail::to_decimal;
  // 1. Exchange a small header: shape, whether keys are given, whether the local input is good.
  const bool keys_ok =
      order_keys.empty() || order_keys.size() == static_cast<std::size_t>(r.num_tokens);
  const status input = !keys_ok ? status(make_error(errc::shape_mismatch,
                                                    "full_sequence: order_keys must be empty or "
                                                    "have num_tokens entries"))
                                : detail::check_routing(r);
  // Initialized, not assigned: nvcc warns on the discarded result of an assignment of status.
  const status local = input ? detail::check_counts(out, r.num_tokens, r.num_experts) : input;
  const int G = tp_cp.size();
  const int hdr[4] = {local ? r.num_tokens : -1, r.num_experts, r.topk, order_keys.empty() ? 0 : 1};
  ws.header.resize(static_cast<std::size_t>(4 * G));
  if (auto s = tp_cp.all_gather(std::span<const int>(hdr, 4), std::span<int>(ws.header)); !s)
    return s;
  if (!local) return local;
  ws.rows.resize(static_cast<std::size_t>(G));
  ws.pairs_of.resize(static_cast<std::size_t>(G));
  long long total = 0, offset = 0;
  for (int g = 0; g < G; ++g) {
    const int* h = ws.header.data() + 4 * g;
    if (h[0] < 0)
      return make_error(errc::invalid_argument, "full_sequence: rank " + detail::to_decimal(g) +
                                                    " of the group has bad input");
    if (h[1] != r.num_experts || h[2] != r.topk || h[3] != hdr[3])
      return make_error(errc::comm_mismatch,
                        "full_sequence: ranks disagree on num_experts, topk or whether order "
                        "keys are given (rank " +
                            detail::to_decimal(g) + ")");
    ws.rows[static_cast<std::size_t>(g)] = h[0];
    if (g < tp_cp.rank()) offset += h[0];
    total += h[0];
  }
  if (total * r.topk > INT_MAX)
    return make_error(errc::overflow, "full_sequence: the group's routed pairs overflow int");
  for (int g = 0; g < G; ++g)
    ws.pairs_of[static_cast<std::size_t>(g)] = ws.rows[static_cast<std::size_t>(g)] * r.topk;
  auto cap = expert_capacity(total * r.topk, r.num_experts, p.capacity_factor);
  if (!cap) return unexpected<error>(cap.error());
  if (p.pad_to_capacity && *cap > total)
    return make_error(errc::invalid_argument,
                      "pad_to_capacity: capacity " + detail::to_decimal(*cap) + " exceeds the " +
                          detail::to_decimal(total) + " tokens of the sequence group");

  // 2. Gather the detached routing (and keys) of the whole group, in rank order.
  const auto K = static_cast<std::size_t>(r.topk), N = static_cast<std::size_t>(r.num_tokens);
  const auto all_pairs = static_cast<std::size_t>(total) * K;
  ws.expert.resize(all_pairs);
  ws.probs.resize(all_pairs);
  ws.keep.resize(all_pairs);
  const std::span<const int> pairs_of(ws.pairs_of);
  if (auto s = tp_cp.all_gather_v(std::span<const int>(r.expert, N * K), std::span<int>(ws.expert),
                                  pairs_of);
      !s)
    return s;
  if (auto s =
          tp_cp.all_gather_v(std::span<const T>(r.probs, N * K), std::span<T>(ws.probs), pairs_of);
      !s)
    return s;
  ws.order.clear();  // row -> rank in true order; empty: rank order
  if (!order_keys.empty()) {
    ws.keys.resize(static_cast<std::size_t>(total));
    if (auto s = tp_cp.all_gather_v(order_keys, std::span<std::int64_t>(ws.keys),
                                    std::span<const int>(ws.rows));
        !s)
      return s;
    if (auto s = detail::rank_by_key(std::span<const std::int64_t>(ws.keys), ws.by_order, ws.order);
        !s)
      return s;
  }

  // 3. The same decision on every rank; keep this rank's pairs and count its rows.
  const routing_view<T> g{.num_tokens = static_cast<int>(total),
                          .topk = r.topk,
                          .num_experts = r.num_experts,
                          .expert = ws.expert.data(),
                          .probs = ws.probs.data(),
                          .keep = ws.keep.data()};
  const auto first = static_cast<std::size_t>(offset);
  detail::keep_within_capacity(g, *cap, p.by, p.pad_to_capacity,
                               std::span<const long long>(ws.order), first, N, out, ws);
  std::copy_n(ws.keep.begin() + static_cast<std::ptrdiff_t>(first * K), N * K, r.keep);
  out.capacity = *cap;
  out.pad_rows = p.pad_to_capacity ? std::optional<int>(*cap) : std::nullopt;
  return {};
}
//! A test's own host policy: its member apply(comm, keys, routing, counts, scratch).
template <class P, class C, class T>
requires requires(const P& p, C& c, std::span<const std::int64_t> k, const routing_view<T>& r,
                  drop_counts& o, drop_scratch<T>& w) {
  { p.apply(c, k, r, o, w) } -> std::same_as<status>;
}
[[nodiscard]] status host_apply(const P& p, C& c, std::span<const std::int64_t> keys,
                                const routing_view<T>& r, drop_counts& out, drop_scratch<T>& ws) {
  return p.apply(c, keys, r, out, ws);
}

//! The routing after a drop policy: Megatron-Core's `final_map` and `final_probs` [N, E] (dropped
//! pairs are 0, the survivors keep their probabilities, filler rows have probability 0), which of
//! the k selected pairs of each token survived, and the report.
template <class T>
struct drop_result {
  int num_tokens = 0;
  int num_experts = 0;
  int topk = 0;
  std::vector<std::uint8_t> final_map{};  // [N, E]
  std::vector<T> final_probs{};           // [N, E]
  std::vector<std::uint8_t> kept{};       // [N, k]: pair (t, indices[t, i]) survived
  std::optional<int> pad_rows{};          //!< drop_counts::pad_rows
  drop_report report;

  //! The surviving routing in top-k record form, as the dispatcher takes it: expert [N*k] with
  //! -1 for a dropped pair (pad-mode fillers are not pairs; the dispatcher pads to pad_rows), and
  //! probs [N*k] with 0 for a dropped pair.
  [[nodiscard]] std::vector<int> kept_experts(const topk_routing<T>& r) const {
    std::vector<int> out(r.indices);
    for (std::size_t p = 0; p < out.size() && p < kept.size(); ++p)
      if (!kept[p]) out[p] = -1;
    return out;
  }
  [[nodiscard]] std::vector<T> kept_probs(const topk_routing<T>& r) const {
    std::vector<T> out(r.probs);
    for (std::size_t p = 0; p < out.size() && p < kept.size(); ++p)
      if (!kept[p]) out[p] = T(0);
    return out;
  }

  //! Backward of final_probs = probs_sparse * final_map: the gradient with respect to the router's
  //! k probabilities, dprobs [N, k], from the gradient dfinal [N, E]; dropped pairs get 0.
  [[nodiscard]] status mask_gradient(const topk_routing<T>& r, std::span<const T> dfinal,
                                     std::span<T> dprobs) const {
    const auto N = static_cast<std::size_t>(num_tokens), E = static_cast<std::size_t>(num_experts),
               K = static_cast<std::size_t>(topk);
    if (r.num_tokens != num_tokens || r.num_experts != num_experts || r.topk != topk ||
        dfinal.size() != N * E || dprobs.size() != N * K)
      return make_error(errc::shape_mismatch,
                        "drop mask_gradient: need the same routing, dfinal [N*E], dprobs [N*k]");
    for (std::size_t t = 0; t < N; ++t)
      for (std::size_t i = 0; i < K; ++i)
        dprobs[t * K + i] =
            kept[t * K + i] ? dfinal[t * E + static_cast<std::size_t>(r.indices[t * K + i])] : T(0);
    return {};
  }
};

//! Runs policy `p` on a host top-k routing and builds the dense result (allocates: a test and
//! logging helper). Collective when the policy is: a rank whose routing has the wrong sizes still
//! takes part (with an empty record), so the group fails together.
template <class P, class C, class T>
[[nodiscard]] status apply_dense(const P& p, C& comm, std::span<const std::int64_t> keys,
                                 const topk_routing<T>& r, drop_result<T>& out) {
  const status sizes = detail::check_routing_sizes(r);
  drop_scratch<T> ws;
  std::vector<std::uint8_t> keep(sizes ? r.indices.size() : 0);
  if (!sizes) {
    // pairs() > 0 with null pointers: the policy reports bad input (to its whole group).
    const routing_view<T> none{
        .num_tokens = r.num_tokens < 1 ? 1 : r.num_tokens, .topk = 1, .num_experts = 1};
    drop_counts c = counts_into(out.report, 1);
    (void)host_apply(p, comm, keys, none, c, ws);
    return sizes;
  }
  const auto N = static_cast<std::size_t>(r.num_tokens),
             E = static_cast<std::size_t>(r.num_experts), K = static_cast<std::size_t>(r.topk);
  std::vector<std::uint8_t> filler(N * E);
  drop_counts c = counts_into(out.report, r.num_experts, filler);
  const routing_view<T> v = view_of(r, std::span<std::uint8_t>(keep));
  if (auto s = host_apply(p, comm, keys, v, c, ws); !s) return s;
  out.num_tokens = r.num_tokens;
  out.num_experts = r.num_experts;
  out.topk = r.topk;
  out.final_map = std::move(filler);
  out.final_probs.assign(N * E, T(0));
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t i = 0; i < K; ++i)
      if (keep[t * K + i]) {
        const auto e = static_cast<std::size_t>(r.indices[t * K + i]);
        out.final_map[t * E + e] = 1;
        out.final_probs[t * E + e] = r.probs[t * K + i];
      }
  out.kept = std::move(keep);
  out.pad_rows = c.pad_rows;
  out.report.capacity = c.capacity;
  out.report.dropped_pairs = c.dropped_pairs;
  out.report.fully_dropped_tokens = c.fully_dropped_tokens;
  return {};
}

//! The dense forms: a local policy alone, or any policy with its tp-cp communicator and keys.
template <class P, class T>
[[nodiscard]] status host_apply(const P& p, const topk_routing<T>& r, drop_result<T>& out) {
  detail::no_comm none;
  return apply_dense(p, none, {}, r, out);
}
template <class P, class C, class T>
[[nodiscard]] status host_apply(const P& p, C& c, std::span<const std::int64_t> keys,
                                const topk_routing<T>& r, drop_result<T>& out) {
  return apply_dense(p, c, keys, r, out);
}

}  // namespace v0_1
}  // namespace moefold
