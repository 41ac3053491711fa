//! @file chunk_copy.hpp
//! @brief Chunk copies: dst rows [to[c], to[c] + sizes[c]) = src rows [from[c], from[c] +
//! sizes[c]) for every chunk c. The chunk sort by local expert after the expert-parallel
//! exchange, and its inverse with from and to swapped, are one such launch. Each row is moved by
//! a whole block (16-byte pieces when the rows allow).
//!
//! src, dst [rows, width]; sizes, from, to [chunks] (strides given)
#pragma once

#include <moefold/core/config.hpp>

#include "simt/row_copy.hpp"

namespace moefold::kernels {

template <class T>
struct copy_chunks_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "copy_chunks";

  const T* src;
  long long src_stride;
  const int* sizes;
  const int* from;
  const int* to;
  long long sizes_stride, from_stride, to_stride;
  int chunks;
  T* dst;
  long long dst_stride;
  int width;
  bool vec16;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    // The blocks share every chunk's rows, so a skewed chunk (one hot expert) still spreads
    // over the whole grid.
    for (int ch = 0; ch < chunks; ++ch) {
      const int n = sizes[ch * sizes_stride];
      const int f = from[ch * from_stride], t = to[ch * to_stride];
      for (int r = c.block(); r < n; r += c.grid_blocks())
        simt::block_copy_row(c, src + (f + r) * src_stride, dst + (t + r) * dst_stride, width,
                             vec16);
    }
  }
};

}  // namespace moefold::kernels
