//! @file host_launch.hpp
//! @brief What launch(host_exec, grid, kernel) (exec/host_exec.hpp) does: a kernel body run on
//! host memory as fast as the host runs a loop, the same source cpu_exec checks and a GPU runs.
//!
//! - A body of independent threads (core/simt_launch.hpp) runs as a plain loop: blocks in order,
//!   in each block threads 0 .. K::block_threads - 1 in order, each to the end of the body. Its
//!   context (host_thread_ctx) has no barrier, warp operation or shared memory: a body that uses
//!   one does not compile here, with a message naming the rule.
//! - A team body (`cooperative = true`) runs with a team of one thread per block
//!   (host_team_ctx: block_threads = warp_threads = 1), blocks in order: its barriers are no-ops,
//!   a shuffle returns the thread's own value (the only lane), a ballot its own bit, and the
//!   body's reductions and scans over the team are loops over the thread's own values. Its
//!   dynamic shared memory is `grid.smem_bytes` of the launch's own (the team of one needs at
//!   most what the kernel's block needs), not poisoned.
//!
//! No fibers, no worker threads, no poisoning, no seeded order: what cpu_exec adds to find the
//! bugs a GPU would hide, host_exec leaves out. A body that breaks a rule the host can see (a
//! 16-byte access at an address that is not 16-byte aligned) ends the launch with
//! errc::kernel_fault naming the kernel, the block and the thread, as on cpu_exec.
//!
//! Results: an integer or fixed-order body gives the bits cpu_exec gives; a body whose float
//! reductions run in the team's order (the router's softmax sums, the warp sums) adds in the
//! order of one thread instead of a butterfly, within the ulps its kernel documents.
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>

#include "../core/config.hpp"
#include "../core/expected.hpp"
#include "../core/simt_launch.hpp"
#include "host_bytes16.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

template <class...>
inline constexpr bool host_ctx_false = false;

//! A fault a body's context found (thrown through the body to the launcher).
struct host_simt_fault {
  int thread;
  const char* what;  //!< the rule broken, in words
};

//! What the two host contexts share: indices, 16-byte accesses, integer atomics (plain: a host
//! launch runs one thread at a time).
template <int Threads, int Warp>
class host_ctx_base : public host_bytes16<host_ctx_base<Threads, Warp>> {
 public:
  static constexpr int block_threads = Threads;
  static constexpr int warp_threads = Warp;

  constexpr host_ctx_base(int block, int grid_blocks) noexcept
      : block_(block), grid_blocks_(grid_blocks) {}

