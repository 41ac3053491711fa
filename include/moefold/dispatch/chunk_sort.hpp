//! @file chunk_sort.hpp
//! @brief Chunk sort and its inverse: rows split into consecutive chunks are re-concatenated in
//! another chunk order (after the All-to-All and AllGather, rows arrive ordered by (etp source,
//! ep source, local expert); the experts want them by (local expert, etp source, ep source)).
#pragma once

#include <cstddef>
#include <span>

#include "../core/expected.hpp"

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

//! out = concat(chunk order[0], chunk order[1], ...) of x split by `sizes` (rows of `width`
//! elements).  x [sum(sizes), width] -> out [sum(sizes), width]
template <class T>
[[nodiscard]] status sort_chunks(std::span<const int> sizes, std::span<const int> order,
                                 std::span<const T> x, int width, std::span<T> out) {
  if (auto s = check_chunk_order(sizes, order); !s) return s;
  std::size_t rows = 0;
  for (int v : sizes) rows += static_cast<std::size_t>(v);
  const auto w = static_cast<std::size_t>(width);
  if (width < 0 || x.size() != rows * w || out.size() != rows * w)
    return make_error(errc::shape_mismatch, "chunk sort: buffers do not hold sum(sizes) rows");
  std::size_t dst = 0;
  for (int c : order) {
    std::size_t src = 0;
    for (int d = 0; d < c; ++d) src += static_cast<std::size_t>(sizes[static_cast<std::size_t>(d)]);
    const std::size_t n = static_cast<std::size_t>(sizes[static_cast<std::size_t>(c)]) * w;
    for (std::size_t i = 0; i < n; ++i) out[dst + i] = x[src * w + i];
    dst += n;
  }
  return {};
}

//! The inverse of sort_chunks with the same `sizes` (of the unsorted input) and `order`.
template <class T>
[[nodiscard]] status unsort_chunks(std::span<const int> sizes, std::span<const int> order,
                                   std::span<const T> sorted, int width, std::span<T> out) {
  if (auto s = check_chunk_order(sizes, order); !s) return s;
  std::size_t rows = 0;
  for (int v : sizes) rows += static_cast<std::size_t>(v);
  const auto w = static_cast<std::size_t>(width);
  if (width < 0 || sorted.size() != rows * w || out.size() != rows * w)
    return make_error(errc::shape_mismatch, "chunk unsort: buffers do not hold sum(sizes) rows");
  std::size_t src = 0;
  for (int c : order) {
    std::size_t dst = 0;
    for (int d = 0; d < c; ++d) dst += static_cast<std::size_t>(sizes[static_cast<std::size_t>(d)]);
    const std::size_t n = static_cast<std::size_t>(sizes[static_cast<std::size_t>(c)]) * w;
    for (std::size_t i = 0; i < n; ++i) out[dst * w + i] = sorted[src + i];
    src += n;
  }
  return {};
}

}  // namespace moefold
