//! @file chunk_sort.hpp
//! @brief Chunk sort and its inverse: rows split into consecutive chunks are re-concatenated in
//! another chunk order (after the All-to-All and AllGather, rows arrive ordered by (etp source,
//! ep source, local expert); the experts want them by (local expert, etp source, ep source)).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "../core/expected.hpp"
#include "../core/host_exec.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"

namespace moefold {

//! Checks that `order` is a permutation of the chunks and that sizes are >= 0.
[[nodiscard]] inline status check_chunk_order(std::span<const int> sizes,
                                              std::span<const int> order) {
  using detail::to_decimal;
  if (sizes.size() != order.size())
    return make_error(errc::shape_mismatch, "chunk sort: " + to_decimal(sizes.size()) +
                                                " chunk sizes but " + to_decimal(order.size()) +
                                                " entries in the order");
  const std::size_t m = sizes.size();
  for (std::size_t c = 0; c < m; ++c) {
    if (sizes[c] < 0)
      return make_error(errc::invalid_size,
                        "chunk sort: chunk " + to_decimal(c) + " has size " + to_decimal(sizes[c]));
    const int o = order[c];
    if (o < 0 || static_cast<std::size_t>(o) >= m)
      return make_error(errc::invalid_argument,
                        "chunk sort: order names chunk " + to_decimal(o) + " of " + to_decimal(m));
    for (std::size_t d = 0; d < c; ++d)
      if (order[d] == o)
        return make_error(errc::invalid_argument,
                          "chunk sort: chunk " + to_decimal(o) + " appears twice in the order");
  }
  return {};
}

//! The chunk order that turns (t, j, l) into (l, t, j): chunk (t*EP + j)*L + l of the input is
//! placed at position (l*ETP + t)*EP + j.   order [ETP*EP*L]
inline void expert_major_chunk_order(int etp, int ep, int local_experts, std::span<int> order) {
  std::size_t pos = 0;
  for (int l = 0; l < local_experts; ++l)
    for (int t = 0; t < etp; ++t)
      for (int j = 0; j < ep; ++j) order[pos++] = (t * ep + j) * local_experts + l;
}

//! Chunk sizes in the sorted order: sorted_sizes[c] = sizes[order[c]].
inline void sorted_chunk_sizes(std::span<const int> sizes, std::span<const int> order,
                               std::span<int> sorted_sizes) {
  for (std::size_t c = 0; c < order.size(); ++c)
    sorted_sizes[c] = sizes[static_cast<std::size_t>(order[c])];
}

//! Where every chunk starts, in rows, before (src) and after (dst) the sort: src_offsets[c] is
//! the prefix sum of sizes at c, dst_offsets[c] the position of chunk c in the sorted order.
//! Computed once per dispatch; the sort and its inverse are then copy_chunks with the two arrays
//! swapped, O(rows).   sizes, order, src_offsets, dst_offsets [C]
inline void chunk_offsets(std::span<const int> sizes, std::span<const int> order,
                          std::span<int> src_offsets, std::span<int> dst_offsets) noexcept {
  int run = 0;
  for (std::size_t c = 0; c < sizes.size(); ++c) {
    src_offsets[c] = run;
    run += sizes[c];
  }
  run = 0;
  for (int c : order) {
    dst_offsets[static_cast<std::size_t>(c)] = run;
    run += sizes[static_cast<std::size_t>(c)];
  }
}

//! out rows [to[c], to[c] + sizes[c]) = x rows [from[c], from[c] + sizes[c]) for every chunk c
//! (rows of `width` elements; the chunks tile both buffers).  x, out [sum(sizes), width]
template <class T>
[[nodiscard]] status copy_chunks(std::span<const int> sizes, std::span<const int> from,
                                 std::span<const int> to, std::span<const T> x, int width,
                                 std::span<T> out) {
  std::size_t rows = 0;
  for (int v : sizes) rows += static_cast<std::size_t>(v);
  const auto w = static_cast<std::size_t>(width);
  if (width < 0 || rows > static_cast<std::size_t>(max_rows) || from.size() != sizes.size() ||
      to.size() != sizes.size() || x.size() != rows * w || out.size() != rows * w)
    return make_error(errc::shape_mismatch,
                      "copy_chunks: buffers must hold sum(sizes) rows and offsets one per chunk");
  const auto chunks = static_cast<int>(sizes.size()), n = static_cast<int>(rows);
  return host_exec{}.copy_chunks<T>(
      row_view<const T>(x.data(), n, width), row_view<const int>(sizes.data(), chunks, 1),
      row_view<const int>(from.data(), chunks, 1), row_view<const int>(to.data(), chunks, 1),
      row_view<T>(out.data(), n, width));
}

namespace detail {
// The offsets of a checked order, in a small stack-or-heap buffer (the public sort_chunks and
// unsort_chunks: tests and callers with a one-off order; the dispatcher keeps its own arrays).
template <class T, class F>
status with_chunk_offsets(std::span<const int> sizes, std::span<const int> order, F&& f) {
  if (auto s = check_chunk_order(sizes, order); !s) return s;
  std::vector<int> src(sizes.size()), dst(sizes.size());
  chunk_offsets(sizes, order, src, dst);
  return f(std::span<const int>(src), std::span<const int>(dst));
}
}  // namespace detail

//! out = concat(chunk order[0], chunk order[1], ...) of x split by `sizes` (rows of `width`
//! elements).  x [sum(sizes), width] -> out [sum(sizes), width]
template <class T>
[[nodiscard]] status sort_chunks(std::span<const int> sizes, std::span<const int> order,
                                 std::span<const T> x, int width, std::span<T> out) {
  return detail::with_chunk_offsets<T>(sizes, order, [&](auto src, auto dst) {
    return copy_chunks<T>(sizes, src, dst, x, width, out);
  });
}

//! The inverse of sort_chunks with the same `sizes` (of the unsorted input) and `order`.
template <class T>
[[nodiscard]] status unsort_chunks(std::span<const int> sizes, std::span<const int> order,
                                   std::span<const T> sorted, int width, std::span<T> out) {
  return detail::with_chunk_offsets<T>(sizes, order, [&](auto src, auto dst) {
    return copy_chunks<T>(sizes, dst, src, sorted, width, out);
  });
}

}  // namespace moefold
