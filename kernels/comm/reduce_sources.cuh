//! @file reduce_sources.cuh
//! @brief Element-wise reduction of up to 64 device arrays into one, accumulated in fp32 for
//! 16-bit floats and always in source order, so the result is deterministic and equals a host
//! loop over ranks in rank order bit for bit. The device loopback's all_reduce and
//! reduce_scatter_v run on it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace moefold::kernels {

inline constexpr int max_reduce_sources = 64;

//! The sources, passed by value (512 bytes of kernel parameters).
template <class T>
struct reduce_sources {
  const T* src[max_reduce_sources];
};

template <class T>
using reduce_accumulator_t =
    std::conditional_t<std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, float, T>;

template <class T>
__device__ inline reduce_accumulator_t<T> to_acc(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(v);
  else if constexpr (std::is_same_v<T, __half>)
    return __half2float(v);
  else
    return v;
}
template <class T>
__device__ inline T from_acc(reduce_accumulator_t<T> v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(v);
  else if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(v);
  else
    return v;
}

//! out[i] = src[0][i] (+ or max) src[1][i] ... src[count-1][i], for i < n.
//! Preconditions: 1 <= count <= max_reduce_sources; out does not overlap any source.
template <class T>
__global__ void __launch_bounds__(256)
    reduce_sources_kernel(reduce_sources<T> in, int count, std::int64_t n, T* out /* (n) */,
                          bool max) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    auto acc = to_acc(in.src[0][i]);
    for (int p = 1; p < count; ++p) {
      const auto x = to_acc(in.src[p][i]);
      // Plain add: no fused multiply-add can change the rounding.
      acc = max ? (acc < x ? x : acc) : static_cast<decltype(acc)>(acc + x);
    }
    out[i] = from_acc<T>(acc);
  }
}

//! Enqueues reduce_sources_kernel on `stream`; returns the launch status (no host sync).
template <class T>
[[nodiscard]] cudaError_t launch_reduce_sources(const reduce_sources<T>& in, int count,
                                                std::int64_t n, T* out, bool max,
                                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (count < 1 || count > max_reduce_sources) return cudaErrorInvalidValue;
  const std::int64_t blocks = (n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096;
  reduce_sources_kernel<T>
      <<<static_cast<unsigned>(blocks), 256, 0, stream>>>(in, count, n, out, max);
  // cudaGetLastError, not Peek: it clears the error, so a later check does not report it again.
  return cudaGetLastError();
}

}  // namespace moefold::kernels
