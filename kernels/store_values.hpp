//! @file store_values.hpp
//! @brief Host values written into the context's memory by a kernel that carries them in its
//! parameters, instead of a host-to-device copy: a CUDA graph captures a kernel's parameters by
//! value, so the values replay as they were at capture and the host buffer they came from may be
//! rewritten at once (a copy from a pinned buffer would read it when the stream runs; a copy from
//! pageable memory cannot be captured at all). For the host's bookkeeping of the hot path: a
//! grouped GEMM's row ranges, a dispatch's chunk table, the first token of each source.
//!
//! One launch carries `capacity` values (2 KiB: within the 4 KiB every CUDA kernel may take);
//! longer arrays take several launches.
#pragma once

#include <moefold/core/config.hpp>

namespace moefold::kernels {

//! dst(i / width, i % width) = values[i - first] for i in [first, first + count).
//! dst [rows, width] with row stride `stride`.
template <class V>
struct store_values_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "store_values";
  static constexpr int capacity = static_cast<int>(2048 / sizeof(V));

  V values[capacity];
  V* dst;
  long long stride;
  int width;
  long long first;  //!< flat index of values[0] in dst
  int count;        //!< values in this launch, <= capacity

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (int i = c.block() * block_threads + c.thread(); i < count;
         i += c.grid_blocks() * block_threads) {
      const long long flat = first + i;
      dst[static_cast<long long>(flat / width) * stride + flat % width] = values[i];
    }
  }
};

}  // namespace moefold::kernels
