//! @file round_once.hpp
//! @brief An fp64 value rounded once, to nearest (ties to even), to float, double or bf16: the
//! upcycled weights are the dense values times the scale in fp64, rounded once to the output type
//! (a detour through fp32 would round twice and could land a bf16 tie the wrong way).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../core/dtype.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! v as a float rounded to odd: truncated towards zero, its last bit set when inexact. A later
//! rounding to a type with at least two fewer mantissa bits (bf16: 16 fewer) then equals the
//! direct rounding of v.
[[nodiscard]] inline float round_to_odd_float(double v) noexcept {
  float f = static_cast<float>(v);
  if (std::isnan(v) || static_cast<double>(f) == v) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
}

//! A source value in fp64, exactly (bf16 and fp16 through fp32, which holds them exactly).
template <class S>
[[nodiscard]] double to_double(S v) noexcept {
  if constexpr (std::is_arithmetic_v<S>)
    return static_cast<double>(v);
  else
    return static_cast<double>(static_cast<float>(v));
}

template <class T>
[[nodiscard]] T round_once(double v) noexcept {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>)
    return T(round_to_odd_float(v));
  else
    return static_cast<T>(v);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
