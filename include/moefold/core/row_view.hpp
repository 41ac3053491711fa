//! @file row_view.hpp
//! @brief row_view<T, Space>: the buffer type the dispatcher, the experts, the kernels and the
//! communicators exchange. Rows of `width` elements, `stride` elements apart (64-bit, so a view of
//! more than 2^31 elements is addressed correctly), in memory space `Space`.
//!
//! @code
//! std::vector<float> x(N * H);
//! row_view<float> v = host_rows(std::span(x), H);       // [N, H] in host memory
//! v(3, 0) = 1.f;                                         // host element access: host views only
//! row_view<const float> c = v.subrows(2, 4);             // rows [2, 6), read-only
//! row_view<float, device_space> d(ptr, N, H);             // device memory: no element access;
//! exec.copy(c, d.subrows(0, 4));                          // host code goes through a context
//! @endcode
//!
//! Counts of rows are int (errc::overflow at 2^31); offsets and sizes in elements or bytes are
//! std::int64_t. A view does not own its memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "config.hpp"
#include "expected.hpp"
#include "memory_space.hpp"
#include "size.hpp"

namespace moefold {
inline namespace v0_1 {

template <class T, memory_space Space = host_space>
class row_view {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using space = Space;

  constexpr row_view() noexcept = default;
  //! rows x width elements at data, row r at data + r * stride. Unchecked: the caller vouches
  //! for rows >= 0, width >= 0, stride >= width (make() checks).
  MOEFOLD_HOST_DEVICE constexpr row_view(T* data, int rows, int width, std::int64_t stride) noexcept
      : data_(data), rows_(rows), width_(width), stride_(stride) {}
  //! A contiguous view (stride == width).
  MOEFOLD_HOST_DEVICE constexpr row_view(T* data, int rows, int width) noexcept
      : row_view(data, rows, width, width) {}
  //! A view of non-const elements converts to a view of const ones.
  template <class U>
  requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>) MOEFOLD_HOST_DEVICE
      constexpr row_view(const row_view<U, Space>& o) noexcept
      : row_view(o.data(), o.rows(), o.width(), o.stride()) {}

  //! The checked constructor: rows, width >= 0; stride >= width (stride 0 or less: contiguous);
  //! rows < 2^31 and the extent in bytes within int64 (errc::overflow otherwise).
  [[nodiscard]] static expected<row_view> make(T* data, std::int64_t rows, std::int64_t width,
                                               std::int64_t stride = 0) {
    if (stride <= 0) stride = width;
    if (rows < 0 || width < 0 || stride < width)
      return make_error(errc::invalid_size,
                        "row_view: need rows >= 0, width >= 0 and stride >= "
                        "width (got rows " +
                            detail::to_decimal(rows) + ", width " + detail::to_decimal(width) +
                            ", stride " + detail::to_decimal(stride) + ")");
    if (rows > max_rows || width > max_rows)
      return make_error(errc::overflow, "row_view: " + detail::to_decimal(rows) + " rows of " +
                                            detail::to_decimal(width) +
                                            " elements: row counts and widths are below 2^31");
    if (rows > 0 && stride > (INT64_MAX / static_cast<std::int64_t>(sizeof(T))) / rows)
      return make_error(errc::overflow, "row_view: the extent does not fit in int64 bytes");
    return row_view(data, static_cast<int>(rows), static_cast<int>(width), stride);
  }

  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr int rows() const noexcept { return rows_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr int width() const noexcept { return width_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr std::int64_t stride() const noexcept {
    return stride_;
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr bool empty() const noexcept {
    return rows_ == 0 || width_ == 0;
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr bool contiguous() const noexcept {
    return stride_ == width_ || rows_ <= 1;
  }
  //! Elements from the first to one past the last (rows - 1) * stride + width; 0 when empty.
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr std::int64_t extent() const noexcept {
    return rows_ == 0 ? 0 : (static_cast<std::int64_t>(rows_) - 1) * stride_ + width_;
  }
  //! Bytes of extent().
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr std::int64_t extent_bytes() const noexcept {
    return extent() * static_cast<std::int64_t>(sizeof(T));
  }
  //! The element offset of (r, c) from data(): 64-bit arithmetic.
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr std::int64_t offset(int r, int c = 0) const noexcept {
    return static_cast<std::int64_t>(r) * stride_ + c;
  }
  //! The first element of row r (pointer arithmetic only: valid in every space).
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr T* row_data(int r) const noexcept {
    return data_ + offset(r);
  }
  //! Rows [first, first + count) (unchecked).
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr row_view subrows(int first,
                                                               int count) const noexcept {
    return row_view(rows_ == 0 ? data_ : row_data(first), count, width_, stride_);
  }
  //! The first `count` rows (unchecked).
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr row_view first(int count) const noexcept {
    return row_view(data_, count, width_, stride_);
  }

  // --- host element access: host memory only --------------------------------------------------

  //! Row r as a span of width() elements.
  [[nodiscard]] constexpr std::span<T> row(int r) const noexcept
      requires(host_accessible_v<Space>) {
    return {row_data(r), static_cast<std::size_t>(width_)};
  }
  //! Element (r, c).
  [[nodiscard]] constexpr T& operator()(int r, int c) const noexcept
      requires(host_accessible_v<Space>) {
    return data_[offset(r, c)];
  }
  //! All elements as one span (contiguous views only: rows * width elements).
  [[nodiscard]] constexpr std::span<T> flat() const noexcept requires(host_accessible_v<Space>) {
    return {data_, static_cast<std::size_t>(contiguous() ? extent() : 0)};
  }

 private:
  T* data_ = nullptr;
  int rows_ = 0;
  int width_ = 0;
  std::int64_t stride_ = 0;
};

//! A read-only view.
template <class T, memory_space Space = host_space>
using const_row_view = row_view<const T, Space>;

//! The contiguous host view [s.size() / width, width] of a span (width >= 1; a partial last row
//! is not part of the view; rows beyond 2^31 - 1 are cut off, so check make() for such sizes).
template <class T>
[[nodiscard]] constexpr row_view<T> host_rows(std::span<T> s, int width) noexcept {
  if (width < 1) return row_view<T>(s.data(), 0, 0);
  const std::size_t r = s.size() / static_cast<std::size_t>(width);
  return row_view<T>(
      s.data(), static_cast<int>(r > static_cast<std::size_t>(max_rows) ? max_rows : r), width);
}

//! Rows [r, r + n) of a view after checking they exist (errc::shape_mismatch names `what`).
template <class T, class S>
[[nodiscard]] expected<row_view<T, S>> checked_subrows(const row_view<T, S>& v, std::int64_t r,
                                                       std::int64_t n, const char* what) {
  if (r < 0 || n < 0 || r + n > v.rows())
    return make_error(errc::shape_mismatch, std::string(what) + ": rows [" + detail::to_decimal(r) +
                                                ", " + detail::to_decimal(r + n) +
                                                ") of a view of " + detail::to_decimal(v.rows()) +
                                                " rows");
  return v.subrows(static_cast<int>(r), static_cast<int>(n));
}

}  // namespace v0_1
}  // namespace moefold
