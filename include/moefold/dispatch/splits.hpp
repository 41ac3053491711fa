//! @file splits.hpp
//! @brief Split computation of the All-to-All dispatcher: from the per-expert counts of every rank
//! of the tp-ep group (gathered once per layer), how many rows this rank sends to and receives
//! from each EP peer, how many each ETP peer contributes, and how many each local expert gets.
//!
//! Experts are owned contiguously: EP rank j holds global experts [j*L, (j+1)*L), L = E / EP.
//! Inside the tp-ep group, the rank of (ep j, etp t) is j*ETP + t (etp fastest, Megatron's layout).
#pragma once

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <span>

#include "../core/expected.hpp"
#include "../core/size.hpp"

namespace moefold {
inline namespace v0_1 {

namespace dispatch {

//! Inputs of the split computation.
struct split_args {
  int ep = 1;                              //!< EP
  int etp = 1;                             //!< ETP
  int num_experts = 1;                     //!< E (global), a multiple of EP
  int my_ep = 0;                           //!< this rank's EP index
  int my_etp = 0;                          //!< this rank's ETP index
  std::span<const int> gathered_counts{};  //!< [EP*ETP, E] routed rows per expert of each
                                           //!< tp-ep rank (row j*ETP + t)
};

//! The splits of one rank. The caller provides the storage (sizes in brackets).
struct split_view {
  std::span<int> input_splits;             //!< [EP] rows this rank sends to EP rank j
  std::span<int> output_splits;            //!< [EP] rows EP rank j sends to this rank
  std::span<int> output_splits_tp;         //!< [ETP] rows ETP peer t received in its All-to-All
  std::span<int> tokens_per_local_expert;  //!< [L] rows each local expert computes
  std::span<int> chunk_counts;             //!< [ETP*EP*L] rows of chunk (t, j, l), (t, j, l) order
};

//! Computes this rank's splits (docs/dispatch-semantics.md 5.2.1).
[[nodiscard]] inline status compute_splits(const split_args& a, const split_view& out) {
  using detail::to_decimal;
  if (a.ep < 1 || a.etp < 1 || a.num_experts < 1)
    return make_error(errc::invalid_size, "splits: ep, etp and num_experts must be >= 1");
  if (a.num_experts % a.ep != 0)
    return make_error(errc::invalid_argument, "splits: num_experts = " + to_decimal(a.num_experts) +
                                                  " is not divisible by ep = " + to_decimal(a.ep) +
                                                  " (each EP rank owns E / EP experts)");
  if (a.my_ep < 0 || a.my_ep >= a.ep || a.my_etp < 0 || a.my_etp >= a.etp)
    return make_error(errc::rank_out_of_range,
                      "splits: this rank's (ep, etp) index is outside "
                      "the group");
  const int L = a.num_experts / a.ep;
  const auto E = static_cast<std::size_t>(a.num_experts);
  const auto ranks = static_cast<std::size_t>(a.ep) * static_cast<std::size_t>(a.etp);
  if (a.gathered_counts.size() != ranks * E)
    return make_error(errc::shape_mismatch,
                      "splits: gathered counts have " + to_decimal(a.gathered_counts.size()) +
                          " entries, expected EP*ETP*E = " + to_decimal(ranks * E));
  if (out.input_splits.size() != static_cast<std::size_t>(a.ep) ||
      out.output_splits.size() != static_cast<std::size_t>(a.ep) ||
      out.output_splits_tp.size() != static_cast<std::size_t>(a.etp) ||
      out.tokens_per_local_expert.size() != static_cast<std::size_t>(L) ||
      out.chunk_counts.size() != ranks * static_cast<std::size_t>(L))
    return make_error(errc::shape_mismatch,
                      "splits: output spans must have sizes EP, EP, ETP, L "
                      "and ETP*EP*L");
  long long total = 0;
  for (int c : a.gathered_counts) {
    if (c < 0) return make_error(errc::invalid_argument, "splits: a negative count");
    total += c;
  }
  // Every split below is a partial sum of the counts, so this bounds them all.
  if (total > max_rows)
    return make_error(errc::overflow, "splits: the gathered counts add up to more than 2^31-1");
  // count(t, j, e): rows that tp-ep rank (ep j, etp t) routes to global expert e.
  auto count = [&](int t, int j, int e) {
    return a.gathered_counts[(static_cast<std::size_t>(j) * static_cast<std::size_t>(a.etp) +
                              static_cast<std::size_t>(t)) *
                                 E +
                             static_cast<std::size_t>(e)];
  };
  for (int j = 0; j < a.ep; ++j) {
    long long in = 0, outj = 0;
    for (int l = 0; l < L; ++l) {
      in += count(a.my_etp, a.my_ep, j * L + l);    // my rows for EP rank j's experts
      outj += count(a.my_etp, j, a.my_ep * L + l);  // EP rank j's rows for my experts
    }
    out.input_splits[static_cast<std::size_t>(j)] = static_cast<int>(in);
    out.output_splits[static_cast<std::size_t>(j)] = static_cast<int>(outj);
  }
  for (int l = 0; l < L; ++l) out.tokens_per_local_expert[static_cast<std::size_t>(l)] = 0;
  for (int t = 0; t < a.etp; ++t) {
    long long tp = 0;
    for (int j = 0; j < a.ep; ++j)
      for (int l = 0; l < L; ++l) {
        const int c = count(t, j, a.my_ep * L + l);
        tp += c;
        out.chunk_counts[(static_cast<std::size_t>(t) * static_cast<std::size_t>(a.ep) +
                          static_cast<std::size_t>(j)) *
                             static_cast<std::size_t>(L) +
                         static_cast<std::size_t>(l)] = c;
        out.tokens_per_local_expert[static_cast<std::size_t>(l)] += c;
      }
    out.output_splits_tp[static_cast<std::size_t>(t)] = static_cast<int>(tp);
  }
  return {};
}

//! The rows the most loaded EP rank of the group receives in one step (after the AllGather over
//! ETP: every ETP peer of an EP rank receives the same rows), and the first EP rank with that
//! load. Every rank computes it from the same gathered counts, so every rank reaches the same
//! verdict on a receive bound before any row moves. Arguments as checked by compute_splits.
struct receive_peak {
  int ep_rank = 0;
  long long rows = 0;
};

//! The error every rank of the group returns when the most loaded EP rank would receive more
//! rows than the receive bound (both dispatchers word it alike).
[[nodiscard]] inline unexpected<error> receive_bound_error(const receive_peak& peak,
                                                           long long bound) {
  using detail::to_decimal;
  return make_error(errc::receive_bound_exceeded,
                    "dispatch: EP rank " + to_decimal(peak.ep_rank) + " would receive " +
                        to_decimal(peak.rows) + " rows, more than the receive bound " +
                        to_decimal(bound) +
                        " (dispatch_shape::max_recv_rows; raise it, or drop tokens)");
}
[[nodiscard]] inline receive_peak peak_receive(const split_args& a) noexcept {
  const int L = a.num_experts / a.ep;
  const auto E = static_cast<std::size_t>(a.num_experts);
  receive_peak peak;
  for (int q = 0; q < a.ep; ++q) {
    long long rows = 0;
    for (std::size_t src = 0; src < static_cast<std::size_t>(a.ep) * a.etp; ++src)
      for (int l = 0; l < L; ++l)
        rows += a.gathered_counts[src * E + static_cast<std::size_t>(q * L + l)];
    if (rows > peak.rows || q == 0) peak = {q, rows};
  }
  return peak;
}

//! Pad mode (every rank sends `capacity` rows to every expert): the splits compute_splits gives
//! for those counts, without exchanging them. L = E / EP local experts.
inline void uniform_splits(int capacity, int ep, int etp, int local_experts,
                           const split_view& v) noexcept {
  const int per_peer = capacity * local_experts;
  std::fill(v.input_splits.begin(), v.input_splits.end(), per_peer);
  std::fill(v.output_splits.begin(), v.output_splits.end(), per_peer);
  std::fill(v.output_splits_tp.begin(), v.output_splits_tp.end(), per_peer * ep);
  std::fill(v.tokens_per_local_expert.begin(), v.tokens_per_local_expert.end(),
            capacity * ep * etp);
  std::fill(v.chunk_counts.begin(), v.chunk_counts.end(), capacity);
}

//! The rows of a split (a sum of counts that compute_splits bounded below 2^31).
[[nodiscard]] inline int split_total(std::span<const int> splits) noexcept {
  return std::accumulate(splits.begin(), splits.end(), 0);
}

}  // namespace dispatch

}  // namespace v0_1
}  // namespace moefold
