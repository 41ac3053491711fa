// The host 16-bit float types: conversions against the compiler's own _Float16 and against the
// bit patterns of bfloat16 (upper half of a float, round to nearest even).
#include <moefold/core/dtype.hpp>

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

using namespace moefold;

static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2);
static_assert(dtype_of<float> == dtype::f32 && dtype_of<int> == dtype::i32 &&
              dtype_of<std::int64_t> == dtype::i64 && dtype_of<bfloat16> == dtype::bf16 &&
              dtype_of<float16> == dtype::f16 && dtype_of<double> == dtype::f64);
static_assert(std::is_same_v<accumulator_t<bfloat16>, float> &&
              std::is_same_v<accumulator_t<float16>, float> &&
              std::is_same_v<accumulator_t<int>, int>);
static_assert(reducible<float> && !reducible<bool> && transferable<bool>);

TEST_CASE("bfloat16: round to nearest even on the upper 16 bits") {
  // Reference: add half an ulp of bf16 plus the tie-breaking bit, by integer arithmetic on
  // 64 bits (so it cannot wrap), for a sweep of bit patterns.
  for (std::uint64_t u = 0; u < (1ull << 32); u += 65521) {
    const auto f = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    if (std::isnan(f)) {
      CHECK(std::isnan(static_cast<float>(bfloat16(f))));
      continue;
    }
    const std::uint64_t lower = u & 0xffffu, upper = u >> 16;
    std::uint64_t want = upper;
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++want;
    CHECK(bfloat16(f).bits == static_cast<std::uint16_t>(want));
  }
  CHECK(static_cast<float>(bfloat16(1.5f)) == 1.5f);
  CHECK(static_cast<float>(bfloat16(-3.0f)) == -3.0f);
}

#if defined(__FLT16_MAX__)
TEST_CASE("float16: equals the compiler's _Float16 conversion") {
  for (std::uint64_t u = 0; u < (1ull << 32); u += 4099) {
    const auto f = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    const auto ref = static_cast<_Float16>(f);
    const auto h = float16(f);
    if (std::isnan(f)) {
      CHECK(std::isnan(static_cast<float>(h)));
      continue;
    }
    CAPTURE(u);
    CHECK(h.bits == std::bit_cast<std::uint16_t>(ref));
  }
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = std::bit_cast<float16>(static_cast<std::uint16_t>(b));
    const auto ref = std::bit_cast<_Float16>(static_cast<std::uint16_t>(b));
    const float f = static_cast<float>(h), g = static_cast<float>(ref);
    if (std::isnan(g))
      CHECK(std::isnan(f));
    else
      CHECK(std::bit_cast<std::uint32_t>(f) == std::bit_cast<std::uint32_t>(g));
  }
}
#endif
