//! @file grouped_gemm.hpp
//! @brief The portable SIMT grouped GEMM of the reference expert: C_g = A_g B_g (or C_g += A_g B_g)
//! for every local expert g, tiled in shared memory (32 x 32 outputs per block of 256 threads,
//! K in steps of 16), fp32 accumulation (fp64 for fp64 operands). Reference quality, not the fast
//! path: a tensor-core expert replaces it on the GPU; this one gives the whole layer a correct path
//! on every executor.
//!
//! Each output is one chain of fma over k in ascending order (acc = fma(a_k, b_k, acc), from 0),
//! so its bits are fixed by the inputs alone: the CPU executor and the GPU agree bit for bit,
//! and so does a host loop of std::fma in the same order (the test's check).
//!
//! Grouping: the experts' rows are contiguous, group g holding rows [offsets[g], offsets[g+1]).
//! - rows_are_m (forward, data gradient): A and C are row-indexed over m (A (m, k) at
//!   a.data[(off_g + m) a.s0 + k a.s1]), B is per expert (B (k, n) at
//!   b.data[g b.group_stride + k b.s0 + n b.s1]); M is the group's row count.
//! - rows_are_k (weight gradient): A and B are row-indexed over k (A (m, k) at
//!   a.data[m a.s0 + (off_g + k) a.s1], B (k, n) at b.data[(off_g + k) b.s0 + n b.s1]), C is per
//!   expert (C (m, n) at c.data[g c.group_stride + m c.s0 + n c.s1]); K is the group's row count.
//! Strides express transposes: the experts' fc1 [F1, H] as B (k = h, n = c) is s0 = 1, s1 = H.
#pragma once

#include <cstddef>
#include <type_traits>

#include <moefold/core/config.hpp>
#include <moefold/core/dtype.hpp>

#include "simt/math.hpp"

namespace moefold::kernels {

//! The experts' row ranges as the GEMM takes them (64-bit) from a dispatch's (int) that stay on
//! the context: to[i] = from[i], [count] entries, a thread per entry (grid-strided).
struct widen_offsets_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "widen_offsets";
  const int* from;
  int count;
  long long* to;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (int i = c.block() * block_threads + c.thread(); i < count;
         i += c.grid_blocks() * block_threads)
      to[i] = from[i];
  }
};

//! Which dimension the experts' row ranges index.
enum class gemm_grouping : int { rows_are_m = 0, rows_are_k = 1 };

//! A strided operand: element (i, j) of group g at data[g group_stride + i s0 + j s1] when the
//! operand is per expert, with the group's first row added along its row-indexed dimension
//! otherwise (see the file comment).
template <class T>
struct gemm_operand {
  T* data;
  long long s0, s1;
  long long group_stride;  //!< per-expert operands only
};

