//! @file histogram.hpp
//! @brief The per-expert histogram of a routing record: counts[e] = entries naming expert e, with
//! integer atomics only (first in the block's shared memory, then one global add per expert and
//! block), so the counts are exact and the same on every executor. The first bad entry (the
//! lowest slot naming an id outside [-1, E), or, with topk > 1, an expert its token named in an
//! earlier slot) is found with an atomic min; -1 (a dropped or padding entry) is counted nowhere.
//! record_fault_kernel then turns that slot into (slot or -1, the id it names) in device memory,
//! where a header row carries it to the host with the counts (no read-back of its own).
//!
//! ids [n] (a contiguous [N, k] record), counts [E] (zeroed by the kernel's caller), smem: E ints.
#pragma once

#include <cstddef>

#include <moefold/core/config.hpp>

#include "record_pair.hpp"

namespace moefold::kernels {

struct expert_histogram_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;  // the block's counts in shared memory
  static constexpr const char* name = "expert_histogram";

  const int* ids;
  long long n;
  int num_experts;
  int* counts;     //!< [E], zero before the launch
  int* first_bad;  //!< lowest bad slot (see above); INT_MAX before the launch
  int topk = 1;  //!< k of the [N, k] record: a repeated expert within a token is bad (1: no check)

  //! Dynamic shared memory a launch needs.
  [[nodiscard]] static constexpr std::size_t smem_bytes(int experts) noexcept {
    return sizeof(int) * static_cast<std::size_t>(experts);
  }

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    int* local = c.template shared<int>();  // [E]
    constexpr int threads = Ctx::block_threads;
    for (int e = c.thread(); e < num_experts; e += threads) local[e] = 0;
    c.sync();
    const long long step = static_cast<long long>(c.grid_blocks()) * threads;
    for (long long s = static_cast<long long>(c.block()) * threads + c.thread(); s < n; s += step) {
      const int e = ids[s];
      if (bad_record_pair(ids, s, topk, num_experts))
        c.atomic_min(first_bad, static_cast<int>(s));
      else if (e >= 0)
        c.atomic_add(&local[e], 1);
    }
    c.sync();
    for (int e = c.thread(); e < num_experts; e += threads)
      if (local[e] != 0) c.atomic_add(&counts[e], local[e]);
  }
};

//! After expert_histogram_kernel: fault [2] = {slot, id} of the record's first bad entry, or
//! {-1, 0} when there is none (fault[0] holds the histogram's first_bad, INT_MAX: none). One
//! thread; a launch of one block.
struct record_fault_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "record_fault";

  const int* ids;
  int* fault;  //!< [2]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() != 0 || c.thread() != 0) return;
    const int slot = fault[0];
    const bool none = slot == 2147483647;
    fault[0] = none ? -1 : slot;
    fault[1] = none ? 0 : ids[slot];
  }
};

}  // namespace moefold::kernels
