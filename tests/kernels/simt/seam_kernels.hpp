// Kernels of the seam tests, one body for both executors: the CPU tests check them against
// host arithmetic, the GPU test against the CPU executor on the same inputs.
#pragma once

#include <moefold/core/config.hpp>
#include <moefold/kernels/simt/block_scan.hpp>
#include <moefold/kernels/simt/math.hpp>
#include <moefold/kernels/simt/warp.hpp>

namespace moefold::test {

//! Shuffles and ballots: out (blocks * 64, 7): xor 1,2,4,8,16; idx (lane*7+3)%32; a ballot.
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

//! A warp sum and a block-wide exclusive scan of one value per thread (blocks * Threads).
template <int Threads, class T>
struct scan_kernel {
  static constexpr int block_threads = Threads;
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

//! A histogram through shared-memory integer atomics, then global ones (counts zeroed before).
struct histogram_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "histogram_kernel";
  const int* ids;
  int n, bins;
  int* counts;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    int* local = c.template shared<int>();
    for (int b = c.thread(); b < bins; b += block_threads) local[b] = 0;
    c.sync();
    for (int i = c.block() * block_threads + c.thread(); i < n;
         i += c.grid_blocks() * block_threads)
      c.atomic_add(&local[ids[i]], 1);
    c.sync();
    for (int b = c.thread(); b < bins; b += block_threads)
      if (local[b] != 0) c.atomic_add(&counts[b], local[b]);
  }
};

//! 16-byte copies: chunks of 16 bytes, grid-strided.
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
