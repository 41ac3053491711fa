//! @file block_scan.hpp
//! @brief A block-wide exclusive prefix sum of one value per thread, over a context: warp scans,
//! the warp totals through shared memory, a scan of those by warp 0 (a team of one: its value's
//! exclusive sum is 0, its total the value). The caller hands in the
//! scratch (CUB's TempStorage idiom: the kernel owns its shared-memory layout).
#pragma once

#include <moefold/core/config.hpp>

#include "warp.hpp"

namespace moefold::kernels::simt {

//! Shared memory block_exclusive_scan needs: one T per warp and one for the total.
template <class Ctx>
inline constexpr int block_scan_scratch = Ctx::block_threads / Ctx::warp_threads + 1;

//! The sum of v over threads 0..thread()-1 (thread 0 gets T{}); `total` gets the block's sum on
//! every thread. `scratch` holds block_scan_scratch<Ctx> elements of shared memory; it may be
//! reused as soon as this returns (the last barrier is inside). Integer sums are exact; float sums
//! are in a fixed order (lanes, then warps), the same on every executor.
template <class Ctx, class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE T block_exclusive_scan(Ctx& c, T v, T* scratch /* (warps + 1) */,
                                                         T& total) {
  constexpr int warps = Ctx::block_threads / Ctx::warp_threads;
  T warp_total{};
  const T in_warp = warp_exclusive_scan(c, v, warp_total);
  if (c.lane() == 0) scratch[c.warp()] = warp_total;
  c.sync();
  if (c.warp() == 0) {
    const T t = c.lane() < warps ? scratch[c.lane()] : T{};
    T all{};
    const T before = warp_exclusive_scan(c, t, all);
    if (c.lane() < warps) scratch[c.lane()] = before;
    if (c.lane() == 0) scratch[warps] = all;
  }
  c.sync();
  const T out = scratch[c.warp()] + in_warp;
  total = scratch[warps];
  c.sync();
  return out;
}

}  // namespace moefold::kernels::simt
