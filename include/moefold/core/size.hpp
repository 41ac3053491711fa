//! @file size.hpp
//! @brief Sizes and offsets: the one conversion to std::size_t the library uses, and the 32-bit
//! limit of row counts (rows and per-peer counts are int; element and byte offsets are 64-bit).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include "config.hpp"

namespace moefold {
inline namespace v0_1 {

//! The largest value of an int-typed size (a mesh size or a product of them, a row count):
//! 2^31 - 1, as std::int64_t so that checks compute in 64 bits.
inline constexpr std::int64_t max_int = INT_MAX;
//! The largest row count (of a view, a per-peer count, a total of counts): 2^31 - 1.
inline constexpr std::int64_t max_rows = max_int;

namespace detail {

//! A size or index known to be >= 0, as std::size_t.
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr std::size_t uz(std::int64_t v) noexcept {
  return static_cast<std::size_t>(v);
}

//! True when v is a valid row count (0 <= v <= max_rows).
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr bool fits_rows(std::int64_t v) noexcept {
  return v >= 0 && v <= max_rows;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
