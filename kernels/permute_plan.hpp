//! @file permute_plan.hpp
//! @brief The permutation plan builder (dispatch/permute.hpp's basic_permute_plan) as kernels: a
//! stable counting sort of a routing record's pairs by expert, token order kept inside an
//! expert, in pad mode capacity rows per expert and source. Integer work only, in a fixed
//! decomposition, so the plan is the host builder's, entry for entry, on every executor.
//!
//! Four launches over tiles of 256 consecutive pairs (slot s = t k + j):
//! 1. plan_tile_counts_kernel: per tile and expert, the pairs naming it (shared-memory integer
//!    atomics), and the record's checks: the lowest slot naming an id outside [-1, E) or an
//!    expert its token already named goes to fault[0] (atomic min).
//! 2. plan_tile_scan_kernel: per expert, the tiles' counts turned into exclusive prefixes in tile
//!    order (each tile's base), the expert's total into counts.
//! 3. plan_offsets_kernel: first row of each expert (the totals', or capacity x sources, in
//!    pad mode); row_slot [rows] set to -1 (padding rows stay -1).
//! 4. plan_rows_kernel: each pair's rank among its expert's pairs = its tile's base + the pairs
//!    of that expert before it in the tile (read from shared memory); its row from the offsets
//!    (in pad mode the rank within its source, the lowest slot beyond capacity to fault[1], that
//!    pair left unplaced); slot_row and row_slot written. A record launch 1 found faulty gets
//!    no rows (every slot_row -1).
//!
//! expert [N k]; tile_counts [tiles, E] (tiles = ceil(N k / 256)); counts [E]; offsets [E + 1];
//! row_slot [rows]; slot_row [N k]; source_first [sources + 1] (pad mode with several sources:
//! each source's first token, then N; else null); fault [2], INT_MAX before launch 1.
#pragma once

#include <climits>
#include <cstddef>

#include <moefold/core/config.hpp>

#include "record_pair.hpp"

namespace moefold::kernels {

//! What the four launches share.
struct plan_args {
  const int* expert;
  int num_tokens, topk, num_experts;
  int capacity;  //!< pad mode: rows per expert and source (>= 0); -1: no padding
  int num_sources;
  const int* source_first;  //!< [num_sources + 1] or null (one source)
  int rows;                 //!< rows of the permuted buffer (routed pairs, or capacity E sources)
  int* tile_counts;
  int* counts;
  int* offsets;
  int* row_slot;
  int* slot_row;
  int* fault;

  static constexpr int tile = 256;
  [[nodiscard]] MOEFOLD_HOST_DEVICE long long slots() const {
    return static_cast<long long>(num_tokens) * topk;
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE long long tiles() const { return (slots() + tile - 1) / tile; }
  //! Tiles of a record of n pairs.
  [[nodiscard]] static constexpr long long tiles_of(long long n) { return (n + tile - 1) / tile; }
};

//! Launch 1: per-tile expert counts and the record's checks. A block per tile (grid-strided);
//! shared memory: E ints (smem_bytes(E)).
struct plan_tile_counts_kernel {
  static constexpr int block_threads = plan_args::tile;
  static constexpr bool cooperative = true;  // the tile's counts in shared memory
  static constexpr const char* name = "plan_tile_counts";
  [[nodiscard]] static constexpr std::size_t smem_bytes(int experts) noexcept {
    return sizeof(int) * static_cast<std::size_t>(experts);
  }
  plan_args a;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    int* local = c.template shared<int>();  // [E]
    const int E = a.num_experts, k = a.topk;
    for (long long tile = c.block(); tile < a.tiles(); tile += c.grid_blocks()) {
      for (int e = c.thread(); e < E; e += Ctx::block_threads) local[e] = 0;
      c.sync();
      // The tile's slots, one per thread of a block (all of them on a team of one).
      for (int i = c.thread(); i < plan_args::tile; i += Ctx::block_threads) {
        const long long s = tile * plan_args::tile + i;
        if (s >= a.slots()) break;
        const int e = a.expert[s];
        if (bad_record_pair(a.expert, s, k, E))
          c.atomic_min(&a.fault[0], static_cast<int>(s));
        else if (e >= 0)
          c.atomic_add(&local[e], 1);
      }
      c.sync();
      for (int e = c.thread(); e < E; e += Ctx::block_threads)
        a.tile_counts[tile * E + e] = local[e];
      c.sync();  // local is zeroed for the next tile only after every thread has read it
    }
  }
};

//! Launch 2: a thread per expert turns its column of tile counts into exclusive prefixes (the
//! tiles' bases) and writes its total.
struct plan_tile_scan_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "plan_tile_scan";
  plan_args a;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const int E = a.num_experts;
    for (int e = c.block() * block_threads + c.thread(); e < E;
         e += c.grid_blocks() * block_threads) {
      int running = 0;
      for (long long tile = 0; tile < a.tiles(); ++tile) {
        const int n = a.tile_counts[tile * E + e];
        a.tile_counts[tile * E + e] = running;
        running += n;
      }
      a.counts[e] = running;
    }
  }
};

