// What the simt tests draw and how much of the matrix they run: the full matrix plain and under
// ASan, a reduced one (tokens <= 64) under TSan, where every thread is instrumented
// (MOEFOLD_SIMT_REDUCED, set by the build for the TSan program).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace moefold::test {

#if defined(MOEFOLD_SIMT_REDUCED)
inline constexpr bool simt_reduced = true;
#else
inline constexpr bool simt_reduced = false;
#endif

//! The seed of the random inputs: MOEFOLD_TEST_SEED when set (to replay a printed seed), else
//! drawn from the clock, so that every run sees fresh inputs. Tests print it with MESSAGE.
inline std::uint64_t simt_seed() {
  if (const char* s = std::getenv("MOEFOLD_TEST_SEED")) return std::stoull(s);
  static const std::uint64_t drawn =
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return drawn;
}

}  // namespace moefold::test