  // __host__ __device__ under nvcc so that a body instantiated with a host context in a .cu file
  // is not a call of a host function; the device pass, where these never run, compiles the host
  // work away (MOEFOLD_CPU_ONLY).
  [[nodiscard]] MOEFOLD_HOST_DEVICE int thread() const noexcept { return thread_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int block() const noexcept { return block_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int grid_blocks() const noexcept { return grid_blocks_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int lane() const noexcept { return thread_ % Warp; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int warp() const noexcept { return thread_ / Warp; }

  //! atomicAdd on an integer; returns the old value.
  template <class T>
  requires std::is_integral_v<T> MOEFOLD_HOST_DEVICE T atomic_add(T* p, T v)
  noexcept {
    T old{};
    MOEFOLD_CPU_ONLY(old = *p; *p = static_cast<T>(old + v));
    return old;
  }
  //! atomicMin on an integer; returns the old value.
  template <class T>
  requires std::is_integral_v<T> MOEFOLD_HOST_DEVICE T atomic_min(T* p, T v)
  noexcept {
    T old{};
    MOEFOLD_CPU_ONLY(old = *p; if (v < old)* p = v);
    return old;
  }

  void set_thread(int t) noexcept { thread_ = t; }

 private:
  // A 16-byte access at a misaligned address (host_bytes16): the launcher reports it.
  friend class host_bytes16<host_ctx_base>;
  [[noreturn]] void fault_misaligned([[maybe_unused]] const void* p, const char* what) const {
#if defined(__cpp_exceptions)
    throw host_simt_fault{thread_, what};
#else
    std::fprintf(stderr, "host_exec: block %d thread %d: %s (%p)\n", block_, thread_, what, p);
    std::abort();
#endif
  }

  int thread_ = 0, block_, grid_blocks_;
};

}  // namespace detail

//! The context an independent body gets on a host context: thread() of K::block_threads, run in
//! a loop. No barrier, warp operation or shared memory (a body that uses one is a team body).
template <int Threads>
class host_thread_ctx : public detail::host_ctx_base<Threads, 32> {
 public:
  using detail::host_ctx_base<Threads, 32>::host_ctx_base;

  template <class... A>
  void sync(A...) {
    static_assert(detail::host_ctx_false<A...>,
                  "sync() in a kernel that is not cooperative: a body with barriers, warp "
                  "operations or shared memory declares `static constexpr bool cooperative = "
                  "true;` and divides its work by Ctx::block_threads (core/simt_launch.hpp)");
  }
  template <class... A>
  void warp_sync(A...) {
    static_assert(detail::host_ctx_false<A...>,
                  "warp_sync() in a kernel that is not cooperative (core/simt_launch.hpp)");
  }
  template <class T, class... A>
  T shfl_xor(T v, A...) {
    static_assert(detail::host_ctx_false<A...>,
                  "a shuffle in a kernel that is not cooperative (core/simt_launch.hpp)");
    return v;
  }
  template <class T, class... A>
  T shfl_idx(T v, A...) {
    static_assert(detail::host_ctx_false<A...>,
                  "a shuffle in a kernel that is not cooperative (core/simt_launch.hpp)");
    return v;
  }
  template <class... A>
  unsigned ballot(A...) {
    static_assert(detail::host_ctx_false<A...>,
                  "ballot() in a kernel that is not cooperative (core/simt_launch.hpp)");
    return 0;
  }
  template <class T, class... A>
  T* shared(A...) {
    static_assert(detail::host_ctx_false<T, A...>,
                  "shared memory in a kernel that is not cooperative (core/simt_launch.hpp)");
    return nullptr;
  }
};

//! The context a team body gets on a host context: a team of one thread (block_threads =
//! warp_threads = 1), so every barrier is a no-op and every warp operation sees only this lane.
class host_team_ctx : public detail::host_ctx_base<1, 1> {
 public:
  host_team_ctx(int block, int grid_blocks, std::byte* smem, std::size_t smem_bytes) noexcept
      : host_ctx_base(block, grid_blocks), smem_(smem), smem_bytes_(smem_bytes) {}

  MOEFOLD_HOST_DEVICE void sync() noexcept {}
  MOEFOLD_HOST_DEVICE void warp_sync() noexcept {}
  //! The value of lane (lane() ^ mask) mod 1: this thread's own.
  template <class T>
  [[nodiscard]] MOEFOLD_HOST_DEVICE T shfl_xor(T v, int) noexcept {
    return v;
  }
  //! The value of lane src mod 1: this thread's own.
  template <class T>
  [[nodiscard]] MOEFOLD_HOST_DEVICE T shfl_idx(T v, int) noexcept {
    return v;
  }
  //! Bit 0: this lane's predicate.
  [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned ballot(bool p) noexcept { return p ? 1u : 0u; }

  template <class T>
  [[nodiscard]] MOEFOLD_HOST_DEVICE T* shared() noexcept {
    return reinterpret_cast<T*>(smem_);
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE std::size_t shared_bytes() const noexcept {
    return smem_bytes_;
  }

 private:
  std::byte* smem_;
  std::size_t smem_bytes_;
};

static_assert(simt_context<host_team_ctx>);

namespace detail {

//! The host launch (host_exec.hpp's launch calls it): `kernel` over `grid.blocks` blocks, as the
//! top of this file says. Errors: a negative grid or too much shared memory (invalid_argument,
//! before anything runs); a fault a context found (kernel_fault, naming the kernel, block and
//! thread; blocks after it do not run).
template <class K>
requires simt_kernel<K>
[[nodiscard]] status host_run(const char* exec_name, const launch_grid& grid, const K& kernel) {
  if (auto st = check_launch(grid, exec_name, kernel_name<K>()); !st) return st;
  int block = 0;
#if defined(__cpp_exceptions)
  try {
#endif
    if constexpr (cooperative_kernel<K>) {
      // Shared memory of the launch: on the stack up to 16 KiB (the router's and the losses'
      // teams ask for a few hundred bytes, the SIMT GEMM's fp32 and fp64 tiles 4.2 and 8.4 KiB, a
      // histogram 4 bytes per expert), so that no launch of the layer allocates; else on the
      // heap. One buffer serves every block in turn.
      alignas(16) std::byte local[16 * 1024];
      std::unique_ptr<std::byte[]> heap;
      std::byte* smem = local;
      if (grid.smem_bytes > sizeof local) {
        heap.reset(new std::byte[grid.smem_bytes]);  // 16-byte aligned, as operator new[] is
        smem = heap.get();
      }
      for (; block < grid.blocks; ++block) {
        host_team_ctx c(block, grid.blocks, smem, grid.smem_bytes);
        kernel(c);
      }
    } else {
      for (; block < grid.blocks; ++block) {
        host_thread_ctx<K::block_threads> c(block, grid.blocks);
        for (int t = 0; t < K::block_threads; ++t) {
          c.set_thread(t);
          kernel(c);
        }
      }
    }
#if defined(__cpp_exceptions)
  } catch (const host_simt_fault& f) {
    return make_error(errc::kernel_fault, std::string(exec_name) + ": " + kernel_name<K>() +
                                              ", block " + to_decimal(block) + ": thread " +
                                              to_decimal(f.thread) + ": " + f.what);
  }
#endif
  return {};
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
