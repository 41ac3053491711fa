//! @file cuda_copy_exec.hpp
//! @brief cuda_copy_exec{stream}: copies and allocation in CUDA device memory on a stream, and
//! nothing else: what the GPU communicators need (NCCL, the loopback, MPI with device memory), so
//! that they compile without nvcc. It launches no kernel and has no row operations: the execution
//! context of the GPU is cuda_exec (exec/cuda/cuda_exec.cuh), which is a cuda_copy_exec with
//! kernels, and communicators take either. Every operation is enqueued on its stream and returns
//! without waiting (synchronize() waits). The stream is the caller's, passed with every call:
//! communicators and dispatchers hold none.
//!
//! A copy to host memory returns when the host can read the data: it waits for the stream (a
//! pinned destination would otherwise be written after the call returns, and the callers, the
//! dispatchers among them, read what they copied at once). These copies are the host's waits,
//! and a dispatcher makes at most one per forward. A copy from host memory does not wait for the
//! device; from pageable memory the runtime stages the source before it returns, from pinned
//! memory the source must stay unchanged until the stream has run the copy.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "../../core/cuda/cuda_check.hpp"
#include "../exec.hpp"

namespace moefold {
inline namespace v0_1 {

class cuda_copy_exec {
 public:
  using memory_space = device_space;
  static constexpr const char* name = "cuda_copy_exec";

  constexpr cuda_copy_exec() noexcept = default;
  constexpr explicit cuda_copy_exec(cudaStream_t stream) noexcept : stream_(stream) {}

  [[nodiscard]] constexpr cudaStream_t stream() const noexcept { return stream_; }

  //! Host to device.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, host_space> src, row_view<T, memory_space> dst) const {
    return copy_2d(src, dst, cudaMemcpyHostToDevice);
  }
  //! Device to host; returns when the data is there (waits for the stream).
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, host_space> dst) const {
    if (auto st = copy_2d(src, dst, cudaMemcpyDeviceToHost); !st) return st;
    return synchronize();
  }
  //! Device to device.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, memory_space> dst) const {
    return copy_2d(src, dst, cudaMemcpyDeviceToDevice);
  }

  //! Stream-ordered device memory (cudaMallocAsync on the stream).
  [[nodiscard]] expected<void*> allocate_bytes(std::size_t bytes) const {
    void* p = nullptr;
    if (auto st = detail::cuda_check(cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, stream_),
                                     "cudaMallocAsync");
        !st)
      return unexpected<error>(st.error());
    return p;
  }
  void deallocate_bytes(void* p, std::size_t) const noexcept {
    if (p) static_cast<void>(cudaFreeAsync(p, stream_));
  }
  //! Frees on the stream the memory was allocated on (which must outlive the allocation; the
  //! work of other streams that used it must be finished, or ordered before, by then).
  struct stream_deallocator {
    cudaStream_t stream = nullptr;
    void operator()(void* p, std::size_t) const noexcept {
      if (p) static_cast<void>(cudaFreeAsync(p, stream));
    }
  };
  [[nodiscard]] stream_deallocator deallocator() const noexcept { return {stream_}; }
  [[nodiscard]] status synchronize() const {
    return detail::cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  template <class U, class S1, class T, class S2>
  status copy_2d(const row_view<U, S1>& src, const row_view<T, S2>& dst,
                 cudaMemcpyKind kind) const {
    if (auto st = detail::check_copy(src, dst, name); !st) return st;
    if (src.empty()) return {};
    const std::size_t w = static_cast<std::size_t>(src.width()) * sizeof(T);
    return detail::cuda_check(
        cudaMemcpy2DAsync(dst.data(), static_cast<std::size_t>(dst.stride()) * sizeof(T),
                          src.data(), static_cast<std::size_t>(src.stride()) * sizeof(T), w,
                          static_cast<std::size_t>(src.rows()), kind, stream_),
        "cudaMemcpy2DAsync");
  }

  cudaStream_t stream_ = nullptr;
};

static_assert(copy_context<cuda_copy_exec>);

}  // namespace v0_1
}  // namespace moefold
