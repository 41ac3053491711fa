//! @file axis.hpp
//! @brief Axis tags of the attention and MoE meshes, each with a static or dynamic size.
#pragma once

#include <concepts>
#include <cstdint>
#include <string_view>

namespace moefold {
inline namespace v0_1 {

//! A size not known until run time (mdspan's dynamic_extent).
inline constexpr int dynamic = -1;

//! The seven parallel axes. Attention: tp, cp, dp, pp. MoE: etp, ep, edp, pp (pp is shared).
enum class axis_id : std::uint8_t { tp, cp, dp, pp, ep, etp, edp };

inline constexpr int num_axis_ids = 7;

[[nodiscard]] constexpr std::string_view to_string(axis_id a) noexcept {
  switch (a) {
    case axis_id::tp: return "tp";
    case axis_id::cp: return "cp";
    case axis_id::dp: return "dp";
    case axis_id::pp: return "pp";
    case axis_id::ep: return "ep";
    case axis_id::etp: return "etp";
    case axis_id::edp: return "edp";
  }
  return "?";
}

namespace detail {
template <axis_id Id, int N>
struct axis_base {
  static_assert(
      N == dynamic || N >= 1,
      "moefold: a static axis size must be >= 1 (use moefold::dynamic for run-time sizes)");
  static constexpr axis_id id = Id;
  static constexpr int static_size = N;  //!< N, or moefold::dynamic
};
}  // namespace detail

//! Axis tags. `axis::tp<2>` is tensor parallelism of static size 2, `axis::tp<>` of dynamic size.
namespace axis {
template <int N = dynamic>
struct tp : detail::axis_base<axis_id::tp, N> {};  //!< tensor
template <int N = dynamic>
struct cp : detail::axis_base<axis_id::cp, N> {};  //!< context
template <int N = dynamic>
struct dp : detail::axis_base<axis_id::dp, N> {};  //!< data
template <int N = dynamic>
struct pp : detail::axis_base<axis_id::pp, N> {};  //!< pipeline
template <int N = dynamic>
struct ep : detail::axis_base<axis_id::ep, N> {};  //!< expert
template <int N = dynamic>
struct etp : detail::axis_base<axis_id::etp, N> {};  //!< expert tensor
template <int N = dynamic>
struct edp : detail::axis_base<axis_id::edp, N> {};  //!< expert data
}  // namespace axis

//! A type usable as a mesh axis: one of the axis tags above (or a user type shaped like them).
template <class A>
concept mesh_axis = requires {
  { A::id } -> std::convertible_to<axis_id>;
  { A::static_size } -> std::convertible_to<int>;
};

//! The id of an axis tag template, whatever its size: `axis_id_of<axis::tp> == axis_id::tp`.
template <template <int> class A>
inline constexpr axis_id axis_id_of = A<dynamic>::id;

}  // namespace v0_1
}  // namespace moefold
