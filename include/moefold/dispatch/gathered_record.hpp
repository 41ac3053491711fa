//! @file gathered_record.hpp
//! @brief The AllGather dispatcher's checks of what the tp-ep group gathered: every rank's header
//! row (token count, pad capacity, the first bad entry of its routing record (a bad id or an
//! expert named twice by a token), its routed pairs per expert), from which the ids, the per-source
//! capacity and the rows each EP rank would receive are checked on the host without reading the
//! gathered record itself. Every rank runs them on the same gathered data, so a bad rank makes
//! every rank fail alike, with the same error, before any row moves.
#pragma once

#include <cstddef>
#include <span>

#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "splits.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! The columns of one rank's header row: its token count, its pad capacity (-1: off), the first
//! bad entry of its routing record (slot -1: none; an id outside [-1, E), or an expert its token
//! named before) and the expert it names, then its routed pairs
//! per expert [E]. Every rank gathers every rank's row, so all of them check the same table.
struct gathered_header {
  static constexpr int tokens = 0, capacity = 1, fault_slot = 2, fault_expert = 3, counts = 4;
  //! Columns of a row for E experts.
  [[nodiscard]] static constexpr int width(int num_experts) noexcept {
    return counts + num_experts;
  }
};

//! header [P, 4 + E] (host) -> tokens [P]; returns their sum. Token counts must lie in
//! [0, max_tokens] and every capacity must equal rank 0's.
[[nodiscard]] inline expected<long long> check_gathered_header(std::span<const int> header,
                                                               int width, int max_tokens,
                                                               std::span<int> tokens) {
  using h = gathered_header;
  long long total = 0;
  for (std::size_t q = 0; q < tokens.size(); ++q) {
    const int* row = header.data() + q * uz(width);
    const int v = row[h::tokens], cap = row[h::capacity];
    if (v < 0 || v > max_tokens)
      return make_error(errc::invalid_size, "dispatch: a peer has " + to_decimal(v) +
                                                " tokens, outside [0, max_tokens]");
    if (cap != header[h::capacity])
      return make_error(errc::comm_mismatch,
                        "dispatch: pad mode capacities differ in the tp-ep group (rank 0: " +
                            to_decimal(header[h::capacity]) + ", rank " +
                            to_decimal(static_cast<long long>(q)) + ": " + to_decimal(cap) +
                            "); every rank must pad to the same capacity");
    tokens[q] = v;
    total += v;
  }
  return total;
}

//! The group's routing records as their header rows tell them: every id in [-1, E), no expert
//! twice for a token, and in pad mode (capacity >= 0) at most `capacity` pairs per (source rank,
//! expert), checked in rank order.   header [P, 4 + E] (host)
[[nodiscard]] inline status check_gathered_routing(std::span<const int> header, int width,
                                                   int ranks, int num_experts, int topk,
                                                   int capacity) {
  using h = gathered_header;
  const int k = topk > 0 ? topk : 1;
  for (int q = 0; q < ranks; ++q) {
    const int* row = header.data() + uz(q) * uz(width);
    if (const int slot = row[h::fault_slot], e = row[h::fault_expert]; slot >= 0) {
      if (e >= -1 && e < num_experts)
        return make_error(errc::invalid_argument, "dispatch: tp-ep rank " + to_decimal(q) +
                                                      ": token " + to_decimal(slot / k) +
                                                      " names expert " + to_decimal(e) + " twice");
      return make_error(errc::invalid_argument, "dispatch: tp-ep rank " + to_decimal(q) +
                                                    " names expert " + to_decimal(e) +
                                                    ", outside [0, " + to_decimal(num_experts) +
                                                    ") (use -1 for a dropped pair)");
    }
    for (int e = 0; capacity >= 0 && e < num_experts; ++e)
      if (row[h::counts + e] > capacity)
        return make_error(errc::invalid_argument, "dispatch: tp-ep rank " + to_decimal(q) +
                                                      " routes more than the capacity " +
                                                      to_decimal(capacity) + " pairs to expert " +
                                                      to_decimal(e) + " (drop before padding)");
  }
  return {};
}

//! Pairs of the whole group routed to expert e: the sum of column e of the header's counts.
[[nodiscard]] inline long long gathered_pairs(std::span<const int> header, int width, int ranks,
                                              int e) noexcept {
  long long n = 0;
  for (int q = 0; q < ranks; ++q) n += header[uz(q) * uz(width) + uz(gathered_header::counts + e)];
  return n;
}

//! Rows of each local expert (global experts first .. first + L - 1), padding included: capacity
//! per source in pad mode, else the group's routed pairs.   header [P, 4 + E] (host) -> out [L]
inline void gathered_rows_per_expert(std::span<const int> header, int width, int ranks, int first,
                                     int capacity, std::span<int> out) noexcept {
  for (std::size_t l = 0; l < out.size(); ++l)
    out[l] =
        capacity >= 0
            ? capacity * ranks
            : static_cast<int>(gathered_pairs(header, width, ranks, first + static_cast<int>(l)));
}

//! The status row of a plan over the gathered tokens' local experts (first .. first + L - 1),
//! as the header tells it: the group's routed pairs per local expert, no faults (the header's
//! checks have passed).   header [P, 4 + E] (host) -> out [L + 2]
inline void gathered_local_status(std::span<const int> header, int width, int ranks, int first,
                                  std::span<int> out) noexcept {
  const std::size_t L = out.size() - 2;
  for (std::size_t l = 0; l < L; ++l)
    out[l] = static_cast<int>(gathered_pairs(header, width, ranks, first + static_cast<int>(l)));
  out[L] = out[L + 1] = 2147483647;
}

//! The rows the most loaded EP rank would receive (checked header), and the first EP rank with
//! that load.   header [P, 4 + E] (host)
[[nodiscard]] inline dispatch::receive_peak gathered_peak_receive(std::span<const int> header,
                                                                  int width, int ranks,
                                                                  int num_experts,
                                                                  int ep) noexcept {
  const int L = num_experts / ep;
  dispatch::receive_peak peak;
  for (int j = 0; j < ep; ++j) {
    long long rows = 0;
    for (int l = 0; l < L; ++l) rows += gathered_pairs(header, width, ranks, j * L + l);
    if (rows > peak.rows || j == 0) peak = {j, rows};
  }
  return peak;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
