//! @file router_init.hpp
//! @brief The upcycled router's initial weight [E, H] in fp32: normal(0, 0.02) from moefold's own
//! counter-based generator and Box-Muller transform, so the same seed gives the same router on
//! every rank, mapping and compiler, and in Python (tests/upcycle/router_init.py computes the same
//! values); the rows repeated within each virtual group (experts [i G, (i + 1) G) share row i, so
//! the G slices of one dense FFN always get equal logits). Or every row zero ("uniform").
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <span>

#include "../core/counter_rng.hpp"
#include "../core/expected.hpp"
#include "upcycle_options.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {
//! Draw i of the stream `seed`, as a double in (0, 1] (53 bits).
[[nodiscard]] constexpr double unit_draw(std::uint64_t seed, std::uint64_t i) noexcept {
  const std::uint64_t u = mix64(mix64(seed) + i);
  return static_cast<double>((u >> 11) + 1) * 0x1p-53;
}
}  // namespace detail

//! Standard normal number i of the stream `seed`: Box-Muller on draws 2j and 2j + 1 (j = i / 2),
//! the cosine branch for even i, the sine branch for odd i.
[[nodiscard]] inline double upcycle_normal(std::uint64_t seed, std::uint64_t i) noexcept {
  const std::uint64_t j = i / 2;
  const double r = std::sqrt(-2.0 * std::log(detail::unit_draw(seed, 2 * j)));
  const double a = 2.0 * std::numbers::pi * detail::unit_draw(seed, 2 * j + 1);
  return r * (i % 2 == 0 ? std::cos(a) : std::sin(a));
}

//! Standard deviation of the random router (Megatron-Core's init_method_std default).
inline constexpr double upcycle_router_std = 0.02;

//! Writes the router weight w [E, H] (row-major, fp32) for options `o` over a dense FFN of
//! hidden size `hidden`: element (q, h) of distinct row q = e / G is 0.02 * upcycle_normal(seed,
//! q * H + h) rounded once to fp32 (random), or 0 (uniform).
[[nodiscard]] inline status upcycle_router(const dense_ffn_shape& d, const upcycle_options& o,
                                           std::span<float> w) {
  if (auto st = detail::check_upcycle(d, o); !st) return st;
  const auto H = static_cast<std::size_t>(d.hidden), E = static_cast<std::size_t>(o.num_experts);
  if (w.size() != E * H)
    return make_error(errc::shape_mismatch,
                      "upcycle_router: the router weight must be [E, H] = " +
                          detail::to_decimal(static_cast<long long>(E * H)) + " elements, got " +
                          detail::to_decimal(static_cast<long long>(w.size())));
  const auto G = static_cast<std::size_t>(o.granularity);
  for (std::size_t e = 0; e < E; ++e)
    for (std::size_t h = 0; h < H; ++h)
      w[e * H + h] =
          o.init == router_init::uniform
              ? 0.0f
              : static_cast<float>(upcycle_router_std * upcycle_normal(o.seed, (e / G) * H + h));
  return {};
}

}  // namespace v0_1
}  // namespace moefold
