//! @file scan.hpp
//! @brief A device-wide exclusive prefix sum of integers as three portable launches, the same code
//! on every executor (no inter-block communication inside a launch, which the CPU executor could
//! not run and a GPU runs only with decoupled look-back):
//!
//! 1. `scan_tiles_kernel`: each block scans its tiles of `tile` = block_threads x items elements
//!    into `out` (exclusive within the tile) and writes each tile's total to `tile_sums`;
//! 2. `scan_tile_sums_kernel`: one block scans `tile_sums` in place (exclusive), tile by tile,
//!    carrying the running total, and writes the grand total;
//! 3. `add_tile_offsets_kernel`: adds each tile's offset to its elements of `out`.
//!
//! Integers only: the result is exact, so it is the same whatever the order (and whatever the
//! team: a host context's team of one scans a tile serially).
//! in, out [n]; tile_sums [ceil(n / tile)]; total [1]
#pragma once

#include <moefold/core/config.hpp>

#include "simt/block_scan.hpp"

namespace moefold::kernels {

//! Elements each thread scans per tile.
inline constexpr int scan_items = 4;

struct scan_tiles_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;
  static constexpr const char* name = "scan_tiles";
  static constexpr long long tile = static_cast<long long>(block_threads) * scan_items;
  const int* in;
  int* out;
  long long n;
  int* tile_sums;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const long long tiles = (n + tile - 1) / tile;
    for (long long t = c.block(); t < tiles; t += c.grid_blocks()) {
      // Thread i owns elements [i * items, (i + 1) * items) of the tile: a serial sum, then the
      // block scan of the per-thread sums (items: scan_items on a block of block_threads, the
      // whole tile on a team of one).
      constexpr int items = static_cast<int>(tile / Ctx::block_threads);
      const long long base = t * tile + static_cast<long long>(c.thread()) * items;
      // The thread's elements inside [0, n): the loops stop there (a constant bound and a break,
      // so that a GPU keeps v in registers; a team of one does not walk a whole tile for a few
      // elements).
      const long long left = n - base;
      const int live = left <= 0 ? 0 : left < items ? static_cast<int>(left) : items;
      int v[items];
      int own = 0;
      for (int j = 0; j < items; ++j) {
        if (j >= live) break;
        v[j] = in[base + j];
        own += v[j];
      }
      int total = 0;
      int run = simt::block_exclusive_scan(c, own, c.template shared<int>(), total);
      for (int j = 0; j < items; ++j) {
        if (j >= live) break;
        out[base + j] = run;
        run += v[j];
      }
      if (c.thread() == 0) tile_sums[t] = total;
    }
  }
};

struct scan_tile_sums_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;
  static constexpr const char* name = "scan_tile_sums";
  int* tile_sums;
  long long tiles;
  int* total;  //!< the sum of all elements
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    int carry = 0;  // the same on every thread: each adds every chunk's total
    for (long long b = 0; b < tiles; b += Ctx::block_threads) {
      const long long i = b + c.thread();
      const int v = i < tiles ? tile_sums[i] : 0;
      int chunk = 0;
      const int ex = simt::block_exclusive_scan(c, v, c.template shared<int>(), chunk);
      if (i < tiles) tile_sums[i] = carry + ex;
      carry += chunk;
    }
    if (c.thread() == 0) *total = carry;
  }
};

struct add_tile_offsets_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "add_tile_offsets";
  static constexpr long long tile = scan_tiles_kernel::tile;
  int* out;
  long long n;
  const int* tile_offsets;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const long long step = static_cast<long long>(c.grid_blocks()) * block_threads;
    for (long long i = static_cast<long long>(c.block()) * block_threads + c.thread(); i < n;
         i += step)
      out[i] += tile_offsets[i / tile];
  }
};

}  // namespace moefold::kernels
