//! @file chunk_table.hpp
//! @brief The chunk table of a pad-mode dispatch, written where the chunk copies read it. Every
//! chunk holds the capacity's rows, so its sizes and offsets follow from the fold alone: nothing
//! is written on the host and copied (a pinned host table rewritten by the next dispatch before
//! the stream has run this one's copy would race it). Chunk c = (t EP + j) L + l (ETP source t,
//! EP source j, local expert l) moves from rows c R to rows (l ETP EP + t EP + j) R, R rows per
//! chunk: the expert-major order of dispatch/chunk_sort.hpp.
//!
//! table [3, chunks] (row stride given): sizes, offsets before the sort, offsets after it.
#pragma once

#include <moefold/core/config.hpp>

namespace moefold::kernels {

//! The fold of a pad-mode chunk table (chunks = etp * ep * local_experts).
struct uniform_chunks {
  int etp = 1, ep = 1, local_experts = 1;
  int rows = 0;  //!< R: rows per chunk (the capacity)
  [[nodiscard]] MOEFOLD_HOST_DEVICE constexpr int chunks() const noexcept {
    return etp * ep * local_experts;
  }
};

//! Chunk c's size and offsets before and after the sort.
struct uniform_chunk_entry {
  int size, from, to;
};
[[nodiscard]] MOEFOLD_HOST_DEVICE constexpr uniform_chunk_entry uniform_chunk(
    const uniform_chunks& u, int c) noexcept {
  const int l = c % u.local_experts, source = c / u.local_experts;  // source = t EP + j
  return {u.rows, c * u.rows, (l * u.etp * u.ep + source) * u.rows};
}

struct uniform_chunk_table_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "uniform_chunk_table";

  uniform_chunks u;
  int* table;  //!< [3, chunks]
  long long stride;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const int step = c.grid_blocks() * block_threads;
    for (int i = c.block() * block_threads + c.thread(); i < u.chunks(); i += step) {
      const uniform_chunk_entry e = uniform_chunk(u, i);
      table[i] = e.size;
      table[stride + i] = e.from;
      table[2 * stride + i] = e.to;
    }
  }
};

}  // namespace moefold::kernels
