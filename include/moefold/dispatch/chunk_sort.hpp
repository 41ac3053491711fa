//! @file chunk_sort.hpp
//! @brief Chunk sort and its inverse: rows split into consecutive chunks are re-concatenated in
//! another chunk order (after the All-to-All and AllGather, rows arrive ordered by (etp source,
//! ep source, local expert); the experts want them by (local expert, etp source, ep source)).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../exec/host_exec.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {

// The one pass of the order check, O(C): sizes[c] >= 0, order[c] names a chunk, and no chunk is
// named twice. mark(o) marks chunk o and says whether it was marked before. The first violation
// in the order of c is reported (the same error whatever storage the marks live in).
template <class Mark>
[[nodiscard]] status check_chunk_order_by(std::span<const int> sizes, std::span<const int> order,
                                          Mark&& mark) {
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
    if (mark(static_cast<std::size_t>(o)))
      return make_error(errc::invalid_argument,
                        "chunk sort: chunk " + to_decimal(o) + " appears twice in the order");
  }
  return {};
}

// Chunk counts up to which the convenient forms keep their scratch on the stack (a bitmap of
// 4096 bits for check_chunk_order, 2 x 256 offsets for sort_chunks / unsort_chunks).
inline constexpr std::size_t chunk_bitmap_stack = 4096;
inline constexpr std::size_t chunk_offsets_stack = 256;

}  // namespace detail

namespace dispatch {

//! Checks that `order` is a permutation of the chunks and that sizes are >= 0, in O(C): one pass
//! with a bitmap of the chunks seen (on the stack up to 4096 chunks, one allocation of C bits
//! beyond). Errors: errc::shape_mismatch (sizes and order differ in length), errc::invalid_size
//! (a negative size), errc::invalid_argument (a chunk out of range or named twice), each naming
//! the chunk.   sizes, order [C]
[[nodiscard]] inline status check_chunk_order(std::span<const int> sizes,
                                              std::span<const int> order) {
  constexpr std::size_t word = 64;
  std::array<std::uint64_t, detail::chunk_bitmap_stack / word> local{};
  std::vector<std::uint64_t> heap;
  std::span<std::uint64_t> bits(local);
  if (order.size() > detail::chunk_bitmap_stack) {
    heap.assign((order.size() + word - 1) / word, 0);
    bits = heap;
  }
  return detail::check_chunk_order_by(sizes, order, [&](std::size_t o) {
    const std::uint64_t bit = std::uint64_t{1} << (o % word);
    const bool seen = (bits[o / word] & bit) != 0;
    bits[o / word] |= bit;
    return seen;
  });
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

//! The checked chunk_offsets, in O(C) and without allocation: checks `order` and `sizes` as
//! check_chunk_order does (dst_offsets serves as the marks), that the chunks hold at most
//! max_rows rows (errc::overflow), then fills both arrays. On an error the arrays hold
//! unspecified values.   sizes, order, src_offsets, dst_offsets [C]
[[nodiscard]] inline status plan_chunk_offsets(std::span<const int> sizes,
                                               std::span<const int> order,
                                               std::span<int> src_offsets,
                                               std::span<int> dst_offsets) {
  using detail::to_decimal;
  if (src_offsets.size() != sizes.size() || dst_offsets.size() != sizes.size())
    return make_error(errc::shape_mismatch, "chunk sort: " + to_decimal(sizes.size()) +
                                                " chunks but offset arrays of " +
                                                to_decimal(src_offsets.size()) + " and " +
                                                to_decimal(dst_offsets.size()) + " entries");
  std::fill(dst_offsets.begin(), dst_offsets.end(), -1);
  const auto mark = [&](std::size_t o) {
    const bool seen = dst_offsets[o] == 0;
    dst_offsets[o] = 0;
    return seen;
  };
  if (auto s = detail::check_chunk_order_by(sizes, order, mark); !s) return s;
  std::int64_t rows = 0;
  for (int v : sizes) rows += v;  // a permutation of ints: C <= 2^31 terms, each < 2^31
  if (rows > max_rows)
    return make_error(errc::overflow, "chunk sort: the chunks hold " + to_decimal(rows) +
                                          " rows, more than max_rows (" + to_decimal(max_rows) +
                                          ")");
  chunk_offsets(sizes, order, src_offsets, dst_offsets);
  return {};
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

}  // namespace dispatch

namespace detail {
// The convenient forms: the offsets on the stack up to chunk_offsets_stack chunks, on the heap
// beyond (callers that sort often keep their own arrays and call the overloads that take them).
template <class F>
status with_chunk_offsets(std::span<const int> sizes, F&& f) {
  std::array<int, 2 * chunk_offsets_stack> local;
  std::vector<int> heap;
  std::span<int> both(local);
  if (sizes.size() > chunk_offsets_stack) {
    heap.resize(2 * sizes.size());
    both = heap;
  }
  return f(both.first(sizes.size()), both.subspan(sizes.size(), sizes.size()));
}
}  // namespace detail

namespace dispatch {

//! out = concat(chunk order[0], chunk order[1], ...) of x split by `sizes` (rows of `width`
//! elements): plan_chunk_offsets into the caller's arrays (O(C)), then one chunk copy (O(rows));
//! no allocation. Refused (nothing written to `out`): what plan_chunk_offsets refuses, and
//! buffers that do not hold sum(sizes) rows.
//! x [sum(sizes), width] -> out [sum(sizes), width]; src_offsets, dst_offsets [C] (scratch)
template <class T>
[[nodiscard]] status sort_chunks(std::span<const int> sizes, std::span<const int> order,
                                 std::span<const T> x, int width, std::span<T> out,
                                 std::span<int> src_offsets, std::span<int> dst_offsets) {
  if (auto s = plan_chunk_offsets(sizes, order, src_offsets, dst_offsets); !s) return s;
  return copy_chunks<T>(sizes, src_offsets, dst_offsets, x, width, out);
}

//! The inverse of sort_chunks with the same `sizes` (of the unsorted input) and `order`: the same
//! offsets, source and destination swapped.
//! sorted [sum(sizes), width] -> out [sum(sizes), width]; src_offsets, dst_offsets [C] (scratch)
template <class T>
[[nodiscard]] status unsort_chunks(std::span<const int> sizes, std::span<const int> order,
                                   std::span<const T> sorted, int width, std::span<T> out,
                                   std::span<int> src_offsets, std::span<int> dst_offsets) {
  if (auto s = plan_chunk_offsets(sizes, order, src_offsets, dst_offsets); !s) return s;
  return copy_chunks<T>(sizes, dst_offsets, src_offsets, sorted, width, out);
}

//! sort_chunks with its own offset arrays (on the stack up to 256 chunks, else allocated).
template <class T>
[[nodiscard]] status sort_chunks(std::span<const int> sizes, std::span<const int> order,
                                 std::span<const T> x, int width, std::span<T> out) {
  return detail::with_chunk_offsets(sizes, [&](std::span<int> src, std::span<int> dst) {
    return sort_chunks<T>(sizes, order, x, width, out, src, dst);
  });
}

//! unsort_chunks with its own offset arrays (on the stack up to 256 chunks, else allocated).
template <class T>
[[nodiscard]] status unsort_chunks(std::span<const int> sizes, std::span<const int> order,
                                   std::span<const T> sorted, int width, std::span<T> out) {
  return detail::with_chunk_offsets(sizes, [&](std::span<int> src, std::span<int> dst) {
    return unsort_chunks<T>(sizes, order, sorted, width, out, src, dst);
  });
}

}  // namespace dispatch

}  // namespace v0_1
}  // namespace moefold
