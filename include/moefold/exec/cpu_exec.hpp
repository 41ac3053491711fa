//! @file cpu_exec.hpp
//! @brief cpu_exec{seed}: the CPU executor, the execution context that runs the GPU code path on
//! the CPU. Its memory space is cpu_device_space: host memory that host code reaches only through
//! the executor's copies, which it counts (a test can state how many host<->device transfers a
//! step makes). Kernel bodies (kernels/*.hpp) run on it through `launch(cpu_exec, grid, kernel)`
//! (exec/cpu_launch.hpp says how); `seed` orders its blocks. Its row operations
//! (exec/simt_memory_ops.hpp) are device operations, not transfers: each is one launch of the
//! kernel a GPU runs for it.
//!
//! Memory it allocates is poisoned (every byte 0xFF: NaN for floats, -1 for ints), so reading an
//! element nothing wrote shows in a result instead of passing as a zero.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>

#include "../core/simt_launch.hpp"
#include "cpu_launch.hpp"
#include "exec.hpp"
#include "host_memory_ops.hpp"
#include "simt_memory_ops.hpp"

namespace moefold {
inline namespace v0_1 {

class cpu_exec : public detail::simt_memory_ops<cpu_exec, cpu_device_space> {
 public:
  using memory_space = cpu_device_space;
  static constexpr const char* name = "cpu_exec";
  //! The byte allocations are filled with.
  static constexpr unsigned char poison = 0xFF;
  //! The host can address this memory: the plan builders run as host code on it.
  static constexpr bool host_addressable_memory = true;
  //! Its operations are kernel launches (the bookkeeping builders pick their kernels then).
  static constexpr bool runs_kernels = true;
  //! Row operations check index arrays on the host before a launch (nothing is written then).
  static constexpr bool check_indices_first = true;
  //! The most blocks a row operation launches: every kernel body strides over its rows, so any
  //! grid is correct; a few blocks keep two of them running at once while each block start (a
  //! barrier of all its threads) stays cheap on the CPU.
  static constexpr int max_grid_blocks = 8;

  constexpr cpu_exec() noexcept = default;
  constexpr explicit cpu_exec(std::uint64_t seed) noexcept : seed_(seed) {}

  [[nodiscard]] constexpr std::uint64_t seed() const noexcept { return seed_; }
  //! The copies made so far.
  [[nodiscard]] const copy_counts& copies() const noexcept { return counts_; }
  void reset_copies() noexcept { counts_ = {}; }

  //! Host to device.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, host_space> src, row_view<T, memory_space> dst) {
    return copy_impl(src, dst, counts_.to_device, counts_.bytes_to_device);
  }
  //! Device to host.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, host_space> dst) {
    return copy_impl(src, dst, counts_.to_host, counts_.bytes_to_host);
  }
  //! Device to device.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, memory_space> dst) {
    return copy_impl(src, dst, counts_.on_device, counts_.bytes_on_device);
  }

  //! Device memory of the executor (256-byte aligned, poisoned).
  [[nodiscard]] expected<void*> allocate_bytes(std::size_t bytes) const {
    return detail::aligned_host_bytes(bytes, name, poison);
  }
  void deallocate_bytes(void* p, std::size_t) const noexcept { detail::free_aligned_host_bytes(p); }
  [[nodiscard]] static constexpr detail::host_bytes_deallocator deallocator() noexcept {
    return {};
  }
  [[nodiscard]] status synchronize() const { return {}; }

 private:
  template <class U, class S1, class T, class S2>
  status copy_impl(const row_view<U, S1>& src, const row_view<T, S2>& dst, long long& calls,
                   long long& bytes) {
    if (auto st = detail::check_copy(src, dst, name); !st) return st;
    detail::host_copy_rows(src, dst);
    ++calls;
    bytes += static_cast<long long>(src.rows()) * src.width() * static_cast<long long>(sizeof(T));
    return {};
  }

  std::uint64_t seed_ = 0;
  copy_counts counts_{};
};

//! Runs `kernel` on the CPU executor (exec/cpu_launch.hpp): every CUDA thread its own thread, two
//! blocks at once in the seed's order, shared memory poisoned; returns when it is done.
template <class K>
requires simt_kernel<K>
[[nodiscard]] status launch(const cpu_exec& exec, const launch_grid& grid, const K& kernel) {
  return detail::cpu_run(cpu_exec::name, exec.seed(), cpu_exec::poison, grid, kernel);
}

static_assert(execution_context<cpu_exec>);

}  // namespace v0_1
}  // namespace moefold
