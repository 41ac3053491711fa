//! @file host_exec.hpp
//! @brief host_exec: the execution context of host memory, the fast CPU path. Operations run as
//! host loops and are complete when they return: the row operations (gather_rows,
//! gather_sum_rows, copy_chunks, relabel, add, scale, fill) are those of exec/host_memory_ops.hpp,
//! and `launch(host_exec, grid, kernel)` runs a kernel body (kernels/*.hpp) as a loop, a team body
//! with a team of one thread (exec/host_launch.hpp).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <type_traits>

#include "../core/simt_launch.hpp"
#include "exec.hpp"
#include "host_launch.hpp"
#include "host_memory_ops.hpp"

namespace moefold {
inline namespace v0_1 {

struct host_exec : detail::host_memory_ops<host_exec, host_space> {
  using memory_space = host_space;
  static constexpr const char* name = "host_exec";
  //! Grid cap of the launches sized by capped_blocks (core/simt_launch.hpp): one block. Every body
  //! strides over its grid, so one block does all the work; more would only repeat what a block
  //! sets up (a histogram's per-block counts, a team's shared state) on one core.
  static constexpr int max_grid_blocks = 1;

  //! dst = src (same rows and width).
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, host_space> src, row_view<T, host_space> dst) const {
    if (auto st = detail::check_copy(src, dst, name); !st) return st;
    detail::host_copy_rows(src, dst);
    return {};
  }
  [[nodiscard]] expected<void*> allocate_bytes(std::size_t bytes) const {
    return detail::aligned_host_bytes(bytes, name);
  }
  void deallocate_bytes(void* p, std::size_t) const noexcept { detail::free_aligned_host_bytes(p); }
  [[nodiscard]] static constexpr detail::host_bytes_deallocator deallocator() noexcept {
    return {};
  }
  [[nodiscard]] status synchronize() const { return {}; }
};

//! Runs `kernel` on host memory (exec/host_launch.hpp): a loop over blocks and threads, a team body
//! with a team of one; returns when it is done.
template <class K>
requires simt_kernel<K>
[[nodiscard]] status launch(const host_exec&, const launch_grid& grid, const K& kernel) {
  return detail::host_run(host_exec::name, grid, kernel);
}

static_assert(execution_context<host_exec>);

}  // namespace v0_1
}  // namespace moefold
