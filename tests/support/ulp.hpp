// Distance in units in the last place between two floats: the count of representable floats
// from one to the other (0 for +0 and -0; a huge value across a sign change).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace moefold::test {

inline int ulp_distance(float a, float b) {
  std::int32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  if ((x < 0) != (y < 0)) return a == b ? 0 : 1 << 30;
  return std::abs(x - y);
}

}  // namespace moefold::test
