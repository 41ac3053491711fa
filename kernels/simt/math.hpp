//! @file math.hpp
//! @brief The arithmetic of kernel bodies that must round the same way on the CPU executor and
//! on the GPU: fma, bf16 conversion, and moefold's own exp, log and sqrt. Every function here is
//! made of operations IEEE 754 rounds exactly once (fma, add, multiply, divide, sqrt, rint) and
//! integer bit work, so both sides give the same bits. The C library's expf/logf and CUDA's
//! differ from each other in the last bits, which would make CPU and GPU routing differ.
//!
//! On the GPU the device intrinsics are named (`__fmaf_rn`, `__fdiv_rn`, ...) so that neither
//! -use_fast_math nor nvcc's default contraction of `a*b+c` can change a result; on the host
//! the code assumes no contraction either (g++/clang++ in ISO mode, `-std=c++20`, contract only
//! explicit fma). A NaN result is the canonical 0x7fffffff on both sides (`gpu_nan`). Accuracy,
//! checked against float64 by tests/kernels/simt/math_test.cpp: exp and log within 2 ulp, sqrt
//! correctly rounded.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <moefold/core/config.hpp>

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace moefold::kernels::simt {

[[nodiscard]] MOEFOLD_HOST_DEVICE inline std::uint32_t float_bits(float f) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float bits_float(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

#if !defined(__CUDA_ARCH__)
//! A NaN result as the GPU writes it: the canonical quiet NaN 0x7fffffff, whatever the inputs'
//! payloads (PTX's f32 arithmetic does not propagate them; x86 keeps an input's payload and makes
//! 0xffc00000 of an invalid operation). Seen on an H200: before this, sqrt of a negative and fma
//! of a NaN gave other bits on the CPU executor than on the GPU, and nothing else differed.
[[nodiscard]] inline float gpu_nan(float r) noexcept {
  if (r == r) return r;
  const std::uint32_t u = 0x7fffffffu;
  std::memcpy(&r, &u, 4);
  return r;
}
#endif

//! a * b + c rounded once.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float fma(float a, float b, float c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return gpu_nan(std::fma(a, b, c));
#endif
}
//! a * b rounded once, never fused into a neighbouring add.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float mul(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return gpu_nan(a * b);
#endif
}
//! a + b rounded once, never fused with a product.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float add(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return gpu_nan(a + b);
#endif
}
//! The same for double (accumulators of double data).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double mul(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double add(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double fma(double a, double b, double c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double div(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double rint(double x) noexcept {
#if defined(__CUDA_ARCH__)
  return ::rint(x);
#else
  return std::nearbyint(x);
#endif
}
//! Integers: plain arithmetic (exact, nothing to fuse).
template <class T>
requires std::is_integral_v<T>
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr T mul(T a, T b) noexcept { return a * b; }
template <class T>
requires std::is_integral_v<T>
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr T add(T a, T b) noexcept { return a + b; }

//! a / b correctly rounded (also under -use_fast_math).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float div(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return gpu_nan(a / b);
#endif
}
//! sqrt(x) correctly rounded (also under -use_fast_math).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float sqrt(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return gpu_nan(std::sqrt(x));
#endif
}
//! sqrt(x) correctly rounded, in double.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double sqrt(double x) noexcept {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}
//! x rounded to the nearest integer, ties to even (the default rounding mode on both sides).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float rint(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

//! float -> bf16 bits, rounded to nearest even; NaN stays a (quiet) NaN. The same rule as the
//! host's moefold::bfloat16 and CUDA's __float2bfloat16_rn.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline std::uint16_t to_bf16_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float from_bf16_bits(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}
//! f rounded to bf16 and back (what storing a float in a bf16 buffer keeps).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float round_bf16(float f) noexcept {
  return from_bf16_bits(to_bf16_bits(f));
}

//! 2^n for n in [-126, 127], built from its bits.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float pow2i(int n) noexcept {
  return bits_float(static_cast<std::uint32_t>(n + 127) << 23);
}

