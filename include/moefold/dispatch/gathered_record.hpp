//! @file gathered_record.hpp
//! @brief The AllGather dispatcher's checks of what the tp-ep group gathered: every rank's token
//! count and pad capacity (the header), every gathered expert id and per-source capacity, and the
//! rows each EP rank would receive. Every rank runs them on the same gathered data, so a bad rank
//! makes every rank fail alike, with the same error, before any row moves.
#pragma once

#include <cstddef>
#include <span>

#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "splits.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! header [P, 2]: (tokens, capacity) of each tp-ep rank -> tokens [P]; returns their sum.
//! Token counts must lie in [0, max_tokens] and every capacity must equal rank 0's.
[[nodiscard]] inline expected<long long> check_gathered_header(std::span<const int> header,
                                                               int max_tokens,
                                                               std::span<int> tokens) {
  long long total = 0;
  for (std::size_t q = 0; q < tokens.size(); ++q) {
    const int v = header[2 * q], cap = header[2 * q + 1];
    if (v < 0 || v > max_tokens)
      return make_error(errc::invalid_size, "dispatch: a peer has " + to_decimal(v) +
                                                " tokens, outside [0, max_tokens]");
    if (cap != header[1])
      return make_error(errc::comm_mismatch,
                        "dispatch: pad mode capacities differ in the tp-ep group (rank 0: " +
                            to_decimal(header[1]) + ", rank " +
                            to_decimal(static_cast<long long>(q)) + ": " + to_decimal(cap) +
                            "); every rank must pad to the same capacity");
    tokens[q] = v;
    total += v;
  }
  return total;
}

//! The gathered routing record: expert ids in [-1, E), and in pad mode (capacity >= 0) at most
//! `capacity` pairs per (source rank, expert).   expert [G*k], tokens [P], counts [E] (scratch)
[[nodiscard]] inline status check_gathered_routing(std::span<const int> expert,
                                                   std::span<const int> tokens, int topk,
                                                   int num_experts, int capacity,
                                                   std::span<int> counts) {
  const auto K = uz(topk);
  std::size_t t0 = 0;
  for (std::size_t q = 0; q < tokens.size(); ++q) {
    for (auto& c : counts) c = 0;
    const auto tq = uz(tokens[q]);
    for (std::size_t i = t0 * K; i < (t0 + tq) * K; ++i) {
      const int e = expert[i];
      if (e < -1 || e >= num_experts)
        return make_error(errc::invalid_argument,
                          "dispatch: tp-ep rank " + to_decimal(static_cast<long long>(q)) +
                              " names expert " + to_decimal(e) + ", outside [0, " +
                              to_decimal(num_experts) + ") (use -1 for a dropped pair)");
      if (capacity >= 0 && e >= 0 && ++counts[uz(e)] > capacity)
        return make_error(errc::invalid_argument,
                          "dispatch: tp-ep rank " + to_decimal(static_cast<long long>(q)) +
                              " routes more than the capacity " + to_decimal(capacity) +
                              " pairs to expert " + to_decimal(e) + " (drop before padding)");
    }
    t0 += tq;
  }
  return {};
}

//! The rows the most loaded EP rank would receive from the gathered record (checked ids), and
//! the first EP rank with that load.   expert [G*k], counts [E] (scratch)
[[nodiscard]] inline receive_peak gathered_peak_receive(std::span<const int> expert,
                                                        int num_experts, int ep,
                                                        std::span<int> counts) noexcept {
  for (auto& c : counts) c = 0;
  for (int e : expert)
    if (e >= 0) ++counts[uz(e)];
  const int L = num_experts / ep;
  receive_peak peak;
  for (int q = 0; q < ep; ++q) {
    long long rows = 0;
    for (int l = 0; l < L; ++l) rows += counts[uz(q * L + l)];
    if (rows > peak.rows || q == 0) peak = {q, rows};
  }
  return peak;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
