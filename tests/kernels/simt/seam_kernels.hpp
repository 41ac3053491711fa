// Kernels of the seam tests, one body for both executors: the CPU tests check them against
// host arithmetic, the GPU test against the CPU executor on the same inputs. The team bodies here
// (scan_kernel, histogram_kernel) divide their work by Ctx's team, so host_exec runs them too,
// with a team of one (tests/exec/cpu_launch_test.cpp checks what that gives); shuffle_kernel
// hard-codes 32-lane warps (a test of cpu_exec's and the GPU's warp semantics) and stays off
// host_exec.
#pragma once

#include <moefold/core/config.hpp>
#include <moefold/kernels/simt/block_scan.hpp>
#include <moefold/kernels/simt/math.hpp>
#include <moefold/kernels/simt/warp.hpp>

namespace moefold::test {

//! Independent threads: every thread writes its indices and the team size its context gives,
//! out[(block * 64 + thread) * 6 + {thread, block, grid_blocks, lane, warp, Ctx::block_threads}].
struct index_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "index_kernel";
  int* out;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    int* o = out + (c.block() * block_threads + c.thread()) * 6;
    o[0] = c.thread();
    o[1] = c.block();
    o[2] = c.grid_blocks();
    o[3] = c.lane();
    o[4] = c.warp();
    o[5] = Ctx::block_threads;
  }
};

//! Shuffles and ballots: out (blocks * 64, 7): xor 1,2,4,8,16; idx (lane*7+3)%32; a ballot.
//! Written for warps of 32 lanes in a block of 64 (lanes wrap modulo 32, warp 1's ballot): the
//! warp semantics of cpu_exec and the GPU, not a team body, so not a host_exec kernel.
struct shuffle_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "shuffle_kernel";
  unsigned* out;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const unsigned v = static_cast<unsigned>(c.block() * 1000 + c.thread() * 3 + 1);
    unsigned* o = out + (c.block() * block_threads + c.thread()) * 7;
    for (int i = 0; i < 5; ++i) o[i] = c.shfl_xor(v, 1 << i);
    o[5] = c.shfl_idx(v, c.lane() * 7 + 3);  // lanes >= 32 wrap modulo 32, as on the GPU
    o[6] = c.ballot(c.lane() % 3 == 0 || c.warp() == 1);
  }
};

//! A warp sum and a block-wide exclusive scan of one value per thread (blocks * Threads), over
//! Ctx's team: on a team of one only thread 0 of each block runs, its value its warp sum and its
//! block's total, its exclusive sum 0.
template <int Threads, class T>
struct scan_kernel {
  static constexpr int block_threads = Threads;
  static constexpr bool cooperative = true;
  static constexpr const char* name = "scan_kernel";
  const T* in;
  T* exclusive;
  T* totals;
  T* warp_sums;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const int i = c.block() * Threads + c.thread();
    const T v = in[i];
    warp_sums[i] = kernels::simt::warp_sum(c, v);
    T total{};
    exclusive[i] = kernels::simt::block_exclusive_scan(c, v, c.template shared<T>(), total);
    totals[i] = total;
  }
};

//! A histogram through shared-memory integer atomics, then global ones (counts zeroed before),
//! over Ctx's team (a team of one counts its block's share alone): exact on every context.
struct histogram_kernel {
  static constexpr int block_threads = 128;
  static constexpr bool cooperative = true;
  static constexpr const char* name = "histogram_kernel";
  const int* ids;
  int n, bins;
  int* counts;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    constexpr int threads = Ctx::block_threads;
    int* local = c.template shared<int>();
    for (int b = c.thread(); b < bins; b += threads) local[b] = 0;
    c.sync();
    for (int i = c.block() * threads + c.thread(); i < n; i += c.grid_blocks() * threads)
      c.atomic_add(&local[ids[i]], 1);
    c.sync();
    for (int b = c.thread(); b < bins; b += threads)
      if (local[b] != 0) c.atomic_add(&counts[b], local[b]);
  }
};

//! 16-byte copies: chunks of 16 bytes, grid-strided. Independent threads (its own 32 per block
//! on every context: host_exec runs them as a loop).
struct copy16_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "copy16_kernel";
  const unsigned char* src;
  unsigned char* dst;
  int chunks;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (int i = c.block() * 32 + c.thread(); i < chunks; i += c.grid_blocks() * 32)
      c.store16(dst + 16 * i, c.load16(src + 16 * i));
  }
};

//! Applies moefold's math to each input: out (n, 5) = exp, log, sqrt, bf16 round, fma(x, x, -1).
struct math_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "math_kernel";
  const float* in;
  float* out;
  int n;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    namespace s = kernels::simt;
    for (int i = c.block() * block_threads + c.thread(); i < n;
         i += c.grid_blocks() * block_threads) {
      const float x = in[i];
      out[5 * i + 0] = s::exp(x);
      out[5 * i + 1] = s::log(x);
      out[5 * i + 2] = s::sqrt(x);
      out[5 * i + 3] = s::round_bf16(x);
      out[5 * i + 4] = s::fma(x, x, -1.0f);
    }
  }
};

}  // namespace moefold::test