//! e^x. x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact to ~2^-32), e^r by its
//! Taylor series to r^7 (truncation 5e-9 relative) in Horner form with fma, then scaled by 2^n
//! in two steps so that results down to the smallest subnormal come out right.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float exp(float x) noexcept {
  if (x != x) return x;
  if (x > 88.72283935546875f) return bits_float(0x7f800000u);  // above ln(FLT_MAX): +inf
  if (x < -103.97208f) return 0.0f;                            // below ln(2^-150): 0
  const float n = rint(mul(x, 1.44269502162933349609375f));    // x / ln2
  float r = fma(-n, 0.693145751953125f, x);                    // ln2 high part (exact product)
  r = fma(-n, 1.428606765330187045e-06f, r);                   // ln2 low part
  float p = 1.98412698412698413e-04f;                          // 1/5040
  p = fma(p, r, 1.38888888888888889e-03f);                     // 1/720
  p = fma(p, r, 8.33333333333333333e-03f);                     // 1/120
  p = fma(p, r, 4.16666666666666667e-02f);                     // 1/24
  p = fma(p, r, 1.66666666666666667e-01f);                     // 1/6
  p = fma(p, r, 0.5f);
  p = fma(p, mul(r, r), r);  // e^r - 1 = r + r^2 (1/2 + r/6 + ...)
  p = add(p, 1.0f);
  const int k = static_cast<int>(n);
  if (k > 127) return mul(mul(p, pow2i(127)), pow2i(k - 127));
  if (k < -126) return mul(mul(p, pow2i(-126)), pow2i(k + 126));
  return mul(p, pow2i(k));
}

//! 2^n for n in [-1022, 1023], built from its bits.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double pow2i_f64(int n) noexcept {
  const std::uint64_t u = static_cast<std::uint64_t>(n + 1023) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, 8);
  return d;
#endif
}

//! 1 / k!, evaluated by the compiler (the same constant on both sides).
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr double inv_factorial(int k) noexcept {
  double f = 1.0;
  for (int i = 2; i <= k; ++i) f *= i;
  return 1.0 / f;
}

namespace detail_math {
// e^r - 1 - r over r^2 by Horner from the term 1/K!: sum_{k=2..K} r^(k-2) / k!.
template <int K, int k = 2>
[[nodiscard]] MOEFOLD_HOST_DEVICE double expm1_tail(double r) noexcept {
  constexpr double c = inv_factorial(k);
  if constexpr (k == K)
    return c;
  else
    return fma(expm1_tail<K, k + 1>(r), r, c);
}
}  // namespace detail_math

//! e^x in double, for the special functions whose float results must be right to the last bit
//! (the activations of kernels/activation.hpp round an fp64 value once). The float exp's method
//! with ln2 in two parts (the high part has 32 significant bits, so n ln2_hi is exact) and the
//! series to r^13 (truncation 4e-18 relative).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double exp(double x) noexcept {
  if (x != x) return x;
  if (x > 709.782712893384) return static_cast<double>(bits_float(0x7f800000u));  // +inf
  if (x < -745.1332191019412) return 0.0;  // below 2^-1075: 0
  const double n = rint(mul(x, 1.4426950408889634));
  double r = fma(-n, 6.93147180369123816490e-01, x);             // ln2 high part
  r = fma(-n, 1.90821492927058770002e-10, r);                    // ln2 low part
  double p = fma(mul(r, r), detail_math::expm1_tail<13>(r), r);  // e^r - 1
  p = add(p, 1.0);
  const int k = static_cast<int>(n);
  if (k > 1023) return mul(mul(p, pow2i_f64(1023)), pow2i_f64(k - 1023));
  if (k < -1022) return mul(mul(p, pow2i_f64(-1022)), pow2i_f64(k + 1022));
  return mul(p, pow2i_f64(k));
}

