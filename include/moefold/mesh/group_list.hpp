//! @file group_list.hpp
//! @brief A list of process groups as a closed-form value: no allocation, usable in constant
//! expressions, rank `(g, k)` of any group computed on demand.
//!
//! Every group kind Megatron-Core builds is either a *masked orthogonal* slice of a grid
//! (`generate_masked_orthogonal_rank_groups`: fix some axes, vary the others) or a simple
//! rearrangement of one such list (first/last of each pipeline group, contiguous or strided
//! chunks, concatenations, hierarchical sub-groups). So one small descriptor covers all of them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/config.hpp"

namespace moefold {
inline namespace v0_1 {

//! The most axes a grid may have (the generators have five; a user mesh at most seven).
inline constexpr int max_grid_axes = 8;

namespace detail {

//! A grid of ranks: axis 0 varies fastest (Megatron's leftmost order token; mdspan's
//! layout_left). Sizes are >= 1 and their product fits in int (checked by whoever builds it).
struct grid {
  int num_axes = 0;
  std::array<int, max_grid_axes> sizes{};

  MOEFOLD_HOST_DEVICE constexpr int stride(int axis) const noexcept {
    int s = 1;
    for (int i = 0; i < axis; ++i) s *= sizes[static_cast<std::size_t>(i)];
    return s;
  }
  MOEFOLD_HOST_DEVICE constexpr int volume() const noexcept { return stride(num_axes); }
};

//! Megatron's masked orthogonal groups: the axes in `mask` vary inside a group, the others are
//! fixed per group. Groups are listed by the mixed-radix index of the fixed axes and ranks inside a
//! group by that of the varying axes; in both, the axis that comes first in the grid is the least
//! significant digit (megatron-rank-groups.md, section 2.3).
struct strided_groups {
  int offset = 0;
  int num_fixed = 0;
  int num_varying = 0;
  std::array<int, max_grid_axes> fixed_size{};
  std::array<int, max_grid_axes> fixed_stride{};
  std::array<int, max_grid_axes> varying_size{};
  std::array<int, max_grid_axes> varying_stride{};

  MOEFOLD_HOST_DEVICE constexpr int count() const noexcept {
    int c = 1;
    for (int i = 0; i < num_fixed; ++i) c *= fixed_size[static_cast<std::size_t>(i)];
    return c;
  }
  MOEFOLD_HOST_DEVICE constexpr int size() const noexcept {
    int c = 1;
    for (int i = 0; i < num_varying; ++i) c *= varying_size[static_cast<std::size_t>(i)];
    return c;
  }
  //! Rank k of group g (0 <= g < count(), 0 <= k < size()).
  MOEFOLD_HOST_DEVICE constexpr int rank(int g, int k) const noexcept {
    int r = offset;
    for (int i = 0; i < num_fixed; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      r += (g % fixed_size[ui]) * fixed_stride[ui];
      g /= fixed_size[ui];
    }
    for (int i = 0; i < num_varying; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      r += (k % varying_size[ui]) * varying_stride[ui];
      k /= varying_size[ui];
    }
    return r;
  }
};

//! Groups of `g` that vary along the axes whose bit is set in `mask`, ranks shifted by `offset`.
MOEFOLD_HOST_DEVICE constexpr strided_groups masked_groups(const grid& g, unsigned mask,
                                                           int offset = 0) noexcept {
  strided_groups s{};
  s.offset = offset;
  for (int i = 0; i < g.num_axes; ++i) {
    const auto ui = static_cast<std::size_t>(i);
    if (mask & (1u << i)) {
      s.varying_size[static_cast<std::size_t>(s.num_varying)] = g.sizes[ui];
      s.varying_stride[static_cast<std::size_t>(s.num_varying)] = g.stride(i);
      ++s.num_varying;
    } else {
      s.fixed_size[static_cast<std::size_t>(s.num_fixed)] = g.sizes[ui];
      s.fixed_stride[static_cast<std::size_t>(s.num_fixed)] = g.stride(i);
      ++s.num_fixed;
    }
  }
  return s;
}

//! No groups at all: one fixed axis of size 0 (count() == 0).
MOEFOLD_HOST_DEVICE constexpr strided_groups no_groups() noexcept {
  strided_groups s{};
  s.num_fixed = 1;
  s.fixed_size[0] = 0;
  s.fixed_stride[0] = 1;
  return s;
}

//! How a derived kind rearranges its source list S (count Sc groups of Ss ranks).
enum class derivation : std::uint8_t {
  none,            //!< S itself
  first_and_last,  //!< [S[g][0], S[g][Ss-1]], or [S[g][0]] when Ss == 1 (embedding groups)
  first,           //!< [S[g][0]] (position-embedding groups)
  chunks,          //!< each S[g] cut into `a` contiguous chunks, in order
  strided,         //!< each S[g] cut into Ss/a strided sets [S[g][u], S[g][u+s], ...] of a ranks
  concat,          //!< every `a` consecutive groups of S joined into one
  hierarchical,    //!< each S[g] viewed as (l, s, u), u fastest; one group per (l, u) along s
};

//! Forward iterator over positions 0..n-1 of a range that answers `range[i]` (a group_view's
//! ranks, a group_list's groups): one iterator type for both.
template <class Range, class Value>
class index_iterator {
 public:
  using value_type = Value;
  using difference_type = std::ptrdiff_t;
  constexpr index_iterator() = default;
  constexpr index_iterator(const Range* r, int i) noexcept : r_(r), i_(i) {}
  constexpr Value operator*() const noexcept { return (*r_)[i_]; }
  constexpr index_iterator& operator++() noexcept {
    ++i_;
    return *this;
  }
  constexpr index_iterator operator++(int) noexcept {
    index_iterator t = *this;
    ++i_;
    return t;
  }
  constexpr bool operator==(const index_iterator& o) const noexcept { return i_ == o.i_; }

 private:
  const Range* r_ = nullptr;
  int i_ = 0;
};

}  // namespace detail

class group_view;

//! A list of groups of equal size. `list(g, k)` is rank k of group g; `list[g]` is group g.
//! Groups are listed, and ranks inside a group ordered, exactly as Megatron-Core lists them.
class group_list {
 public:
  //! An empty list (no groups).
  constexpr group_list() = default;
  constexpr explicit group_list(const detail::strided_groups& source,
                                detail::derivation how = detail::derivation::none, int a = 1,
                                int b = 1, int c = 1) noexcept
      : src_(source), how_(how), a_(a), b_(b), c_(c) {}

  //! Number of groups.
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr int count() const noexcept {
    using detail::derivation;
    const int sc = src_.count(), ss = src_.size();
    switch (how_) {
      case derivation::none:
      case derivation::first_and_last:
      case derivation::first: return sc;
      case derivation::chunks: return sc * a_;
      case derivation::strided: return sc * (ss / a_);
      case derivation::concat: return sc / a_;
      case derivation::hierarchical: return sc * a_ * c_;
    }
    return 0;
  }
  //! Ranks per group (every group of a kind has the same size).
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr int group_size() const noexcept {
    using detail::derivation;
    const int ss = src_.size();
    switch (how_) {
      case derivation::none: return ss;
      case derivation::first_and_last: return ss > 1 ? 2 : 1;
      case derivation::first: return 1;
      case derivation::chunks: return ss / a_;
      case derivation::strided: return a_;
      case derivation::concat: return ss * a_;
      case derivation::hierarchical: return b_;
    }
    return 0;
  }
  //! Rank k of group g. Preconditions: 0 <= g < count(), 0 <= k < group_size().
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr int operator()(int g, int k) const noexcept {
    using detail::derivation;
    const int ss = src_.size();
    switch (how_) {
      case derivation::none: return src_.rank(g, k);
      case derivation::first_and_last: return src_.rank(g, k == 0 ? 0 : ss - 1);
      case derivation::first: return src_.rank(g, 0);
      case derivation::chunks: {  // a_ chunks of s = ss / a_ ranks
        const int s = ss / a_;
        return src_.rank(g / a_, (g % a_) * s + k);
      }
      case derivation::strided: {  // s = ss / a_ sets of a_ ranks, stride s
        const int s = ss / a_;
        return src_.rank(g / s, g % s + k * s);
      }
      case derivation::concat: return src_.rank(g * a_ + k / ss, k % ss);
      case derivation::hierarchical: {  // a_ = l (outer), b_ = s (group size), c_ = u (inner)
        const int per = a_ * c_;
        const int r = g % per;
        return src_.rank(g / per, ((r / c_) * b_ + k) * c_ + r % c_);
      }
    }
    return -1;
  }

  //! Group g (0 <= g < count()).
  [[nodiscard]] constexpr group_view operator[](int g) const noexcept;

  //! The group that holds `rank`, as {group index, position}; {-1, -1} if none does.
  struct location {
    int group = -1;
    int position = -1;
  };
  [[nodiscard]] constexpr location find(int rank) const noexcept {
    for (int g = 0; g < count(); ++g)
      for (int k = 0; k < group_size(); ++k)
        if ((*this)(g, k) == rank) return {g, k};
    return {};
  }

  //! All groups as vectors (for printing and comparing with test data).
  [[nodiscard]] std::vector<std::vector<int>> to_vectors() const {
    std::vector<std::vector<int>> out(static_cast<std::size_t>(count()));
    for (int g = 0; g < count(); ++g) {
      auto& v = out[static_cast<std::size_t>(g)];
      v.resize(static_cast<std::size_t>(group_size()));
      for (int k = 0; k < group_size(); ++k) v[static_cast<std::size_t>(k)] = (*this)(g, k);
    }
    return out;
  }

  //! Same groups, same order, same ranks in the same order.
  [[nodiscard]] friend constexpr bool operator==(const group_list& x,
                                                 const group_list& y) noexcept {
    if (x.count() != y.count() || x.group_size() != y.group_size()) return false;
    for (int g = 0; g < x.count(); ++g)
      for (int k = 0; k < x.group_size(); ++k)
        if (x(g, k) != y(g, k)) return false;
    return true;
  }

  //! Iterates the groups (each a group_view).
  using iterator = detail::index_iterator<group_list, group_view>;
  [[nodiscard]] constexpr iterator begin() const noexcept;
  [[nodiscard]] constexpr iterator end() const noexcept;

 private:
  detail::strided_groups src_ = detail::no_groups();
  detail::derivation how_ = detail::derivation::none;
  int a_ = 1, b_ = 1, c_ = 1;
};

//! One group of a group_list: its ranks as a random-access sequence. It holds a copy of its list
//! (a few hundred bytes, no allocation), so it stays valid after the list that made it is gone.
class group_view {
 public:
  constexpr group_view(const group_list& list, int index) noexcept : list_(list), index_(index) {}

  [[nodiscard]] constexpr int size() const noexcept { return list_.group_size(); }
  [[nodiscard]] constexpr int operator[](int k) const noexcept { return list_(index_, k); }
  [[nodiscard]] constexpr int index() const noexcept { return index_; }
  [[nodiscard]] constexpr bool contains(int rank) const noexcept {
    for (int k = 0; k < size(); ++k)
      if ((*this)[k] == rank) return true;
    return false;
  }
  [[nodiscard]] std::vector<int> to_vector() const {
    std::vector<int> v(static_cast<std::size_t>(size()));
    for (int k = 0; k < size(); ++k) v[static_cast<std::size_t>(k)] = (*this)[k];
    return v;
  }

  using iterator = detail::index_iterator<group_view, int>;
  [[nodiscard]] constexpr iterator begin() const noexcept { return {this, 0}; }
  [[nodiscard]] constexpr iterator end() const noexcept { return {this, size()}; }

 private:
  group_list list_;
  int index_;
};

constexpr group_view group_list::operator[](int g) const noexcept { return {*this, g}; }

constexpr group_list::iterator group_list::begin() const noexcept { return {this, 0}; }
constexpr group_list::iterator group_list::end() const noexcept { return {this, count()}; }

}  // namespace v0_1
}  // namespace moefold