template <class TA, class TB, class TC>
struct grouped_gemm_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;  // the block's tiles in shared memory
  static constexpr const char* name = "grouped_gemm";
  static constexpr int tile_m = 32, tile_n = 32, tile_k = 16;

  //! The accumulator: fp32, or fp64 when an operand is (the fp64 instantiation checks the
  //! expert's wiring against an fp64 reference with nothing but fp64 rounding in between).
  using acc_t =
      std::conditional_t<std::is_same_v<TA, double> || std::is_same_v<TB, double>, double, float>;

  //! Shared memory: one tile of A and one of B, widened to the accumulator (a column of padding
  //! against bank conflicts on the GPU).
  struct shared_state {
    acc_t a[tile_m][tile_k + 1];
    acc_t b[tile_k][tile_n + 1];
  };
  static constexpr std::size_t smem_bytes = sizeof(shared_state);

  gemm_grouping grouping;
  const long long* offsets;  //!< [groups + 1], rows of each expert (non-decreasing)
  int groups;
  int m, n, k;  //!< the fixed sizes (the grouped one, M or K, comes from offsets)
  gemm_operand<const TA> a;
  gemm_operand<const TB> b;
  gemm_operand<TC> c;
  bool accumulate;  //!< C += A B (weight gradients into their buffers) instead of C = A B

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& ctx) const {
    using moefold::detail::widen;
    shared_state& sh = *ctx.template shared<shared_state>();
    // The team's threads as a grid of ty_n x tx_n, each owning ri x rj outputs of the tile,
    // (ri ty + i, rj tx + j): 16 x 16 threads of 2 x 2 on a block of 256, one thread of all
    // 32 x 32 on a team of one. Each output adds its k in order: the same bits either way.
    constexpr int threads = Ctx::block_threads;
    constexpr int tx_n = threads >= 16 ? 16 : 1, ty_n = threads / tx_n;
    constexpr int ri = tile_m / ty_n, rj = tile_n / tx_n;
    static_assert(ty_n * ri == tile_m && tx_n * rj == tile_n, "the team covers the tile");
    const int tid = ctx.thread();
    const int ty = tid / tx_n, tx = tid % tx_n;
    const int tiles_n = (n + tile_n - 1) / tile_n;
    const bool by_m = grouping == gemm_grouping::rows_are_m;
    long long total = 0;
    for (int g = 0; g < groups; ++g) total += tiles_of(g, tiles_n);
    // Every thread of a block walks the same tiles: the barriers below stay in step.
    for (long long tile = ctx.block(); tile < total; tile += ctx.grid_blocks()) {
      int g = 0;
      long long rem = tile;
      while (rem >= tiles_of(g, tiles_n)) rem -= tiles_of(g, tiles_n), ++g;
      const long long first = offsets[g], rows = offsets[g + 1] - offsets[g];
      const long long mg = by_m ? rows : m, kg = by_m ? k : rows;
      const long long m0 = (rem / tiles_n) * tile_m, n0 = (rem % tiles_n) * tile_n;
      // The group's operands: the row-indexed ones moved to its first row.
      const TA* pa = by_m ? a.data + first * a.s0 : a.data + first * a.s1;
      const TB* pb = by_m ? b.data + g * b.group_stride : b.data + first * b.s0;
      TC* pc = by_m ? c.data + first * c.s0 : c.data + g * c.group_stride;

      acc_t acc[ri][rj];
      for (int i = 0; i < ri; ++i)
        for (int j = 0; j < rj; ++j) acc[i][j] = acc_t(0);
      for (long long k0 = 0; k0 < kg; k0 += tile_k) {
        for (int q = tid; q < tile_m * tile_k; q += threads) {
          const int i = q / tile_k, j = q % tile_k;
          const long long mi = m0 + i, kj = k0 + j;
          sh.a[i][j] = mi < mg && kj < kg ? acc_t(widen(pa[mi * a.s0 + kj * a.s1])) : acc_t(0);
        }
        for (int q = tid; q < tile_k * tile_n; q += threads) {
          const int i = q / tile_n, j = q % tile_n;
          const long long ki = k0 + i, nj = n0 + j;
          sh.b[i][j] = ki < kg && nj < n ? acc_t(widen(pb[ki * b.s0 + nj * b.s1])) : acc_t(0);
        }
        ctx.sync();
        // Only the k that exist: an fma with a padded 0 would turn an accumulated -0 into +0.
        const int steps = kg - k0 < tile_k ? static_cast<int>(kg - k0) : tile_k;
        for (int kk = 0; kk < steps; ++kk)
          for (int i = 0; i < ri; ++i)
            for (int j = 0; j < rj; ++j)
              acc[i][j] = simt::fma(sh.a[ri * ty + i][kk], sh.b[kk][rj * tx + j], acc[i][j]);
        ctx.sync();  // the tiles are read before the next step overwrites them
      }
      for (int i = 0; i < ri; ++i)
        for (int j = 0; j < rj; ++j) {
          const long long mi = m0 + ri * ty + i, nj = n0 + rj * tx + j;
          if (mi >= mg || nj >= n) continue;
          TC& out = pc[mi * c.s0 + nj * c.s1];
          const acc_t v = accumulate ? simt::add(acc_t(widen(out)), acc[i][j]) : acc[i][j];
          out = moefold::detail::narrow<TC>(static_cast<moefold::accumulator_t<TC>>(v));
        }
    }
  }

 private:
  // Output tiles of group g.
  [[nodiscard]] MOEFOLD_HOST_DEVICE long long tiles_of(int g, int tiles_n) const {
    const long long rows = grouping == gemm_grouping::rows_are_m ? offsets[g + 1] - offsets[g] : m;
    return (rows + tile_m - 1) / tile_m * tiles_n;
  }
};

}  // namespace moefold::kernels
