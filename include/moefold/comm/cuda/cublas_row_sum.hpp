//! @file cublas_row_sum.hpp
//! @brief The fp32 sum of P rows of 16-bit floats with one cuBLAS GEMM, one rounding per element:
//! how the NCCL communicator adds bf16/fp16 (NCCL's own kernels round after every step).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "../../core/cuda/cublas_status.hpp"
#include "../../core/dtype.hpp"
#include "../../core/expected.hpp"
#include "cuda_types.hpp"  // CUDA's 16-bit types are dtype::bf16 / f16 here too

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! bf16 and fp16: the types whose sums NCCL would round after every step.
template <class T>
inline constexpr bool is_16bit_float = dtype_of<T> == dtype::bf16 || dtype_of<T> == dtype::f16;

//! Sums `rows` rows of n 16-bit floats (row p at rows + p * n, on the device) into n elements
//! with one cuBLAS GEMM: out[n x 1] = rows[n x P] * ones[P x 1], alpha 1, beta 0, fp32 compute.
//! Every product is exact (x * 1), the P terms of an element are added in fp32 and the result is
//! rounded once into the 16-bit type (NCCL's own kernels round after every step). The order of
//! the fp32 additions is cuBLAS's; cuBLAS gives the same bits on every run on the same GPU model
//! and library version only while one stream is active per handle or each stream has its own
//! workspace (its reproducibility rule). The communicator's handle serves whatever stream a call
//! names, so every call runs with no workspace (cublasSetWorkspace of 0 bytes, set again after
//! each cublasSetStream, which resets it): the algorithm cannot depend on a shared workspace.
//! Should cuBLAS refuse that, stream_independent() turns false and the default pool is used.
//!
//! beta = 0: `out` is not read, so it may hold anything (or alias a row that the stream has
//! finished reading, as all_reduce's in-place buffer does). A sum whose terms are all -0 comes
//! out +0 (the accumulator starts at +0).
//!
//! Compute type: CUBLAS_COMPUTE_32F_PEDANTIC first, which keeps IEEE fp32 arithmetic for every
//! phase (tensor cores may accumulate with truncated alignment); a k = P GEMM with one column is
//! memory-bound, so tensor cores would buy nothing. Should a cuBLAS version refuse the pedantic
//! type for 16-bit inputs (CUBLAS_STATUS_NOT_SUPPORTED), CUBLAS_COMPUTE_32F is used from then on
//! (still fp32 accumulation, one rounding).
//!
//! Owns a cuBLAS handle, created on first use on the current device; cublasDestroy (destructor)
//! synchronizes the device, as cuBLAS documents.
class cublas_row_sum {
 public:
  cublas_row_sum() = default;
  cublas_row_sum(cublas_row_sum&& o) noexcept
      : handle_(std::exchange(o.handle_, nullptr)),
        pedantic_(o.pedantic_),
        stream_independent_(o.stream_independent_) {}
  cublas_row_sum& operator=(cublas_row_sum&& o) noexcept {
    if (this != &o) {
      reset();
      handle_ = std::exchange(o.handle_, nullptr);
      pedantic_ = o.pedantic_;
      stream_independent_ = o.stream_independent_;
    }
    return *this;
  }
  cublas_row_sum(const cublas_row_sum&) = delete;
  cublas_row_sum& operator=(const cublas_row_sum&) = delete;
  ~cublas_row_sum() { reset(); }

  //! Enqueues the sum on `s`. T: bf16 or fp16 (moefold's or CUDA's type). rows, ones and out
  //! are device pointers; ones holds `rows` elements equal to 1 of type T.
  template <class T>
  requires is_16bit_float<T>
  [[nodiscard]] status sum(const T* rows, std::int64_t nrows, std::int64_t n, const T* ones, T* out,
                           cudaStream_t s) {
    if (n <= 0 || nrows <= 0) return {};
    if (!handle_) {
      cublasHandle_t h = nullptr;
      if (auto ok = cublas_check(cublasCreate(&h), "cublasCreate"); !ok) return ok;
      handle_ = h;
    }
    if (auto ok = cublas_check(cublasSetStream(handle_, s), "cublasSetStream"); !ok) return ok;
    if (stream_independent_ && cublasSetWorkspace(handle_, nullptr, 0) != CUBLAS_STATUS_SUCCESS)
      stream_independent_ = false;
    constexpr cudaDataType_t t = dtype_of<T> == dtype::bf16 ? CUDA_R_16BF : CUDA_R_16F;
    const float one = 1.0f, zero = 0.0f;
    const auto gemm = [&](cublasComputeType_t compute) {
      return cublasGemmEx_64(handle_, CUBLAS_OP_N, CUBLAS_OP_N, n, 1, nrows, &one, rows, t, n, ones,
                             t, nrows, &zero, out, t, n, compute, CUBLAS_GEMM_DEFAULT);
    };
    cublasStatus_t rc = gemm(pedantic_ ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F);
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED && pedantic_) {
      pedantic_ = false;
      rc = gemm(CUBLAS_COMPUTE_32F);
    }
    return cublas_check(rc, "cublasGemmEx_64 (fp32 sum of 16-bit rows)");
  }

  [[nodiscard]] bool has_handle() const noexcept { return handle_ != nullptr; }
  //! False once cuBLAS refused CUBLAS_COMPUTE_32F_PEDANTIC and CUBLAS_COMPUTE_32F is used.
  [[nodiscard]] bool pedantic() const noexcept { return pedantic_; }
  //! False once cuBLAS refused a zero-byte workspace (the sums then use its default pool).
  [[nodiscard]] bool stream_independent() const noexcept { return stream_independent_; }

 private:
  void reset() noexcept {
    if (handle_) cublasDestroy(std::exchange(handle_, nullptr));
  }

  cublasHandle_t handle_ = nullptr;
  bool pedantic_ = true;
  bool stream_independent_ = true;
};

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
