//! @file sequence_order.hpp
//! @brief Full-sequence dropping's true sequence order on an execution context: from the order
//! keys of the tp-cp group's M gathered tokens (sequence_order_keys: the key of a token is its
//! place in the group's sequences, so the group's keys are a permutation of [0, M)), each row's
//! rank in that order and the row at each rank, as kernels/capacity.hpp's keep_args take them
//! (order, by_order).
//!
//! The host policy (drop_policy_full_sequence.hpp) sorts any distinct keys; a kernel taking the
//! keys as the ranks themselves needs no sort and no float atomics: O(M) work in three launches,
//! in this order, each after the previous one's success:
//!   1. order_key_count_kernel: counts each key (integer atomics); a key outside [0, M) is a fault.
//!   2. order_key_check_kernel: a key that no row or more than one row holds is a fault.
//!   3. order_from_keys_kernel: order[i] = key[i], by_order[key[i]] = i; after a fault, the
//!      identity (the group's rank order) instead, so that every later index stays in bounds,
//!      and the fault kept in a sticky word the host reads when it asks (no wait here).
//!
//! Shapes: keys [M]; counts [M] (zeroed before launch 1); fault [2] (set to `none` before launch
//! 1): {lowest row whose key is outside [0, M), lowest key value held by no row or by two};
//! sticky [2] (the same, kept across forwards until the host reads and resets it); order,
//! by_order [M].
#pragma once

#include <cstdint>

#include <moefold/core/config.hpp>

namespace moefold::kernels {

//! The fault words' "no fault" value (INT_MAX: atomic_min keeps the lowest fault).
inline constexpr int order_fault_none = 2147483647;

struct order_key_args {
  const std::int64_t* keys;  //!< [M] the group's gathered keys
  long long rows;            //!< M
  int* counts;               //!< [M] rows holding each key value
  int* fault;                //!< [2] this launch sequence's faults
  int* sticky;               //!< [2] faults since the host last read them
  long long* order;          //!< [M] row -> rank in true order
  long long* by_order;       //!< [M] rank -> row
};

//! Launch 1: one thread per row (grid-strided).
struct order_key_count_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "order_key_count";
  order_key_args a;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (long long i = static_cast<long long>(c.block()) * block_threads + c.thread(); i < a.rows;
         i += static_cast<long long>(c.grid_blocks()) * block_threads) {
      const std::int64_t k = a.keys[i];
      if (k >= 0 && k < a.rows)
        c.atomic_add(&a.counts[k], 1);
      else
        c.atomic_min(&a.fault[0], static_cast<int>(i));  // M < 2^31: the caller's bound
    }
  }
};

//! Launch 2: one thread per key value (grid-strided).
struct order_key_check_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "order_key_check";
  order_key_args a;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (long long j = static_cast<long long>(c.block()) * block_threads + c.thread(); j < a.rows;
         j += static_cast<long long>(c.grid_blocks()) * block_threads)
      if (a.counts[j] != 1) c.atomic_min(&a.fault[1], static_cast<int>(j));
  }
};

//! Launch 3: one thread per row (grid-strided). Every thread reads the finished fault words
//! (written by the launches before), so all take the same branch.
struct order_from_keys_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "order_from_keys";
  order_key_args a;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const bool ok = a.fault[0] == order_fault_none && a.fault[1] == order_fault_none;
    const long long first = static_cast<long long>(c.block()) * block_threads + c.thread();
    if (!ok && first == 0) {
      c.atomic_min(&a.sticky[0], a.fault[0]);
      c.atomic_min(&a.sticky[1], a.fault[1]);
    }
    for (long long i = first; i < a.rows;
         i += static_cast<long long>(c.grid_blocks()) * block_threads) {
      if (ok) {
        const long long k = a.keys[i];
        a.order[i] = k;
        a.by_order[k] = i;
      } else {
        a.order[i] = i;
        a.by_order[i] = i;
      }
    }
  }
};

}  // namespace moefold::kernels
