//! @file dtype.hpp
//! @brief Element types (core vocabulary: the communicators move and reduce them, the layer
//! computes in them): an id that travels in the collective
//! headers (so that a rank sending floats to a rank expecting ints is an error, not garbage), the
//! 16-bit floating-point storage types of the host side, and the accumulator of each type.
#pragma once

#include <bit>
#include <cstdint>
#include <string>
#include <type_traits>

#include "config.hpp"

namespace moefold {
inline namespace v0_1 {

//! bfloat16 storage on the host: the upper 16 bits of an IEEE float. Layout-compatible with
//! CUDA's __nv_bfloat16, so a device buffer of either can be handed to the GPU backends.
struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  //! Rounds to nearest even; NaN stays NaN. The same bits on the host and in kernels (the
  //! conversions are __host__ __device__ under nvcc with --expt-relaxed-constexpr).
  MOEFOLD_HOST_DEVICE constexpr explicit bfloat16(float f) noexcept {
    const auto u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
      return;
    }
    bits = static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  MOEFOLD_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  friend bool operator==(bfloat16, bfloat16) = default;
};

//! IEEE binary16 storage on the host. Layout-compatible with CUDA's __half.
struct float16 {
  std::uint16_t bits = 0;

  float16() = default;
  //! Rounds to nearest even; overflow goes to infinity, NaN stays NaN.
  MOEFOLD_HOST_DEVICE constexpr explicit float16(float f) noexcept {
    const auto u = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {  // NaN
      bits = static_cast<std::uint16_t>(sign | 0x7e00u);
    } else if (a >= 0x477ff000u) {  // rounds to >= 65520: infinity
      bits = static_cast<std::uint16_t>(sign | 0x7c00u);
    } else if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
      // Adding 0.5 makes the FPU round the mantissa to a multiple of 2^-24 (nearest even).
      const float r = std::bit_cast<float>(a) + 0.5f;
      bits = static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(r) - 0x3f000000u));
    } else {
      const std::uint32_t odd = (a >> 13) & 1u;
      bits = static_cast<std::uint16_t>(sign | ((a + 0xc8000fffu + odd) >> 13));
    }
  }
  MOEFOLD_HOST_DEVICE constexpr explicit operator float() const noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
    const std::uint32_t e = (bits >> 10) & 0x1fu;
    const std::uint32_t m = bits & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24
      const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
    return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
  }
  friend bool operator==(float16, float16) = default;
};

//! The element types a collective knows by name. The value travels in headers.
enum class dtype : std::uint8_t {
  other = 0,  //!< a trivially copyable type moved as bytes (never reduced)
  i8,
  u8,
  i32,
  u32,
  i64,
  u64,
  f32,
  f64,
  bf16,
  f16,
};

[[nodiscard]] constexpr const char* to_string(dtype t) noexcept {
  switch (t) {
    case dtype::other: return "other";
    case dtype::i8: return "int8";
    case dtype::u8: return "uint8";
    case dtype::i32: return "int32";
    case dtype::u32: return "uint32";
    case dtype::i64: return "int64";
    case dtype::u64: return "uint64";
    case dtype::f32: return "float32";
    case dtype::f64: return "float64";
    case dtype::bf16: return "bfloat16";
    case dtype::f16: return "float16";
  }
  return "?";
}

namespace detail {
template <class T>
constexpr dtype dtype_of_impl() noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>)
    return dtype::f32;
  else if constexpr (std::is_same_v<U, double>)
    return dtype::f64;
  else if constexpr (std::is_same_v<U, bfloat16>)
    return dtype::bf16;
  else if constexpr (std::is_same_v<U, float16>)
    return dtype::f16;
  else if constexpr (std::is_integral_v<U> && !std::is_same_v<U, bool>) {
    if constexpr (sizeof(U) == 1)
      return std::is_signed_v<U> ? dtype::i8 : dtype::u8;
    else if constexpr (sizeof(U) == 4)
      return std::is_signed_v<U> ? dtype::i32 : dtype::u32;
    else if constexpr (sizeof(U) == 8)
      return std::is_signed_v<U> ? dtype::i64 : dtype::u64;
    else
      return dtype::other;
  } else
    return dtype::other;
}
}  // namespace detail

//! The dtype id of T. Users may specialize it for their own 16-bit types (for example a
//! framework's bfloat16) when the layout is that of moefold::bfloat16 / float16.
template <class T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<T>();

//! Types a communicator moves: trivially copyable values.
template <class T>
concept transferable = std::is_trivially_copyable_v<T> && !std::is_const_v<T>;

//! Types a communicator reduces (sum, max): the named arithmetic types.
template <class T>
concept reducible = transferable<T> && dtype_of<T>
!= dtype::other;

//! The type sums are accumulated in: fp32 for 16-bit floats (the rule: bf16/fp16 inputs
//! accumulate in fp32), the type itself otherwise.
template <class T>
using accumulator_t =
    std::conditional_t<dtype_of<T> == dtype::bf16 || dtype_of<T> == dtype::f16, float, T>;

//! The gradient element type a weight type accumulates into by default: fp32 for bf16/fp16
//! weights (Megatron-Core's main_grad), the weight type otherwise.
template <class T>
using main_grad_t = accumulator_t<T>;

namespace detail {
template <class T>
MOEFOLD_HOST_DEVICE constexpr accumulator_t<T> widen(const T& v) noexcept {
  if constexpr (std::is_same_v<accumulator_t<T>, T>)
    return v;
  else
    return static_cast<float>(v);
}
template <class T>
MOEFOLD_HOST_DEVICE constexpr T narrow(const accumulator_t<T>& v) noexcept {
  if constexpr (std::is_same_v<accumulator_t<T>, T>)
    return v;
  else
    return T(v);
}
//! "float32 (4 bytes)" for messages.
inline std::string describe(dtype t, std::size_t bytes) {
  return std::string(to_string(t)) + " (" + std::to_string(bytes) + " bytes)";
}
}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
