// The experts' activations written from their definitions in fp64, for tests that check
// moefold's experts against a formula of their own (not against experts/activation.hpp).
#pragma once

#include <moefold/experts/activation.hpp>

#include <algorithm>
#include <cmath>

namespace moefold::test {

inline double act_ref(activation a, double x) {
  switch (a) {
    case activation::swiglu:
    case activation::silu: return x / (1 + std::exp(-x));
    case activation::geglu:
    case activation::gelu: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case activation::relu: return std::max(x, 0.0);
    case activation::squared_relu: return x > 0 ? x * x : 0.0;
  }
  return x;
}

// Its derivative, from the same definitions.
inline double act_ref_derivative(activation a, double x) {
  switch (a) {
    case activation::swiglu:
    case activation::silu: {
      const double s = 1 / (1 + std::exp(-x));
      return s * (1 + x * (1 - s));
    }
    case activation::geglu:
    case activation::gelu:
      return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) +
             x * std::exp(-x * x / 2) / std::sqrt(2 * 3.14159265358979323846);
    case activation::relu: return x > 0 ? 1.0 : 0.0;
    case activation::squared_relu: return x > 0 ? 2 * x : 0.0;
  }
  return 1.0;
}

inline constexpr activation all_acts[] = {activation::swiglu, activation::geglu,
                                          activation::gelu,   activation::silu,
                                          activation::relu,   activation::squared_relu};

}  // namespace moefold::test