//! ln x. x = m 2^e with m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(s), s = (m-1)/(m+1), |s| <=
//! 0.1716, by its series to s^11 (truncation 5e-11); e ln2 in two parts.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float log(float x) noexcept {
  if (x != x) return x;
  if (x < 0.0f) return bits_float(0x7fc00000u);   // NaN
  if (x == 0.0f) return bits_float(0xff800000u);  // -inf
  if (x == bits_float(0x7f800000u)) return x;     // +inf
  std::uint32_t u = float_bits(x);
  int e = 0;
  if (u < 0x00800000u) {  // subnormal: scale by 2^23 first
    u = float_bits(mul(x, 8388608.0f));
    e = -23;
  }
  e += static_cast<int>(u >> 23) - 127;
  float m = bits_float((u & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  if (m > 1.41421353816986083984375f) {                   // fold [sqrt2, 2) to [sqrt2/2, 1)
    m = mul(m, 0.5f);
    ++e;
  }
  const float f = add(m, -1.0f);  // exact (Sterbenz)
  const float s = div(f, add(m, 1.0f));
  const float z = mul(s, s);
  float p = 0.18181818181818182f;                 // 2/11
  p = fma(p, z, 0.22222222222222222f);            // 2/9
  p = fma(p, z, 0.28571428571428571f);            // 2/7
  p = fma(p, z, 0.4f);                            // 2/5
  p = fma(p, z, 0.66666666666666667f);            // 2/3
  const float lm = fma(mul(s, z), p, add(s, s));  // 2s + s z p; 2s is exact
  const float fe = static_cast<float>(e);
  // e ln2_hi is exact (ln2_hi has 16 significant bits, |e| < 2^8).
  return add(mul(fe, 0.693145751953125f), fma(fe, 1.428606765330187045e-06f, lm));
}

//! ln(1 + x), accurate also where 1 + x rounds to 1: with u = 1 + x (rounded), ln(u) * x / (u - 1)
//! cancels the rounding of u (Goldberg's method).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float log1p(float x) noexcept {
  const float u = add(1.0f, x);
  if (u == 1.0f) return x;
  if (u == bits_float(0x7f800000u)) return u;
  return mul(log(u), div(x, add(u, -1.0f)));
}

//! 1 / (1 + e^-x), with e^x taken only where it cannot overflow (Megatron-Core's two branches).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline float sigmoid(float x) noexcept {
  if (x >= 0.0f) return div(1.0f, add(1.0f, exp(-x)));
  const float e = exp(x);
  return div(e, add(1.0f, e));
}

//! The bits of a double, and back.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline std::uint64_t double_bits(double d) noexcept {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(d));
#else
  std::uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
#endif
}
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double bits_double(std::uint64_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, 8);
  return d;
#endif
}

//! ln x in double (the router in fp64 on a CPU context: the logsumexp, sqrt-softplus), the
//! float log's method with the series of 2 atanh(s) to s^23 (|s| <= 0.1716: truncation below
//! 1e-19 relative) and e ln2 in two parts (ln2_hi has 32 significant bits: e ln2_hi is exact).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double log(double x) noexcept {
  if (x != x) return x;
  if (x < 0.0) return bits_double(0x7ff8000000000000ull);    // NaN
  if (x == 0.0) return -bits_double(0x7ff0000000000000ull);  // -inf
  if (x == bits_double(0x7ff0000000000000ull)) return x;     // +inf
  std::uint64_t u = double_bits(x);
  int e = 0;
  if (u < 0x0010000000000000ull) {  // subnormal: scale by 2^52 first
    u = double_bits(mul(x, 4503599627370496.0));
    e = -52;
  }
  e += static_cast<int>(u >> 52) - 1023;
  double m = bits_double((u & 0x000fffffffffffffull) | 0x3ff0000000000000ull);  // [1, 2)
  if (m > 1.4142135623730951) {  // fold [sqrt2, 2) to [sqrt2/2, 1)
    m = mul(m, 0.5);
    ++e;
  }
  const double f = add(m, -1.0);  // exact (Sterbenz)
  const double s = div(f, add(m, 1.0));
  const double z = mul(s, s);
  double p = 2.0 / 23;  // 2 / (2j + 1), j = 11 .. 1, by Horner
  for (int j = 10; j >= 1; --j) p = fma(p, z, 2.0 / (2 * j + 1));
  const double lm = fma(mul(s, z), p, add(s, s));  // 2s + s z p; 2s is exact
  const double fe = static_cast<double>(e);
  return add(mul(fe, 6.93147180369123816490e-01), fma(fe, 1.90821492927058770002e-10, lm));
}

//! ln(1 + x) in double (the float log1p's method).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double log1p(double x) noexcept {
  const double u = add(1.0, x);
  if (u == 1.0) return x;
  if (u == bits_double(0x7ff0000000000000ull)) return u;
  return mul(log(u), div(x, add(u, -1.0)));
}

//! 1 / (1 + e^-x) in double (the float sigmoid's two branches).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double sigmoid(double x) noexcept {
  if (x >= 0.0) return div(1.0, add(1.0, exp(-x)));
  const double e = exp(x);
  return div(e, add(1.0, e));
}

//! -infinity of the router's element type (float or double).
template <class R>
[[nodiscard]] MOEFOLD_HOST_DEVICE inline R neg_inf() noexcept {
  if constexpr (std::is_same_v<R, double>)
    return -bits_double(0x7ff0000000000000ull);
  else
    return bits_float(0xff800000u);
}

}  // namespace moefold::kernels::simt
