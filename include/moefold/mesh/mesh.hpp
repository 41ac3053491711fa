//! @file mesh.hpp
//! @brief `mesh<Axes...>`: a grid of ranks over named axes, each size static or dynamic.
//!
//! Modelled on std::extents: only the dynamic sizes are stored (an all-static mesh is an empty
//! type), static sizes stay compile-time values, and conversions never lose a check. The first
//! declared axis varies fastest (Megatron's leftmost order token), so
//! `mesh<axis::tp<2>, axis::dp<>, axis::pp<4>>` puts rank = tp + 2 * (dp + DP * pp).
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <type_traits>

#include "../core/checked_int.hpp"
#include "../core/config.hpp"
#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "axis.hpp"
#include "group_list.hpp"

namespace moefold {
inline namespace v0_1 {

//! A set of axes, as a bit mask over axis_id (used to ask for groups at run time).
class axis_set {
 public:
  constexpr axis_set() = default;
  constexpr axis_set(std::initializer_list<axis_id> ids) noexcept {
    for (axis_id a : ids) bits_ |= bit(a);
  }
  [[nodiscard]] constexpr bool contains(axis_id a) const noexcept { return (bits_ & bit(a)) != 0; }
  [[nodiscard]] constexpr bool empty() const noexcept { return bits_ == 0; }
  constexpr axis_set& insert(axis_id a) noexcept {
    bits_ |= bit(a);
    return *this;
  }
  friend constexpr bool operator==(axis_set, axis_set) = default;

 private:
  static constexpr unsigned bit(axis_id a) noexcept { return 1u << static_cast<unsigned>(a); }
  unsigned bits_ = 0;
};

namespace detail {

// Storage for the dynamic sizes only; a dedicated empty type when there are none, because
// std::array<int, 0> is not an empty class in libstdc++ (mdspan's possibly_empty_array).
template <std::size_t N>
struct dynamic_sizes {
  std::array<int, N> v{};
  constexpr int operator[](std::size_t i) const noexcept { return v[i]; }
  constexpr int& operator[](std::size_t i) noexcept { return v[i]; }
  friend constexpr bool operator==(const dynamic_sizes&, const dynamic_sizes&) = default;
};
template <>
struct dynamic_sizes<0> {
  constexpr int operator[](std::size_t) const noexcept { return 0; }
  friend constexpr bool operator==(const dynamic_sizes&, const dynamic_sizes&) = default;
};

template <class... Axes>
constexpr bool unique_axis_ids() {
  constexpr std::array<axis_id, sizeof...(Axes)> ids{Axes::id...};
  for (std::size_t i = 0; i < ids.size(); ++i)
    for (std::size_t j = i + 1; j < ids.size(); ++j)
      if (ids[i] == ids[j]) return false;
  return true;
}

}  // namespace detail

//! A grid of ranks over the axes `Axes...` (axis tags such as axis::tp<2> or axis::dp<>).
template <mesh_axis... Axes>
class mesh {
  static_assert(sizeof...(Axes) >= 1, "moefold: a mesh needs at least one axis");
  static_assert(sizeof...(Axes) <= max_grid_axes, "moefold: a mesh has at most 8 axes");
  static_assert(detail::unique_axis_ids<Axes...>(), "moefold: each axis may appear once in a mesh");

  static constexpr std::size_t n_ = sizeof...(Axes);
  static constexpr std::array<axis_id, n_> ids_{Axes::id...};
  static constexpr std::array<int, n_> static_sizes_{Axes::static_size...};
  static constexpr std::size_t n_dyn_ = ((Axes::static_size == dynamic ? 1u : 0u) + ...);
  // Slot of axis i in the dynamic storage (prefix count of dynamic axes before it).
  static constexpr std::array<std::size_t, n_> slot_ = [] {
    std::array<std::size_t, n_> s{};
    std::size_t d = 0;
    for (std::size_t i = 0; i < n_; ++i) {
      s[i] = d;
      if (static_sizes_[i] == dynamic) ++d;
    }
    return s;
  }();
  static constexpr long long static_product_ = [] {
    long long p = 1;
    for (int s : static_sizes_)
      if (s != dynamic) p *= s;
    return p;
  }();
  static_assert(static_product_ <= max_int,
                "moefold: the product of the static sizes of a mesh must fit in int");

 public:
  //! A coordinate: one index per axis, in declaration order.
  using coord_type = std::array<int, n_>;

  //! Number of axes (std::extents::rank()).
  [[nodiscard]] static constexpr std::size_t num_axes() noexcept { return n_; }
  //! Number of axes whose size is dynamic (std::extents::rank_dynamic()).
  [[nodiscard]] static constexpr std::size_t num_dynamic_axes() noexcept { return n_dyn_; }
  //! True when the mesh has the axis.
  [[nodiscard]] static constexpr bool has(axis_id a) noexcept {
    for (axis_id i : ids_)
      if (i == a) return true;
    return false;
  }
  //! Position of an axis in the declaration (and layout) order; -1 if absent.
  [[nodiscard]] static constexpr int index_of(axis_id a) noexcept {
    for (std::size_t i = 0; i < n_; ++i)
      if (ids_[i] == a) return static_cast<int>(i);
    return -1;
  }
  //! The axis at position i.
  [[nodiscard]] static constexpr axis_id axis(std::size_t i) noexcept { return ids_[i]; }

  //! Static size of axis A: N, moefold::dynamic, or 1 when the mesh lacks A (an absent axis is a
  //! size-1 axis, as in Megatron-Core).
  template <template <int> class A>
  [[nodiscard]] static constexpr int static_size() noexcept {
    constexpr int i = index_of(axis_id_of<A>);
    if constexpr (i < 0)
      return 1;
    else
      return static_sizes_[static_cast<std::size_t>(i)];
  }
  [[nodiscard]] static constexpr int static_size(axis_id a) noexcept {
    const int i = index_of(a);
    return i < 0 ? 1 : static_sizes_[static_cast<std::size_t>(i)];
  }
  //! True when every size is known at compile time.
  [[nodiscard]] static constexpr bool is_static() noexcept { return n_dyn_ == 0; }

  //! An all-static mesh needs no arguments.
  constexpr mesh() noexcept requires(n_dyn_ == 0) = default;

  //! Checked construction from the dynamic sizes only, or from all sizes (static positions are
  //! then checked against the type, never ignored). Sizes must be >= 1 and their product must fit
  //! in int.
  template <class... I>
  requires((std::is_integral_v<I> && ...) && (sizeof...(I) == n_dyn_ || sizeof...(I) == n_))
      [[nodiscard]] static constexpr expected<mesh> make(I... values) {
    const std::array<long long, sizeof...(I)> v{static_cast<long long>(values)...};
    mesh m{private_tag{}};
    long long product = 1;
    for (std::size_t i = 0, d = 0; i < n_; ++i) {
      long long s = 0;
      if constexpr (sizeof...(I) == n_) {
        s = v[i];
        if (static_sizes_[i] != dynamic && s != static_sizes_[i])
          return make_error(errc::invalid_size, "mesh: axis " + std::string(to_string(ids_[i])) +
                                                    " is static " +
                                                    detail::to_decimal(static_sizes_[i]) + " but " +
                                                    detail::to_decimal(s) + " was given");
      } else {
        s = static_sizes_[i] != dynamic ? static_sizes_[i] : v[d++];
      }
      if (s < 1)
        return make_error(errc::invalid_size, "mesh: size of " + std::string(to_string(ids_[i])) +
                                                  " must be >= 1 (got " + detail::to_decimal(s) +
                                                  ")");
      if (s > max_int || (product *= s) > max_int)
        return make_error(errc::overflow, "mesh: the product of the sizes exceeds 2^31-1");
      if constexpr (n_dyn_ > 0)
        if (static_sizes_[i] == dynamic) m.dyn_[slot_[i]] = static_cast<int>(s);
    }
    return m;
  }

  //! A mesh of the same axes with other static/dynamic choices, when it exists: static to dynamic
  //! always works; dynamic to static is checked.
  template <class Other>
  [[nodiscard]] static constexpr expected<mesh> from(const Other& o) {
    static_assert(Other::num_axes() == n_, "moefold: meshes of different axes");
    return from_impl(o, std::make_index_sequence<n_>{});
  }

  //! Size of axis A: std::integral_constant<int, N> when static, int when dynamic, and
  //! std::integral_constant<int, 1> when the mesh lacks A.
  template <template <int> class A>
  [[nodiscard]] constexpr auto size() const noexcept {
    constexpr int i = index_of(axis_id_of<A>);
    if constexpr (i < 0) {
      return std::integral_constant<int, 1>{};
    } else if constexpr (static_sizes_[static_cast<std::size_t>(i)] != dynamic) {
      return std::integral_constant<int, static_sizes_[static_cast<std::size_t>(i)]>{};
    } else {
      return dyn_[slot_[static_cast<std::size_t>(i)]];
    }
  }
  //! Size of an axis chosen at run time (1 when the mesh lacks it).
  [[nodiscard]] constexpr int size(axis_id a) const noexcept {
    const int i = index_of(a);
    return i < 0 ? 1 : size_at(static_cast<std::size_t>(i));
  }
  //! Size of the axis at position i.
  [[nodiscard]] constexpr int size_at(std::size_t i) const noexcept {
    return static_sizes_[i] != dynamic ? static_sizes_[i] : dyn_[slot_[i]];
  }
  //! Number of ranks: std::integral_constant when every size is static.
  [[nodiscard]] constexpr auto world_size() const noexcept {
    if constexpr (n_dyn_ == 0) {
      return std::integral_constant<int, static_cast<int>(static_product_)>{};
    } else {
      int p = 1;
      for (std::size_t i = 0; i < n_; ++i) p *= size_at(i);
      return p;
    }
  }

  //! The rank at a coordinate. Precondition: 0 <= coord[i] < size_at(i).
  [[nodiscard]] constexpr int rank_of(const coord_type& c) const noexcept {
    int r = 0;
    for (std::size_t i = n_; i-- > 0;) r = r * size_at(i) + c[i];
    return r;
  }
  //! The coordinate of a rank. Precondition: 0 <= rank < world_size().
  [[nodiscard]] constexpr coord_type coord_of(int rank) const noexcept {
    coord_type c{};
    for (std::size_t i = 0; i < n_; ++i) {
      c[i] = rank % size_at(i);
      rank /= size_at(i);
    }
    return c;
  }
  //! Checked versions of the two maps.
  [[nodiscard]] constexpr expected<int> checked_rank_of(const coord_type& c) const {
    for (std::size_t i = 0; i < n_; ++i)
      if (c[i] < 0 || c[i] >= size_at(i))
        return make_error(errc::rank_out_of_range,
                          "mesh: coordinate " + detail::to_decimal(c[i]) + " of axis " +
                              std::string(to_string(ids_[i])) + " is outside [0, " +
                              detail::to_decimal(size_at(i)) + ")");
    return rank_of(c);
  }
  [[nodiscard]] constexpr expected<coord_type> checked_coord_of(int rank) const {
    if (rank < 0 || rank >= static_cast<int>(world_size()))
      return make_error(errc::rank_out_of_range, "mesh: rank " + detail::to_decimal(rank) +
                                                     " is outside [0, " +
                                                     detail::to_decimal(world_size()) + ")");
    return coord_of(rank);
  }
  //! Coordinate of a rank along axis A.
  template <template <int> class A>
  [[nodiscard]] constexpr int coord(int rank) const noexcept {
    constexpr int i = index_of(axis_id_of<A>);
    if constexpr (i < 0)
      return 0;
    else
      return coord_of(rank)[static_cast<std::size_t>(i)];
  }

  //! The groups that vary along axes A... (each present in the mesh), listed as Megatron-Core's
  //! RankGenerator lists them for this layout.
  template <template <int> class... A>
  [[nodiscard]] constexpr group_list groups() const noexcept {
    static_assert(((index_of(axis_id_of<A>) >= 0) && ...),
                  "moefold: groups<...>() names an axis the mesh does not have");
    return group_list(detail::masked_groups(grid(), ((1u << index_of(axis_id_of<A>)) | ... | 0u)));
  }
  //! The groups that vary along the axes of `axes` (checked: every axis must be in the mesh).
  [[nodiscard]] constexpr expected<group_list> groups(axis_set axes) const {
    unsigned mask = 0;
    for (std::size_t i = 0; i < n_; ++i)
      if (axes.contains(ids_[i])) mask |= 1u << i;
    for (int a = 0; a < num_axis_ids; ++a)
      if (axes.contains(static_cast<axis_id>(a)) && !has(static_cast<axis_id>(a)))
        return make_error(errc::invalid_argument,
                          "mesh: groups over axis " +
                              std::string(to_string(static_cast<axis_id>(a))) +
                              ", which the mesh does not have");
    return group_list(detail::masked_groups(grid(), mask));
  }

  //! The grid of this mesh (sizes in layout order).
  [[nodiscard]] constexpr detail::grid grid() const noexcept {
    detail::grid g{};
    g.num_axes = static_cast<int>(n_);
    for (std::size_t i = 0; i < n_; ++i) g.sizes[i] = size_at(i);
    return g;
  }

  friend constexpr bool operator==(const mesh&, const mesh&) = default;

 private:
  struct private_tag {};
  constexpr explicit mesh(private_tag) noexcept {}

  template <class Other, std::size_t... I>
  static constexpr expected<mesh> from_impl(const Other& o, std::index_sequence<I...>) {
    static_assert(((Other::axis(I) == ids_[I]) && ...),
                  "moefold: converting between meshes needs the same axes in the same order");
    return make(o.size_at(I)...);
  }

  MOEFOLD_NO_UNIQUE_ADDRESS detail::dynamic_sizes<n_dyn_> dyn_{};
};

}  // namespace v0_1
}  // namespace moefold
