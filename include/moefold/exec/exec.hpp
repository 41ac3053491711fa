//! @file exec.hpp
//! @brief The execution-context concepts. Every operation of the router, the dispatcher, the
//! experts and their kernels takes a context, which says where the buffers live (its memory
//! space) and how work runs on them. Every execution context has one capability set: kernel
//! launches, row operations, copies and allocation.
//!
//! | context          | header                  | space              | kernels run as      |
//! |------------------|-------------------------|--------------------|---------------------|
//! | `host_exec`      | exec/host_exec.hpp      | `host_space`       | host loops (fast)   |
//! | `cpu_exec{seed}` | exec/cpu_exec.hpp       | `cpu_device_space` | fibers (checker)    |
//! | `cuda_exec`      | exec/cuda/cuda_exec.cuh | `device_space`     | CUDA kernels        |
//!
//! `cuda_copy_exec{stream}` (exec/cuda/cuda_copy_exec.hpp) is less: copies and allocation on a
//! stream, what the GPU communicators need (`copy_context`), so that they compile without nvcc.
//!
//! Each context copies between its own space and host memory (`copy(src, dst)`, views of equal
//! rows and width; a copy to host memory returns when the host can read the data, so it is where
//! the host waits for the device) and allocates in its space (exec/exec_buffer.hpp). A stream
//! travels inside the GPU contexts, through every call, never as mutable state of a communicator.
//!
//! The rule for everything built on a context: the context is passed to every call and never
//! stored by a layer, router or experts object, and nothing a call writes (scratch, a GEMM
//! operation's state, staging) is shared between two calls in flight: it belongs to the caller's
//! in-flight storage, or to the execution context (one per stream: handles, workspaces, pinned
//! staging). So two micro-batches may run on two streams.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>

#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"

namespace moefold {
inline namespace v0_1 {

//! A copy context: a memory space, a name for messages, copies between its space and the host,
//! allocation in its space, and synchronize() (host: returns at once). What communicators and
//! buffers need.
template <class X>
concept copy_context = memory_space<typename X::memory_space> &&
    requires(X& x, row_view<const float, typename X::memory_space> src,
             row_view<float, typename X::memory_space> dst, row_view<const float> hsrc,
             row_view<float> hdst, std::size_t bytes, void* p) {
  { X::name } -> std::convertible_to<const char*>;
  { x.copy(src, dst) } -> std::same_as<status>;
  { x.copy(hsrc, dst) } -> std::same_as<status>;
  { x.copy(src, hdst) } -> std::same_as<status>;
  { x.allocate_bytes(bytes) } -> std::same_as<expected<void*>>;
  x.deallocate_bytes(p, bytes);
  // What frees an allocation later without the context: exec_buffer keeps this value, not the
  // context, so nothing built on a context stores it (see above).
  x.deallocator()(p, bytes);
  { x.synchronize() } -> std::same_as<status>;
};

namespace detail {
//! The kernel execution_context launches to check that `launch` exists for a context.
struct launch_probe_kernel {
  static constexpr int block_threads = 32;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx&) const {}
};
}  // namespace detail

//! An execution context: a copy context that launches kernel bodies (`launch(x, grid, kernel)`)
//! and has the row operations (exec/host_memory_ops.hpp, exec/simt_memory_ops.hpp; `fill` stands
//! for them here).
template <class X>
concept execution_context = copy_context<X> &&
    requires(const X& cx, X& x, launch_grid g, row_view<float, typename X::memory_space> v) {
  { launch(cx, g, detail::launch_probe_kernel{}) } -> std::same_as<status>;
  { x.fill(v, 0.0f) } -> std::same_as<status>;
};

//! Transfers a context made: calls and bytes per direction (cpu_exec and cuda_exec count
//! them; a copy to the host is where the host waits).
struct copy_counts {
  long long to_device = 0, to_host = 0, on_device = 0;                    //!< calls
  long long bytes_to_device = 0, bytes_to_host = 0, bytes_on_device = 0;  //!< bytes moved

  friend bool operator==(const copy_counts&, const copy_counts&) = default;
};

//! The errors a context's kernels left in device memory since the last call, where it keeps them
//! (cuda_exec::device_status(): one copy to the host, a wait); contexts that report
//! errors at once (host_exec, cpu_exec) have none.
template <class X>
[[nodiscard]] status device_status_of(X& x) {
  if constexpr (requires {
                  { x.device_status() } -> std::same_as<status>;
                })
    return x.device_status();
  else
    return {};
}

namespace detail {

//! The shape check every context's copy makes: same rows and width.
template <class U, class S1, class T, class S2>
[[nodiscard]] status check_copy(const row_view<U, S1>& src, const row_view<T, S2>& dst,
                                const char* ctx) {
  if (src.rows() != dst.rows() || src.width() != dst.width())
    return make_error(errc::shape_mismatch,
                      std::string(ctx) + "::copy: source [" + to_decimal(src.rows()) + ", " +
                          to_decimal(src.width()) + "] and destination [" + to_decimal(dst.rows()) +
                          ", " + to_decimal(dst.width()) + "] differ (from " + S1::name + " to " +
                          S2::name + " memory)");
  return {};
}

//! 256-byte aligned host memory for a context's allocate_bytes (each byte set to `fill` when
//! fill >= 0: the CPU executor poisons its memory).
[[nodiscard]] inline expected<void*> aligned_host_bytes(std::size_t bytes, const char* ctx,
                                                        int fill = -1) {
  void* p = ::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{256}, std::nothrow);
  if (!p)
    return make_error(errc::backend_error, std::string(ctx) + ": allocating " +
                                               to_decimal(static_cast<long long>(bytes)) +
                                               " bytes failed");
  if (fill >= 0) std::memset(p, fill, bytes);
  return p;
}
inline void free_aligned_host_bytes(void* p) noexcept {
  ::operator delete (p, std::align_val_t{256});
}
//! The deallocator of the host-memory contexts' allocations (host_exec, cpu_exec): stateless.
struct host_bytes_deallocator {
  void operator()(void* p, std::size_t) const noexcept { free_aligned_host_bytes(p); }
};

//! Row-by-row host copy (memmove semantics are not needed: views passed to copy do not overlap).
template <class U, class S1, class T, class S2>
void host_copy_rows(const row_view<U, S1>& src, const row_view<T, S2>& dst) noexcept {
  for (int r = 0; r < src.rows(); ++r) {
    const U* s = src.row_data(r);
    T* d = dst.row_data(r);
    for (int c = 0; c < src.width(); ++c) d[c] = s[c];
  }
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
