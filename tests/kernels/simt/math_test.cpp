// moefold's exp and log against float64 (<= 2 ulp), their special values, and bf16 rounding
// against the host's bfloat16, over a stride of all float bit patterns.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <moefold/core/dtype.hpp>
#include <moefold/kernels/simt/math.hpp>

namespace simt = moefold::kernels::simt;

namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// The float spacing at the magnitude of r (subnormal spacing below 2^-126).
double ulp_at(double r) {
  const double tiny = std::ldexp(1.0, -149);
  if (r == 0) return tiny;
  int e;
  std::frexp(std::fabs(r), &e);
  return std::max(std::ldexp(1.0, e - 24), tiny);
}

// A stride through every finite float (about a million values, every exponent and sign).
template <class F>
void for_floats(F f) {
  for (std::uint64_t b = 0; b < 0x100000000ull; b += 4093) {
    const float x = from_bits(static_cast<std::uint32_t>(b));
    if (std::isfinite(x)) f(x);
  }
}

}  // namespace

TEST_CASE("simt::exp is within 2 ulp of float64 over the whole range") {
  double worst = 0;
  float at = 0;
  for_floats([&](float x) {
    if (x < -104.0f || x > 89.0f) return;
    const double r = std::exp(static_cast<double>(x));
    const float f = simt::exp(x);
    if (r > static_cast<double>(std::numeric_limits<float>::max())) {
      // Past FLT_MAX + half an ulp the float result is infinity; in between, rounding picks
      // either neighbour, which the check below would count as < 1 ulp anyway.
      if (std::isinf(f)) return;
    }
    const double e = std::fabs(static_cast<double>(f) - r) / ulp_at(r);
    if (e > worst) worst = e, at = x;
  });
  MESSAGE("exp: worst " << worst << " ulp at " << at);
  CHECK(worst <= 2.0);
  CHECK(std::isnan(simt::exp(std::numeric_limits<float>::quiet_NaN())));
  CHECK(simt::exp(std::numeric_limits<float>::infinity()) ==
        std::numeric_limits<float>::infinity());
  CHECK(simt::exp(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(simt::exp(0.0f) == 1.0f);
  CHECK(simt::exp(89.0f) == std::numeric_limits<float>::infinity());
  CHECK(simt::exp(-104.0f) == 0.0f);
  CHECK(simt::exp(-103.0f) > 0.0f);  // subnormal results survive
}

TEST_CASE("simt::log is within 2 ulp of float64 for every positive float") {
  double worst = 0;
  float at = 0;
  for_floats([&](float x) {
    if (x <= 0.0f) return;
    const double r = std::log(static_cast<double>(x));
    const double e = std::fabs(static_cast<double>(simt::log(x)) - r) / ulp_at(r);
    if (e > worst) worst = e, at = x;
  });
  MESSAGE("log: worst " << worst << " ulp at " << at);
  CHECK(worst <= 2.0);
  CHECK(simt::log(1.0f) == 0.0f);
  CHECK(simt::log(0.0f) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(simt::log(-1.0f)));
  CHECK(std::isnan(simt::log(std::numeric_limits<float>::quiet_NaN())));
  CHECK(simt::log(std::numeric_limits<float>::infinity()) ==
        std::numeric_limits<float>::infinity());
  const float denorm = from_bits(1);  // 2^-149
  CHECK(std::fabs(simt::log(denorm) - (-149.0 * std::log(2.0))) <= ulp_at(-103.28));
}

TEST_CASE("simt bf16 rounding equals the host's bfloat16 (nearest even, NaN kept)") {
  long mismatches = 0;
  for_floats([&](float x) {
    const auto host = moefold::bfloat16(x).bits;
    if (simt::to_bf16_bits(x) != host) ++mismatches;
    if (to_bits(simt::round_bf16(x)) != static_cast<std::uint32_t>(host) << 16) ++mismatches;
  });
  CHECK(mismatches == 0);
  // Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7, and rounds to 1.
  CHECK(simt::round_bf16(1.00390625f) == 1.0f);
  CHECK(simt::round_bf16(1.01171875f) == 1.015625f);  // 1 + 3*2^-8 rounds up to even 1 + 2^-6
  CHECK(std::isnan(simt::round_bf16(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isnan(simt::from_bf16_bits(simt::to_bf16_bits(from_bits(0x7f800001u)))));  // sNaN
  CHECK(simt::round_bf16(3.4e38f) == std::numeric_limits<float>::infinity());
}

TEST_CASE("simt::fma rounds once; mul and add do not fuse") {
  // (1 + 2^-12)^2 - 1 - 2^-11 = 2^-24: exact with one rounding, 0 with two.
  const float a = 1.0f + 0x1p-12f;
  CHECK(simt::fma(a, a, -(1.0f + 0x1p-11f)) == 0x1p-24f);
  CHECK(simt::add(simt::mul(a, a), -(1.0f + 0x1p-11f)) == 0.0f);
  CHECK(simt::sqrt(2.0f) == std::sqrt(2.0f));
  CHECK(simt::div(1.0f, 3.0f) == 1.0f / 3.0f);
  CHECK(simt::rint(2.5f) == 2.0f);
  CHECK(simt::rint(3.5f) == 4.0f);
}

TEST_CASE("simt arithmetic makes the GPU's canonical NaN (0x7fffffff) of every NaN result") {
  // An H200 wrote 0x7fffffff for every NaN that sqrt and fma made in simt-gpu (2026-12-04); mul,
  // add and div follow PTX's f32 rule, not observed there. Payloads and the sign of x86's default
  // NaN are not kept, so the CPU executor must not keep them either.
  const float inf = std::numeric_limits<float>::infinity();
  const float payload = from_bits(0xffc01234u);  // a negative NaN with a payload
  const float results[] = {
      simt::sqrt(-1.0f),          simt::sqrt(payload),         simt::fma(payload, 2.0f, 1.0f),
      simt::fma(inf, 0.0f, 1.0f), simt::fma(-inf, -inf, -inf), simt::mul(0.0f, inf),
      simt::mul(payload, 1.0f),   simt::add(inf, -inf),        simt::add(1.0f, payload),
      simt::div(0.0f, 0.0f),      simt::div(payload, 2.0f)};
  for (float r : results) CHECK(to_bits(r) == 0x7fffffffu);
  // Numbers stay numbers (the canonicalisation touches NaN only).
  CHECK(to_bits(simt::sqrt(-0.0f)) == 0x80000000u);
  CHECK(simt::fma(inf, 1.0f, 1.0f) == inf);
  CHECK(simt::div(1.0f, 0.0f) == inf);
}
