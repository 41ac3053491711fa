//! @file permute.hpp
//! @brief The permutation kernel (a row gather): dst[r] = src[index[r] / divisor], a zero row where
//! index[r] == -1. The dispatcher's permute (slot -> token with divisor k), its chunk moves and
//! the backward of un-permute are this gather. Each source row is read once per destination row
//! and each destination row written once, by a whole block in 16-byte pieces when the rows allow
//! (kernels/simt/row_copy.hpp), else element by element.
//!
//! src [src_rows, width] (stride src_stride), index [rows] (stride index_stride), dst [rows, width]
#pragma once

#include <moefold/core/config.hpp>

#include "simt/row_copy.hpp"

namespace moefold::kernels {

template <class T>
struct gather_rows_kernel {
  //! One block per row at a time: 128 threads move 2 KiB per step in 16-byte pieces, a
  //! 4096-wide bf16 row in four steps.
  static constexpr int block_threads = 128;
  static constexpr const char* name = "gather_rows";

  const T* src;
  long long src_stride;
  int src_rows;
  const int* index;
  long long index_stride;
  int divisor;  //!< >= 1: index / divisor is the source row (k maps a slot to its token)
  T* dst;
  long long dst_stride;
  int rows, width;
  bool vec16;            //!< src and dst rows move as 16-byte pieces (simt::rows_vec16 of both)
  int* fault = nullptr;  //!< incremented per index outside [-1, src_rows * divisor) (row zeroed)

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const long long bound = static_cast<long long>(src_rows) * divisor;
    for (int r = c.block(); r < rows; r += c.grid_blocks()) {
      const int i = index[r * index_stride];
      T* d = dst + r * dst_stride;
      const bool bad = i < -1 || i >= bound;
      if (bad && c.thread() == 0) c.atomic_add(fault, 1);
      if (i < 0 || bad)
        simt::block_zero_row(c, d, width, vec16);
      else
        simt::block_copy_row(c, src + (i / divisor) * src_stride, d, width, vec16);
    }
  }
};

}  // namespace moefold::kernels
