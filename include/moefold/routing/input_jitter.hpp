//! @file input_jitter.hpp
//! @brief The router's input jitter (Switch Transformer, Megatron-Core `moe_input_jitter_eps`)
//! from a seeded, counter-based generator, so that the result depends on neither threads nor
//! call order.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "../core/counter_rng.hpp"
#include "../core/error.hpp"
#include "../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {

//! Uniform draw in [0, 1) for element `index` of stream `seed` (53 random bits; detail::mix64 is
//! counter-based, so element i's draw depends only on (seed, offset + i)).
[[nodiscard]] constexpr double jitter_uniform(std::uint64_t seed, std::uint64_t index) noexcept {
  return static_cast<double>(detail::mix64(detail::mix64(seed) ^ index) >> 11) * 0x1.0p-53;
}

//! Input jitter (Switch Transformer, Megatron-Core `moe_input_jitter_eps`): the router input is
//! multiplied elementwise by U(1 - eps, 1 + eps); the experts see the un-jittered tokens. Element
//! i uses draw (seed, offset + i): give each rank and micro-batch its own offset or seed.
//! x_out may alias x. 0 < eps < 1.
template <class T>
[[nodiscard]] status apply_input_jitter(std::span<const T> x, double eps, std::uint64_t seed,
                                        std::uint64_t offset, std::span<T> x_out) {
  if (!(eps > 0 && eps < 1))
    return make_error(errc::invalid_argument, "input jitter: eps must be in (0, 1)");
  if (x_out.size() != x.size())
    return make_error(errc::shape_mismatch, "input jitter: output size must equal input size");
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double u = jitter_uniform(seed, offset + i);
    x_out[i] = static_cast<T>(static_cast<double>(x[i]) * ((1.0 - eps) + 2.0 * eps * u));
  }
  return {};
}

}  // namespace v0_1
}  // namespace moefold
