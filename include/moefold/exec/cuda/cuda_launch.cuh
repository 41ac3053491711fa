//! @file cuda_launch.cuh
//! @brief What launch(cuda_exec, grid, kernel) (exec/cuda/cuda_exec.cuh) does: the body of a kernel
//! (core/simt_launch.hpp) enqueued on the context's stream through one generic `__global__` entry
//! per kernel type, with
//! `__launch_bounds__(K::block_threads)`. The context's members are one-instruction wrappers
//! (threadIdx, __syncthreads, __shfl_xor_sync, ...) that the compiler inlines away, so a body costs
//! what the same kernel written by hand costs. Needs nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "../../core/cuda/cuda_check.hpp"
#include "../../core/simt_launch.hpp"

namespace moefold {
inline namespace v0_1 {

//! The context a body gets on cuda_exec.
template <int Threads>
struct cuda_ctx {
  static constexpr int block_threads = Threads;
  static constexpr int warp_threads = 32;

  __device__ __forceinline__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ int block() const { return static_cast<int>(blockIdx.x); }
  __device__ __forceinline__ int grid_blocks() const { return static_cast<int>(gridDim.x); }
  __device__ __forceinline__ int lane() const { return static_cast<int>(threadIdx.x) & 31; }
  __device__ __forceinline__ int warp() const { return static_cast<int>(threadIdx.x) >> 5; }

  __device__ __forceinline__ void sync() { __syncthreads(); }
  __device__ __forceinline__ void warp_sync() { __syncwarp(); }

  template <class T>
  __device__ __forceinline__ T shfl_xor(T v, int mask) {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  }
  template <class T>
  __device__ __forceinline__ T shfl_idx(T v, int src) {
    return __shfl_sync(0xffffffffu, v, src);
  }
  __device__ __forceinline__ unsigned ballot(bool p) { return __ballot_sync(0xffffffffu, p); }

  template <class T>
  __device__ __forceinline__ T* shared() {
    extern __shared__ __align__(16) unsigned char moefold_dynamic_smem[];
    return reinterpret_cast<T*>(moefold_dynamic_smem);
  }
  __device__ __forceinline__ std::size_t shared_bytes() const {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
  }

  __device__ __forceinline__ bytes16 load16(const void* p) const {
    const uint4 v = *static_cast<const uint4*>(p);
    return bytes16{{v.x, v.y, v.z, v.w}};
  }
  __device__ __forceinline__ void store16(void* p, bytes16 v) const {
    *static_cast<uint4*>(p) = make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
  }

  template <class T>
  requires std::is_integral_v<T> __device__ __forceinline__ T atomic_add(T* p, T v) {
    if constexpr (sizeof(T) == 8)
      return static_cast<T>(
          atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v)));
    else
      return atomicAdd(p, v);
  }
  template <class T>
  requires std::is_integral_v<T> __device__ __forceinline__ T atomic_min(T* p, T v) {
    return atomicMin(p, v);
  }
};

static_assert(simt_context<cuda_ctx<32>>);

namespace detail {

//! The one __global__ entry of every SIMT kernel: the body gets the kernel by value (a kernel
//! parameter, in constant memory) and a context.
template <class K>
__global__ void __launch_bounds__(K::block_threads) simt_entry(const K kernel) {
  cuda_ctx<K::block_threads> c;
  kernel(c);
}

//! Enqueues `kernel` over `grid.blocks` blocks of K::block_threads threads on `stream`; returns
//! the launch status without waiting (cudaGetLastError, which clears the error so that a later
//! call does not report it again). More than 48 KiB of shared memory raises the kernel's dynamic
//! limit first. `exec` names the context in messages.
template <class K>
requires simt_kernel<K>
[[nodiscard]] status cuda_run(const char* exec, cudaStream_t stream, const launch_grid& grid,
                              const K& kernel) {
  if (auto st = check_launch(grid, exec, kernel_name<K>()); !st) return st;
  if (grid.blocks == 0) return {};
  if (grid.smem_bytes > 48 * 1024)
    if (auto st = cuda_check(
            cudaFuncSetAttribute(simt_entry<K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(grid.smem_bytes)),
            "cudaFuncSetAttribute");
        !st)
      return st;
  simt_entry<K><<<grid.blocks, K::block_threads, grid.smem_bytes, stream>>>(kernel);
  return cuda_check(cudaGetLastError(), kernel_name<K>());
}

}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
