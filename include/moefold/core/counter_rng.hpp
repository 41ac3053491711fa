//! @file counter_rng.hpp
//! @brief SplitMix64's finaliser, the counter-based generator behind moefold's random draws
//! (input jitter, the upcycled router): draw i depends only on (seed, i), never on thread order,
//! rank or how many draws came before, and is the same on every compiler.
#pragma once

#include <cstdint>

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! A bijection of 64-bit words that mixes every bit (SplitMix64's output function).
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
