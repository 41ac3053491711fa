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
#include <span>
#include <string>
#include <vector>

#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../routing/topk_router.hpp"

namespace moefold {

//! Which routed tokens an expert keeps when it has more than its capacity.
enum class drop_by {
  probs,     //!< the highest probabilities (ties: earlier token first)
  position,  //!< the earliest tokens in sequence order (later positions are dropped first)
};

//! What a policy dropped, per expert, for logging and tests.
struct drop_report {
  int capacity = -1;             //!< C per expert; -1 when unbounded (dropless)
  std::vector<int> routed{};     //!< [E] pairs the router sent to each expert
  std::vector<int> dropped{};    //!< [E] routed pairs beyond capacity
  std::vector<int> padded{};     //!< [E] zero-probability filler rows (pad mode)
  long long dropped_pairs = 0;   //!< sum of dropped
  int fully_dropped_tokens = 0;  //!< tokens that lost all k experts
};

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
  //! Pad mode: the rows per expert the dispatcher pads this rank's column to (its kept pairs,
  //! then zero rows of probability 0, which contribute nothing: docs/dispatch-semantics.md 3.3),
  //! giving static shapes; -1 without padding. Sub-sequence: C. Full-sequence: the group's C,
  //! because a rank may hold up to all C kept rows of a column (static shapes cost |TP x CP| x the
  //! rows).
  int pad_rows = -1;
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

//! A drop policy decides which routed pairs each expert keeps. Every policy is called the same
//! way, with the communicator of the TP x CP group that holds pieces of the sequence and the true
//! sequence-order key of each local token (both ignored by local policies):
//!   p.apply(tp_cp, order_keys, routing, out) -> status
//! dropless, sub_sequence (drop_policy_local.hpp) and full_sequence
//! (drop_policy_full_sequence.hpp) model it; so can a user type.
template <class P, class T, class C>
concept drop_policy = requires(const P& p, C& comm, std::span<const std::int64_t> keys,
                               const topk_routing<T>& r, drop_result<T>& out) {
  { p.apply(comm, keys, r, out) } -> std::same_as<status>;
};

//! C = ceil(num_pairs / E * capacity_factor) (Megatron-Core `get_capacity`, in double as Python
//! evaluates it), with num_pairs = tokens * k. The factor must be finite and > 0: dropless is its
//! own policy, not a magic factor.
[[nodiscard]] inline expected<int> expert_capacity(long long num_pairs, int num_experts,
                                                   double capacity_factor) {
  if (!(std::isfinite(capacity_factor) && capacity_factor > 0))
    return make_error(errc::invalid_argument,
                      "capacity_factor must be finite and > 0 (use the dropless policy for no "
                      "capacity)");
  if (num_experts < 1 || num_pairs < 0)
    return make_error(errc::invalid_size, "capacity: need num_experts >= 1 and num_pairs >= 0");
  const double c = std::ceil((static_cast<double>(num_pairs) / num_experts) * capacity_factor);
  if (c > static_cast<double>(INT_MAX))
    return make_error(errc::overflow, "capacity does not fit in int");
  return static_cast<int>(c);
}

namespace detail {

//! Checks a routing before a policy uses it: sizes, expert ids in range and distinct per token,
//! finite probabilities.
template <class T>
[[nodiscard]] status check_routing(const topk_routing<T>& r) {
  if (r.num_tokens < 0 || r.num_experts < 1 || r.topk < 1 || r.topk > r.num_experts)
    return make_error(errc::invalid_size,
                      "routing: need num_tokens >= 0, 1 <= topk <= num_experts");
  const auto n = static_cast<std::size_t>(r.num_tokens) * static_cast<std::size_t>(r.topk);
  if (r.indices.size() != n || r.probs.size() != n)
    return make_error(errc::shape_mismatch,
                      "routing: indices and probs must hold num_tokens*topk = " +
                          to_decimal(static_cast<long long>(n)) + " entries");
  for (int t = 0; t < r.num_tokens; ++t)
    for (int i = 0; i < r.topk; ++i) {
      const int e = r.expert(t, i);
      if (e < 0 || e >= r.num_experts)
        return make_error(errc::invalid_argument,
                          "routing: token " + to_decimal(t) + " has expert id " + to_decimal(e) +
                              " outside [0, " + to_decimal(r.num_experts) + ")");
      for (int j = 0; j < i; ++j)
        if (r.expert(t, j) == e)
          return make_error(
              errc::invalid_argument,
              "routing: token " + to_decimal(t) + " names expert " + to_decimal(e) + " twice");
      if (!std::isfinite(r.prob(t, i)))
        return make_error(errc::non_finite_input,
                          "routing: token " + to_decimal(t) + " has a NaN or infinite probability");
    }
  return {};
}

//! Fills out.report from out.final_map / out.kept.
template <class T>
void fill_report(const topk_routing<T>& r, int capacity, drop_result<T>& out) {
  const auto E = static_cast<std::size_t>(r.num_experts), K = static_cast<std::size_t>(r.topk);
  drop_report& rep = out.report;
  rep.capacity = capacity;
  rep.routed.assign(E, 0);
  rep.dropped.assign(E, 0);
  rep.padded.assign(E, 0);
  rep.dropped_pairs = 0;
  rep.fully_dropped_tokens = 0;
  std::vector<std::uint8_t> routed_here(E);
  for (std::size_t t = 0; t < static_cast<std::size_t>(r.num_tokens); ++t) {
    std::fill(routed_here.begin(), routed_here.end(), 0);
    std::size_t kept_pairs = 0;
    for (std::size_t i = 0; i < K; ++i) {
      const auto e = static_cast<std::size_t>(r.indices[t * K + i]);
      routed_here[e] = 1;
      ++rep.routed[e];
      if (out.kept[t * K + i]) {
        ++kept_pairs;
      } else {
        ++rep.dropped[e];
        ++rep.dropped_pairs;
      }
    }
    if (kept_pairs == 0 && K > 0) ++rep.fully_dropped_tokens;
    for (std::size_t e = 0; e < E; ++e)
      if (out.final_map[t * E + e] && !routed_here[e]) ++rep.padded[e];
  }
}

//! The keep rule for one set of rows, shared by every capacity policy. `order[t]` is row t's rank
//! in true sequence order (empty: row order). Per expert: if at most C pairs are routed, all are
//! kept; else `probs` keeps the C highest probabilities (ties: earlier in order) and `position`
//! the C earliest. With pad, the lowest-order non-routed rows fill the column to exactly C.
template <class T>
void keep_within_capacity(const topk_routing<T>& r, int capacity, drop_by by, bool pad,
                          std::span<const long long> order, drop_result<T>& out) {
  const auto N = static_cast<std::size_t>(r.num_tokens),
             E = static_cast<std::size_t>(r.num_experts), K = static_cast<std::size_t>(r.topk);
  out.num_tokens = r.num_tokens;
  out.num_experts = r.num_experts;
  out.topk = r.topk;
  out.final_map.assign(N * E, 0);
  out.final_probs.assign(N * E, T(0));
  out.kept.assign(N * K, 0);
  out.pad_rows = pad ? capacity : -1;
  auto ord = [&](std::size_t t) { return order.empty() ? static_cast<long long>(t) : order[t]; };
  // Per expert: its routed (row, slot) pairs.
  std::vector<std::vector<std::size_t>> col(E);  // flat pair index t*K + i
  for (std::size_t p = 0; p < N * K; ++p) col[static_cast<std::size_t>(r.indices[p])].push_back(p);
  const auto C = static_cast<std::size_t>(capacity);
  for (std::size_t e = 0; e < E; ++e) {
    auto& c = col[e];
    if (c.size() > C) {
      if (by == drop_by::probs)
        std::stable_sort(c.begin(), c.end(), [&](std::size_t a, std::size_t b) {
          if (r.probs[a] != r.probs[b]) return r.probs[a] > r.probs[b];
          return ord(a / K) < ord(b / K);
        });
      else
        std::stable_sort(c.begin(), c.end(),
                         [&](std::size_t a, std::size_t b) { return ord(a / K) < ord(b / K); });
      c.resize(C);
    }
    for (std::size_t p : c) {
      out.kept[p] = 1;
      out.final_map[(p / K) * E + e] = 1;
      out.final_probs[(p / K) * E + e] = r.probs[p];
    }
    if (pad && c.size() < C) {
      std::vector<std::size_t> fill;
      for (std::size_t t = 0; t < N; ++t)
        if (!out.final_map[t * E + e]) fill.push_back(t);
      std::stable_sort(fill.begin(), fill.end(),
                       [&](std::size_t a, std::size_t b) { return ord(a) < ord(b); });
      for (std::size_t j = 0; j < C - c.size() && j < fill.size(); ++j)
        out.final_map[fill[j] * E + e] = 1;
    }
  }
  fill_report(r, capacity, out);
}

}  // namespace detail

//! Fills out.report (capacity, per-expert routed / dropped / padded counts, dropped pairs, fully
//! dropped tokens) from out.final_map and out.kept: for user policies.
template <class T>
void fill_drop_report(const topk_routing<T>& r, int capacity, drop_result<T>& out) {
  detail::fill_report(r, capacity, out);
}

}  // namespace moefold
