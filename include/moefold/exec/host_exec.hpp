//! @file host_exec.hpp
//! @brief host_exec: the execution context of host memory. Operations run as host loops and are
//! complete when they return; the row operations (gather_rows, gather_sum_rows, copy_chunks,
//! relabel, add, scale, fill) are those of exec/host_memory_ops.hpp.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <type_traits>

#include "exec.hpp"
#include "host_memory_ops.hpp"

namespace moefold {
inline namespace v0_1 {

struct host_exec : detail::host_memory_ops<host_exec, host_space> {
  using memory_space = host_space;
  static constexpr const char* name = "host_exec";

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
  [[nodiscard]] status synchronize() const { return {}; }
};

static_assert(execution_context<host_exec>);

}  // namespace v0_1
}  // namespace moefold
