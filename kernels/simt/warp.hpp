//! @file warp.hpp
//! @brief Warp-wide reductions and scans over a context's full-mask shuffles: the same code on
//! cpu_exec and cuda_exec, in a fixed order of operations, so float results are the same bits on
//! both (and on every lane for the reductions: the butterfly adds the same two partial sums on
//! both lanes of each pair, and IEEE addition is commutative). Over Ctx::warp_threads lanes: on a
//! host context's team of one (warp_threads 1) each is the lane's own value, no shuffle.
#pragma once

#include <moefold/core/config.hpp>

namespace moefold::kernels::simt {

//! The sum over the warp's lanes, on every lane.
template <class Ctx, class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE T warp_sum(Ctx& c, T v) {
  for (int m = Ctx::warp_threads / 2; m >= 1; m /= 2) v = v + c.shfl_xor(v, m);
  return v;
}

//! The largest value over the warp's lanes, on every lane (NaN-free input).
template <class Ctx, class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE T warp_max(Ctx& c, T v) {
  for (int m = Ctx::warp_threads / 2; m >= 1; m /= 2) {
    const T o = c.shfl_xor(v, m);
    v = o > v ? o : v;
  }
  return v;
}

//! (value, index) of the largest value over the lanes, the lower index on a tie; on every lane.
//! The top-k of the router is k rounds of this.
template <class Ctx, class T>
MOEFOLD_HOST_DEVICE void warp_argmax(Ctx& c, T& v, int& i) {
  for (int m = Ctx::warp_threads / 2; m >= 1; m /= 2) {
    const T ov = c.shfl_xor(v, m);
    const int oi = c.shfl_xor(i, m);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

//! Inclusive prefix sum over lanes 0..lane() (Kogge-Stone: log2(warp_threads) shuffles).
template <class Ctx, class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE T warp_inclusive_scan(Ctx& c, T v) {
  const int lane = c.lane();
  for (int d = 1; d < Ctx::warp_threads; d *= 2) {
    const T o = c.shfl_idx(v, lane >= d ? lane - d : lane);
    if (lane >= d) v = v + o;
  }
  return v;
}

//! Exclusive prefix sum (lane 0 gets T{}); `total` gets the sum over all the warp's lanes.
template <class Ctx, class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE T warp_exclusive_scan(Ctx& c, T v, T& total) {
  const T inc = warp_inclusive_scan(c, v);
  total = c.shfl_idx(inc, Ctx::warp_threads - 1);
  return inc - v;
}

}  // namespace moefold::kernels::simt
