//! @file cublas_gemm.hpp
//! @brief The cuBLAS side of the cuBLAS backends (exec/cublas_dense.hpp, cublas_strided.hpp): a
//! handle with its own workspace on one stream (what each cuda_exec owns for its GEMMs), and a
//! call of exec/blas_call.hpp issued as `cublasGemmEx` or `cublasGemmStridedBatchedEx` on it. The
//! same call host_blas executes in CI (exec/host_blas.hpp). Host code; needs cudart and cuBLAS.
//!
//! Reproducibility: cuBLAS gives the same bits on every run on one GPU model and library version
//! when each handle serves one stream with a workspace of its own (its documented rule): a handle
//! per context, bound to the context's stream, with a workspace allocated for it. Compute: fp32
//! (CUBLAS_COMPUTE_32F: tensor cores for 16-bit inputs, no TF32 for fp32 ones, as the default
//! math mode keeps it), fp64 for fp64.
//!
//! K = 0 without accumulate: every C is written as 0 by a memset here (the rule of the seam) rather
//! than left to how a library treats an empty sum.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

#include "../../core/cuda/cublas_status.hpp"
#include "../../core/cuda/cuda_check.hpp"
#include "../../core/dtype.hpp"
#include "../../core/expected.hpp"
#include "../blas_call.hpp"
#include "../blas_engine.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

template <class T>
inline constexpr cudaDataType_t cuda_data_type = std::is_same_v<T, bfloat16>  ? CUDA_R_16BF
                                                 : std::is_same_v<T, float16> ? CUDA_R_16F
                                                 : std::is_same_v<T, double>  ? CUDA_R_64F
                                                                              : CUDA_R_32F;

//! A cuBLAS handle bound to one stream with a workspace of its own (freed on that stream).
//! cublasDestroy synchronizes the device, as cuBLAS documents.
class cublas_handle {
 public:
  //! cuBLAS's recommended workspace on Hopper.
  static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;

  [[nodiscard]] static expected<std::unique_ptr<cublas_handle>> make(cudaStream_t stream) {
    auto h = std::unique_ptr<cublas_handle>(new cublas_handle(stream));
    if (auto st = cublas_check(cublasCreate(&h->handle_), "cublasCreate"); !st)
      return unexpected<error>(st.error());
    if (auto st = cublas_check(cublasSetStream(h->handle_, stream), "cublasSetStream"); !st)
      return unexpected<error>(st.error());
    if (auto st = cuda_check(cudaMallocAsync(&h->workspace_, workspace_bytes, stream),
                             "cudaMallocAsync (cuBLAS workspace)");
        !st)
      return unexpected<error>(st.error());
    // After cublasSetStream, which resets the workspace to cuBLAS's shared pool.
    if (auto st = cublas_check(cublasSetWorkspace(h->handle_, h->workspace_, workspace_bytes),
                               "cublasSetWorkspace");
        !st)
      return unexpected<error>(st.error());
    return h;
  }
  cublas_handle(const cublas_handle&) = delete;
  cublas_handle& operator=(const cublas_handle&) = delete;
  ~cublas_handle() {
    if (handle_) static_cast<void>(cublasDestroy(handle_));
    if (workspace_) static_cast<void>(cudaFreeAsync(workspace_, stream_));
  }

  [[nodiscard]] cublasHandle_t get() const noexcept { return handle_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

 private:
  explicit cublas_handle(cudaStream_t s) noexcept : stream_(s) {}
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

//! Enqueues call `c` on the handle's stream.
template <class TA, class TB, class TC>
[[nodiscard]] status cublas_gemm(const cublas_handle& h, const blas_gemm_call<TA, TB, TC>& c) {
  static_assert(blas_types_v<TA, TB, TC>,
                "cublas_gemm: cublasGemmEx takes A and B of one type, C of that type or fp32");
  if (c.m <= 0 || c.n <= 0 || c.batch <= 0 || (c.k == 0 && c.accumulate)) return {};
  if (c.k == 0) {  // C = 0, matrix by matrix (column-major m x n, ldc apart)
    for (int i = 0; i < c.batch; ++i)
      if (auto st = cuda_check(cudaMemset2DAsync(c.c + i * c.stride_c, sizeof(TC) * c.ldc, 0,
                                                 sizeof(TC) * c.m, c.n, h.stream()),
                               "cudaMemset2DAsync (K = 0 GEMM)");
          !st)
        return st;
    return {};
  }
  using scale_t = std::conditional_t<std::is_same_v<TA, double>, double, float>;
  const scale_t alpha(1), beta(c.accumulate ? 1 : 0);
  const cublasComputeType_t compute =
      std::is_same_v<TA, double> ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const auto op = [](blas_op o) { return o == blas_op::n ? CUBLAS_OP_N : CUBLAS_OP_T; };
  if (c.batch == 1)
    return cublas_check(
        cublasGemmEx(h.get(), op(c.transa), op(c.transb), c.m, c.n, c.k, &alpha, c.a,
                     cuda_data_type<TA>, c.lda, c.b, cuda_data_type<TB>, c.ldb, &beta, c.c,
                     cuda_data_type<TC>, c.ldc, compute, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  return cublas_check(
      cublasGemmStridedBatchedEx(h.get(), op(c.transa), op(c.transb), c.m, c.n, c.k, &alpha, c.a,
                                 cuda_data_type<TA>, c.lda, c.stride_a, c.b, cuda_data_type<TB>,
                                 c.ldb, c.stride_b, &beta, c.c, cuda_data_type<TC>, c.ldc,
                                 c.stride_c, c.batch, compute, CUBLAS_GEMM_DEFAULT),
      "cublasGemmStridedBatchedEx");
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
