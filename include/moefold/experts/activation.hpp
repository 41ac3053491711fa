//! @file activation.hpp
//! @brief Expert activations and their derivatives (host reference); the enum naming them is
//! core/activation.hpp's.
#pragma once

#include <cmath>

#include "../core/activation.hpp"

namespace moefold {
inline namespace v0_1 {

//! The elementwise function applied to the gate (gated forms) or to the whole input.
template <class T>
[[nodiscard]] T activate(activation a, T x) noexcept {
  switch (a) {
    case activation::swiglu:
    case activation::silu: return x / (T(1) + std::exp(-x));
    case activation::geglu:
    case activation::gelu: return T(0.5) * x * (T(1) + std::erf(x / std::sqrt(T(2))));
    case activation::relu: return x > T(0) ? x : T(0);
    case activation::squared_relu: return x > T(0) ? x * x : T(0);
  }
  return x;
}

//! Its derivative.
template <class T>
[[nodiscard]] T activate_derivative(activation a, T x) noexcept {
  switch (a) {
    case activation::swiglu:
    case activation::silu: {
      const T s = T(1) / (T(1) + std::exp(-x));
      return s * (T(1) + x * (T(1) - s));
    }
    case activation::geglu:
    case activation::gelu: {
      const T pi = T(3.14159265358979323846);
      return T(0.5) * (T(1) + std::erf(x / std::sqrt(T(2)))) +
             x * std::exp(-x * x / T(2)) / std::sqrt(T(2) * pi);
    }
    case activation::relu: return x > T(0) ? T(1) : T(0);
    case activation::squared_relu: return x > T(0) ? T(2) * x : T(0);
  }
  return T(1);
}

}  // namespace v0_1
}  // namespace moefold