//! Launch 3: the experts' first rows (one thread: E additions in order) and row_slot set to -1.
struct plan_offsets_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "plan_offsets";
  plan_args a;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() == 0 && c.thread() == 0) {
      const int per = a.capacity >= 0 ? a.capacity * (a.num_sources > 1 ? a.num_sources : 1) : 0;
      a.offsets[0] = 0;
      for (int e = 0; e < a.num_experts; ++e)
        a.offsets[e + 1] = a.offsets[e] + (a.capacity >= 0 ? per : a.counts[e]);
    }
    for (long long r = static_cast<long long>(c.block()) * block_threads + c.thread(); r < a.rows;
         r += static_cast<long long>(c.grid_blocks()) * block_threads)
      a.row_slot[r] = -1;
  }
};

//! Launch 4: each pair's row. A block per tile (grid-strided), the tile's record in shared
//! memory (plan_args::tile ints).
struct plan_rows_kernel {
  static constexpr int block_threads = plan_args::tile;
  static constexpr bool cooperative = true;  // the tile's record in shared memory
  static constexpr const char* name = "plan_rows";
  static constexpr std::size_t smem_bytes = sizeof(int) * plan_args::tile;
  plan_args a;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    int* ids = c.template shared<int>();  // [tile]: the tile's record
    const int E = a.num_experts;
    // A record launch 1 found faulty (a bad id or a repeated expert) gets no rows: launch 1 did
    // not count a repeat, so ranks here would collide (two slots writing one row). The fault is
    // what the caller reports; a plan from the record would be meaningless.
    if (a.fault[0] != INT_MAX) {
      for (long long s = static_cast<long long>(c.block()) * Ctx::block_threads + c.thread();
           s < a.slots(); s += static_cast<long long>(c.grid_blocks()) * Ctx::block_threads)
        a.slot_row[s] = -1;
      return;
    }
    for (long long tile = c.block(); tile < a.tiles(); tile += c.grid_blocks()) {
      const long long first = tile * plan_args::tile;
      // Slot first + i of the tile is thread i's (all of them a team of one's).
      for (int i = c.thread(); i < plan_args::tile; i += Ctx::block_threads)
        ids[i] = first + i < a.slots() ? a.expert[first + i] : -1;
      c.sync();
      for (int i = c.thread(); i < plan_args::tile; i += Ctx::block_threads) {
        const long long s = first + i;
        if (s >= a.slots()) break;
        const int e = ids[i];
        int row = -1;
        if (e >= 0 && e < E) {
          int rank = a.tile_counts[tile * E + e];  // pairs of e in the tiles before
          for (int q = 0; q < i; ++q) rank += ids[q] == e ? 1 : 0;
          if (a.capacity < 0) {
            row = a.offsets[e] + rank;
          } else {
            // Pad mode: the rank inside the pair's source, capacity rows per (expert, source).
            int source = 0;
            if (a.source_first != nullptr) {
              const int t = static_cast<int>(s / a.topk);
              while (t >= a.source_first[source + 1]) ++source;
            }
            const long long start = a.source_first != nullptr
                                        ? static_cast<long long>(a.source_first[source]) * a.topk
                                        : 0;
            const int in_source = rank - prefix(e, start);
            if (in_source >= a.capacity)
              c.atomic_min(&a.fault[1], static_cast<int>(s));
            else
              row = a.offsets[e] + source * a.capacity + in_source;
          }
        }
        a.slot_row[s] = row;
        if (row >= 0 && row < a.rows) a.row_slot[row] = static_cast<int>(s);
      }
      c.sync();  // ids is reloaded for the next tile only after every thread has read it
    }
  }

 private:
  // Pairs of expert e at slots before x.
  [[nodiscard]] MOEFOLD_HOST_DEVICE int prefix(int e, long long x) const {
    const long long tile = x / plan_args::tile;
    if (tile >= a.tiles()) return a.counts[e];
    int n = a.tile_counts[tile * a.num_experts + e];
    for (long long q = tile * plan_args::tile; q < x; ++q) n += a.expert[q] == e ? 1 : 0;
    return n;
  }
};

}  // namespace moefold::kernels
