//! @file unpermute.hpp
//! @brief The un-permutation kernel (a weighted gather-sum): dst[t] = sum over j = 0..k-1, in
//! this order, of weight[t, j] * src[index[t, j]], formed in Acc (fp32 for 16-bit data) and
//! rounded to T once. A gather per output row: no atomics, so the sum is the same every run and
//! on every executor, bit for bit equal to the host's (products and sums rounded one at a time,
//! never fused: simt::mul and simt::add). index -1 contributes nothing; a row with no source is 0.
//!
//! src [src_rows, width], index [rows, k], weights [rows, k] or none, dst [rows, width]
#pragma once

#include <cstring>

#include <moefold/core/config.hpp>
#include <moefold/core/dtype.hpp>
#include <moefold/core/simt_launch.hpp>

#include "simt/math.hpp"

namespace moefold::kernels {

template <class T, class P, class Acc>
struct gather_sum_rows_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "gather_sum_rows";

  const T* src;
  long long src_stride;
  int src_rows;
  const int* index;
  long long index_stride;
  int k;
  const P* weights;  //!< null: every weight is 1
  long long weight_stride;
  T* dst;
  long long dst_stride;
  int rows, width;
  bool vec16;            //!< src and dst rows move as 16-byte pieces (simt::rows_vec16 of both)
  int* fault = nullptr;  //!< incremented per index outside [-1, src_rows) (treated as -1)

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (int t = c.block(); t < rows; t += c.grid_blocks()) {
      const int* idx = index + t * index_stride;
      const P* w = weights ? weights + t * weight_stride : nullptr;
      if (c.thread() == 0)
        for (int j = 0; j < k; ++j)
          if (idx[j] < -1 || idx[j] >= src_rows) c.atomic_add(fault, 1);
      T* d = dst + t * dst_stride;
      if (vec16) {
        // Each thread owns E = 16 / sizeof(T) consecutive columns: one 16-byte load per source.
        constexpr int E = static_cast<int>(16 / sizeof(T));
        const int pieces = width / E;
        for (int q = c.thread(); q < pieces; q += block_threads) {
          Acc acc[E];
          for (int e = 0; e < E; ++e) acc[e] = Acc(0);
          for (int j = 0; j < k; ++j) {
            if (idx[j] < 0 || idx[j] >= src_rows) continue;
            T v[E];
            const bytes16 b = c.load16(src + idx[j] * src_stride + q * E);
            std::memcpy(static_cast<void*>(v), &b, 16);  // T is trivially copyable
            for (int e = 0; e < E; ++e) acc[e] = term(acc[e], w, j, v[e]);
          }
          T out[E];
          for (int e = 0; e < E; ++e) out[e] = detail::narrow<T>(acc[e]);
          bytes16 b;
          std::memcpy(&b, static_cast<const void*>(out), 16);
          c.store16(d + q * E, b);
        }
      } else {
        for (int col = c.thread(); col < width; col += block_threads) {
          Acc acc = Acc(0);
          for (int j = 0; j < k; ++j) {
            if (idx[j] < 0 || idx[j] >= src_rows) continue;
            acc = term(acc, w, j, src[idx[j] * src_stride + col]);
          }
          d[col] = detail::narrow<T>(acc);
        }
      }
    }
  }

 private:
  //! acc + w[j] * v, each operation rounded once, in the host's order.
  MOEFOLD_HOST_DEVICE static Acc term(Acc acc, const P* w, int j, const T& x) {
    const Acc v = static_cast<Acc>(detail::widen(x));
    return w ? simt::add(acc, simt::mul(static_cast<Acc>(detail::widen(w[j])), v))
             : simt::add(acc, v);
  }
};

}  // namespace moefold::kernels
