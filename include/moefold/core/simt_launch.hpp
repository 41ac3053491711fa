//! @file simt_launch.hpp
//! @brief The SIMT seam's vocabulary, below the kernels: a kernel is a plain-data function object
//! whose `operator()(Ctx&)` is one `MOEFOLD_HOST_DEVICE` body, and `launch(exec, grid, kernel)`
//! runs it on an execution context (exec/):
//!
//! | context          | launcher                  | one CUDA thread is                         |
//! |------------------|---------------------------|--------------------------------------------|
//! | `host_exec`      | exec/host_launch.hpp      | a loop iteration (a team body: one thread) |
//! | `cpu_exec{seed}` | exec/cpu_launch.hpp       | a fiber (TSan sees it)                     |
//! | `cuda_exec`      | exec/cuda/cuda_launch.cuh | a CUDA thread                              |
//!
//! What a body may use is what every context gives (the `simt_context` concept below): indices,
//! block barriers, full-mask warp shuffles and ballots, dynamic shared memory, 16-byte loads and
//! stores, integer atomics (add, min). The arithmetic every context must round the same way (fma,
//! bf16, exp, log, sqrt) lives in kernels/simt/math.hpp, not in the context.
//!
//! Two kinds of body, which a kernel declares:
//! - Independent threads (the default): no barrier, no warp operation, no shared memory. A host
//!   context runs it as a plain loop over blocks and K::block_threads threads; its context there
//!   has no sync(), shuffle, ballot or shared memory, so a body that calls one does not compile
//!   (the message names this rule).
//! - A team (`static constexpr bool cooperative = true;`): its threads meet at barriers, exchange
//!   values through warp operations or share memory. Its team's size is a property of the context
//!   it is given, `Ctx::block_threads` threads in warps of `Ctx::warp_threads` lanes, and the body
//!   divides its work by those (never by its kernel's block_threads or by 32): on a GPU and on
//!   cpu_exec the team is the kernel's block in warps of 32, on a host context a team of one
//!   thread, where a warp reduction or a block scan is a plain loop over the thread's own values.
//!   The same source, not a twin.
//!
//! Rules for bodies (the CPU executor cannot run anything else the way the GPU does): every
//! thread of a block reaches each `sync()`, all lanes of a warp reach each warp operation, no
//! float atomics, no communication between blocks of one launch, no `#ifdef __CUDA_ARCH__`.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "config.hpp"
#include "expected.hpp"

namespace moefold {
inline namespace v0_1 {

//! How many blocks a launch runs and how much dynamic shared memory each gets. The block size
//! is the kernel's own `block_threads` (it also sets `__launch_bounds__` on the GPU).
struct launch_grid {
  int blocks = 1;
  std::size_t smem_bytes = 0;
};

//! The most blocks a grid of `Exec` takes (its max_grid_blocks, or 1,024 for a context without
//! one); kernels over more work loop over their blocks.
template <class Exec>
[[nodiscard]] constexpr long long grid_cap() noexcept {
  if constexpr (requires { Exec::max_grid_blocks; })
    return Exec::max_grid_blocks;
  else
    return 1024;
}

//! A grid of ceil(n / per_block) blocks, at least one, capped (see grid_cap).
template <class Exec>
[[nodiscard]] constexpr int capped_blocks(long long n, long long per_block) noexcept {
  return static_cast<int>(
      std::clamp<long long>((n + per_block - 1) / per_block, 1, grid_cap<Exec>()));
}

//! The grid of kernel K over n items, per_block of them per block (capped), with K's shared
//! memory: the router kernels' one token per warp or per block.
template <class Exec, class K>
[[nodiscard]] constexpr launch_grid capped_grid(long long n, long long per_block) noexcept {
  return {.blocks = capped_blocks<Exec>(n, per_block),
          .smem_bytes = static_cast<std::size_t>(K::smem_bytes)};
}

//! The most dynamic shared memory one block may ask for: Hopper's 227 KiB per block (H100/H200,
//! after cudaFuncSetAttribute raises the 48 KiB default, which cuda_launch does).
inline constexpr std::size_t max_smem_bytes_per_block = 227 * 1024;

//! 16 bytes moved by one load or store (LDG.E.128 / STG.E.128 on the GPU).
struct alignas(16) bytes16 {
  std::uint32_t w[4];
};

//! What a team body may call on its context `c` (an independent body: the same but for sync(),
//! warp_sync(), the shuffles, ballot() and shared memory).
template <class C>
concept simt_context = requires(C& c, const C& cc, int i, float f, unsigned u, bool b,
                                const void* src, void* dst, bytes16 v, int* ip) {
  { C::block_threads } -> std::convertible_to<int>;  // the team's threads
  { C::warp_threads } -> std::convertible_to<int>;   // lanes of a warp: 32, or 1 in a team of one
  { cc.thread() } -> std::same_as<int>;              // threadIdx.x
  { cc.block() } -> std::same_as<int>;               // blockIdx.x
  { cc.grid_blocks() } -> std::same_as<int>;         // gridDim.x
  { cc.lane() } -> std::same_as<int>;                // thread() % warp_threads
  { cc.warp() } -> std::same_as<int>;                // thread() / warp_threads
  c.sync();                                          // __syncthreads()
  c.warp_sync();                                     // __syncwarp() (full mask)
  { c.shfl_xor(f, i) } -> std::same_as<float>;
  { c.shfl_idx(u, i) } -> std::same_as<unsigned>;
  { c.ballot(b) } -> std::same_as<unsigned>;
  { c.template shared<float>() } -> std::same_as<float*>;
  { cc.shared_bytes() } -> std::same_as<std::size_t>;
  { cc.load16(src) } -> std::same_as<bytes16>;
  cc.store16(dst, v);
  { c.atomic_add(ip, i) } -> std::same_as<int>;
  { c.atomic_min(ip, i) } -> std::same_as<int>;
};

//! A kernel: `block_threads` a multiple of 32 in [32, 1024], copyable plain data (it travels to
//! the GPU as a kernel parameter).
template <class K>
concept simt_kernel = std::is_trivially_copyable_v<K> && requires {
  { K::block_threads } -> std::convertible_to<int>;
} && K::block_threads >= 32 && K::block_threads <= 1024 && K::block_threads % 32 == 0;

//! Whether K's body is a team (it declares `cooperative = true`): see the top of this file.
template <class K>
inline constexpr bool cooperative_kernel = [] {
  if constexpr (requires { K::cooperative; })
    return static_cast<bool>(K::cooperative);
  else
    return false;
}();

namespace detail {

//! A kernel's name for messages: its `name` member when it has one.
template <class K>
[[nodiscard]] constexpr const char* kernel_name() noexcept {
  if constexpr (requires { K::name; })
    return K::name;
  else
    return "a kernel";
}

//! The checks both executors make before a launch: the rule broken is named.
[[nodiscard]] inline status check_launch(const launch_grid& g, const char* exec,
                                         const char* kernel) {
  if (g.blocks < 0)
    return make_error(errc::invalid_argument, std::string(exec) + ": launch of " + kernel +
                                                  " with " + to_decimal(g.blocks) +
                                                  " blocks (blocks >= 0)");
  if (g.smem_bytes > max_smem_bytes_per_block)
    return make_error(errc::invalid_argument,
                      std::string(exec) + ": launch of " + kernel + " asks " +
                          to_decimal(static_cast<long long>(g.smem_bytes)) +
                          " bytes of shared memory per block (at most " +
                          to_decimal(static_cast<long long>(max_smem_bytes_per_block)) +
                          ", Hopper's limit)");
  return {};
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
