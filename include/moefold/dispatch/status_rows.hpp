//! @file status_rows.hpp
//! @brief The All-to-All dispatcher's reading of its gathered plan status rows: each tp-ep rank's
//! routed pairs per expert and the two fault slots its plan kernels left (basic_permute_plan::
//! status_row(): the lowest pair naming a bad id or an expert twice for a token, the lowest
//! beyond capacity; INT_MAX for none). Every rank reads the same table, so a bad record fails
//! every rank in the same forward.
#pragma once

#include <algorithm>
#include <climits>
#include <span>

#include "../core/expected.hpp"
#include "../core/size.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! Row q of the status table [P, E + 2] (host).
[[nodiscard]] inline std::span<const int> status_row_of(std::span<const int> table, int experts,
                                                        int q) noexcept {
  const auto w = uz(experts) + 2;
  return table.subspan(uz(q) * w, w);
}

//! The first rank (in tp-ep order) whose status row names a fault, as an error naming it.
//! table [P, E + 2] (host)
[[nodiscard]] inline status check_status_rows(std::span<const int> table, int ranks, int experts) {
  for (int q = 0; q < ranks; ++q)
    if (const auto r = status_row_of(table, experts, q);
        r[uz(experts)] != INT_MAX || r[uz(experts) + 1] != INT_MAX)
      return make_error(errc::invalid_argument,
                        "dispatch: tp-ep rank " + to_decimal(q) +
                            "'s routing record names an expert outside [-1, " +
                            to_decimal(experts) + ") or one expert twice for a token (from slot " +
                            to_decimal(r[uz(experts)]) + "); that rank's error says which");
  return {};
}

//! The counts of the status table packed in place: table [P, E + 2] -> its first P E entries
//! [P, E] (row q's counts move down by 2 q entries, never over a row not yet moved).
inline void pack_status_counts(std::span<int> table, int ranks, int experts) noexcept {
  const auto E = uz(experts);
  for (std::size_t q = 1; q < uz(ranks); ++q)
    std::copy_n(table.begin() + static_cast<std::ptrdiff_t>(q * (E + 2)), E,
                table.begin() + static_cast<std::ptrdiff_t>(q * E));
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
