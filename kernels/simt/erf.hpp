//! @file erf.hpp
//! @brief erf and erfc in double for kernel bodies (GELU and GeGLU, forward and backward), built
//! like math.hpp from operations rounded once, so the CPU executor and the GPU give the same bits.
//! No fitted coefficients: a Taylor series where it converges fast and a continued fraction
//! beyond, each with a fixed number of terms chosen from a float64 sweep against the C library.
//! Relative error (tests/kernels/activation_kernel_test.cpp): erf 1e-15, erfc <= 2e-13 + z^2 2^-52
//! (1 - erf loses 8 bits just below |z| = 2; e^-z^2 turns z^2's rounding into z^2 2^-52), far below
//! the half float ulp (6e-8) that the kernels round to wherever a float result is not 0: a kernel's
//! float result is the correctly rounded value but within ~2e-13 of a rounding boundary.
#pragma once

#include <moefold/core/config.hpp>

#include "math.hpp"

namespace moefold::kernels::simt {

namespace detail_erf {
// (-1)^k / (k! (2k + 1)): erf(z) = 2/sqrt(pi) z sum_k c_k z^(2k).
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr double taylor_coefficient(int k) noexcept {
  return (k % 2 == 0 ? 1.0 : -1.0) * inv_factorial(k) / (2 * k + 1);
}
// sum_{k>=K0} c_k w^(k-K0) to k = K by Horner (constants folded by the compiler).
template <int K, int k = 0>
[[nodiscard]] MOEFOLD_HOST_DEVICE double taylor(double w) noexcept {
  constexpr double c = taylor_coefficient(k);
  if constexpr (k == K)
    return c;
  else
    return fma(taylor<K, k + 1>(w), w, c);
}
inline constexpr double two_over_sqrt_pi = 1.12837916709551257390;
inline constexpr double one_over_sqrt_pi = 0.56418958354775628695;

// erf(z) for |z| <= 2: 40 terms (the 41st is below 2e-24 at z = 2).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double erf_small(double z) noexcept {
  return mul(mul(two_over_sqrt_pi, z), taylor<40>(mul(z, z)));
}
// erfc(z) for z > 2: e^-z^2 / sqrt(pi) / (z + (1/2) / (z + 1 / (z + (3/2) / (z + ...)))), the
// fraction evaluated from 40 levels down (5e-14 relative at z = 2, less beyond).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double erfc_large(double z) noexcept {
  double t = 0.0;
  for (int k = 40; k >= 1; --k) t = div(0.5 * k, add(z, t));
  return div(mul(exp(-mul(z, z)), one_over_sqrt_pi), add(z, t));
}
}  // namespace detail_erf

//! The complementary error function, accurate in relative terms over its whole range (so that
//! GELU of a very negative input keeps its tiny value instead of cancelling to 0).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double erfc(double z) noexcept {
  if (z != z) return z;
  if (z > 2.0) return detail_erf::erfc_large(z);
  if (z < -2.0) return add(2.0, -detail_erf::erfc_large(-z));
  return add(1.0, -detail_erf::erf_small(z));
}

//! The error function.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double erf(double z) noexcept {
  if (z != z) return z;
  if (z > 2.0) return add(1.0, -detail_erf::erfc_large(z));
  if (z < -2.0) return add(detail_erf::erfc_large(-z), -1.0);
  return detail_erf::erf_small(z);
}

}  // namespace moefold::kernels::simt
