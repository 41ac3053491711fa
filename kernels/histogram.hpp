//! @file histogram.hpp
//! @brief The per-expert histogram of a routing record: counts[e] = entries naming expert e, with
//! integer atomics only (first in the block's shared memory, then one global add per expert and
//! block), so the counts are exact and the same on every executor. The first entry outside
//! [-1, E) (the lowest slot) is found with an atomic min; -1 (a dropped or padding entry) is
//! counted nowhere.
//!
//! ids [n] (a contiguous [N, k] record), counts [E] (zeroed by the kernel's caller), smem: E ints.
#pragma once

#include <cstddef>

#include <moefold/core/config.hpp>

namespace moefold::kernels {

struct expert_histogram_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "expert_histogram";

  const int* ids;
  long long n;
  int num_experts;
  int* counts;     //!< [E], zero before the launch
  int* first_bad;  //!< lowest slot naming an expert outside [-1, E); INT_MAX before the launch

  //! Dynamic shared memory a launch needs.
  [[nodiscard]] static constexpr std::size_t smem_bytes(int experts) noexcept {
    return sizeof(int) * static_cast<std::size_t>(experts);
  }

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    int* local = c.template shared<int>();  // [E]
    for (int e = c.thread(); e < num_experts; e += block_threads) local[e] = 0;
    c.sync();
    const long long step = static_cast<long long>(c.grid_blocks()) * block_threads;
    for (long long s = static_cast<long long>(c.block()) * block_threads + c.thread(); s < n;
         s += step) {
      const int e = ids[s];
      if (e >= 0 && e < num_experts)
        c.atomic_add(&local[e], 1);
      else if (e != -1)
        c.atomic_min(first_bad, static_cast<int>(s));
    }
    c.sync();
    for (int e = c.thread(); e < num_experts; e += block_threads)
      if (local[e] != 0) c.atomic_add(&counts[e], local[e]);
  }
};

}  // namespace moefold::kernels
