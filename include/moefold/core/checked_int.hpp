//! @file checked_int.hpp
//! @brief Products and sums of sizes that report overflow instead of wrapping (signed overflow is
//! undefined behaviour, and a wrapped world size would silently build wrong groups).
#pragma once

#include <climits>
#include <cstdint>

#include "config.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! a * b for a, b >= 0; false when the product does not fit in int.
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr bool checked_mul(int a, int b, int& out) noexcept {
  const std::int64_t p = static_cast<std::int64_t>(a) * static_cast<std::int64_t>(b);
  if (p > INT_MAX || p < INT_MIN) return false;
  out = static_cast<int>(p);
  return true;
}

//! a + b; false when the sum does not fit in int.
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr bool checked_add(int a, int b, int& out) noexcept {
  const std::int64_t s = static_cast<std::int64_t>(a) + static_cast<std::int64_t>(b);
  if (s > INT_MAX || s < INT_MIN) return false;
  out = static_cast<int>(s);
  return true;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
