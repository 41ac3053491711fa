//! @file pad_mode.hpp
//! @brief Pad mode's capacity as the dispatch API states it (std::optional<int>: set means pad
//! every expert to that many rows) and as the row arithmetic inside takes it (one int, -1 off).
#pragma once

#include <optional>

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! The capacity, or -1 without pad mode.
[[nodiscard]] constexpr int pad_or_off(const std::optional<int>& capacity) noexcept {
  return capacity ? *capacity : -1;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
