//! @file cuda_exec.cuh
//! @brief cuda_exec: cuda_copy_exec with kernels, the context a dispatcher runs on a GPU. Its
//! row operations are exec/simt_memory_ops.hpp's, each one launch of the same portable kernel
//! body cpu_exec runs (kernels/*.hpp), enqueued on the stream; its bookkeeping builders are the
//! plan and histogram kernels (dispatch/plan_builders.hpp), which read nothing back. Needs nvcc.
//!
//! Errors the host cannot see before a launch (an index outside its range in a row operation)
//! are counted by the kernels into a device error word the context owns and reported by the next
//! host-side status call, status(): one device-to-host copy, which waits. Copies are counted as
//! cpu_exec counts them, so a test can state how often a step makes the host wait (copies to the
//! host are the waits: exec/cuda/cuda_copy_exec.hpp).
//!
//! Its GEMMs through cuBLAS (exec/cublas_dense.hpp, cublas_strided.hpp) run on a cuBLAS handle the
//! context owns, bound to its stream with a workspace of its own (exec/cuda/cublas_gemm.hpp), so
//! that they repeat bit for bit; made at the first such GEMM (32 MiB of the stream's pool).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "../../core/cuda/cuda_check.hpp"
#include "../blas_call.hpp"
#include "../exec.hpp"
#include "../simt_memory_ops.hpp"
#include "cublas_gemm.hpp"
#include "cuda_copy_exec.hpp"
#if defined(MOEFOLD_CUTLASS_SM90)
#include "cutlass_sm90.hpp"  // cutlass_sm90 runs here (the build links moefold_cutlass_sm90)
#endif
#include "cuda_launch.cuh"

namespace moefold {
inline namespace v0_1 {

class cuda_exec : public cuda_copy_exec, public detail::simt_memory_ops<cuda_exec, device_space> {
 public:
  using memory_space = device_space;
  static constexpr const char* name = "cuda_exec";
  //! Its operations are kernel launches (the bookkeeping builders pick their kernels then).
  static constexpr bool runs_kernels = true;
  //! Index arrays live on the device: the kernels count bad ones into the error word instead.
  static constexpr bool check_indices_first = false;
  //! Grid cap of a row operation (every body strides over its rows): 8 blocks per SM of an
  //! H100/H200 (132 SMs), enough to fill it with the 256-thread blocks the row kernels use.
  static constexpr int max_grid_blocks = 132 * 8;

  //! A context on `stream` with its error word (allocated and zeroed on the stream).
  [[nodiscard]] static expected<cuda_exec> make(cudaStream_t stream) {
    cuda_exec x(stream);
    int device = 0, major = 0, minor = 0;
    if (auto st = detail::cuda_check(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice");
        !st)
      return unexpected<error>(st.error());
    if (auto st = detail::cuda_check(
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
            "cudaDeviceGetAttribute");
        !st)
      return unexpected<error>(st.error());
    if (auto st = detail::cuda_check(
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
            "cudaDeviceGetAttribute");
        !st)
      return unexpected<error>(st.error());
    x.cc_ = 10 * major + minor;
    void* p = nullptr;
    if (auto st = detail::cuda_check(cudaMallocAsync(&p, sizeof(int), stream), "cudaMallocAsync");
        !st)
      return unexpected<error>(st.error());
    x.word_ = static_cast<int*>(p);
    if (auto st =
            detail::cuda_check(cudaMemsetAsync(x.word_, 0, sizeof(int), stream), "cudaMemsetAsync");
        !st)
      return unexpected<error>(st.error());
    return x;
  }
  cuda_exec(cuda_exec&& o) noexcept
      : cuda_copy_exec(o),
        word_(std::exchange(o.word_, nullptr)),
        counts_(o.counts_),
        blas_(std::move(o.blas_)),
        cc_(o.cc_) {}
  cuda_exec& operator=(cuda_exec&& o) noexcept {
    if (this != &o) {
      release();
      static_cast<cuda_copy_exec&>(*this) = o;
      word_ = std::exchange(o.word_, nullptr);
      counts_ = o.counts_;
      blas_ = std::move(o.blas_);
      cc_ = o.cc_;
    }
    return *this;
  }
  cuda_exec(const cuda_exec&) = delete;
  cuda_exec& operator=(const cuda_exec&) = delete;
  ~cuda_exec() { release(); }

  //! The device word the row kernels count bad indices into (simt_memory_ops).
  [[nodiscard]] int* fault_word() const noexcept { return word_; }

  //! The next host-side status call: the faults counted since the last one, as an error (the
  //! word is then zeroed). One device-to-host copy: it waits for the stream.
  [[nodiscard]] status device_status() {
    int n = 0;
    if (auto st = copy(row_view<const int, memory_space>(word_, 1, 1), row_view<int>(&n, 1, 1));
        !st)
      return st;
    if (n == 0) return {};
    if (auto st =
            detail::cuda_check(cudaMemsetAsync(word_, 0, sizeof(int), stream()), "cudaMemsetAsync");
        !st)
      return st;
    return make_error(errc::invalid_argument,
                      std::string(name) + ": " + detail::to_decimal(n) +
                          " indices outside their range in row operations since the last "
                          "device_status() (treated as no source)");
  }

  //! The compute capability of the stream's device, 10 major + minor (90: Hopper), read at make:
  //! which GEMM kernels can run (exec/cutlass_sm90.hpp's runs_here).
  [[nodiscard]] int compute_capability() const noexcept { return cc_; }

  //! The context's cuBLAS handle, made on first use (exec/cuda/cublas_gemm.hpp).
  [[nodiscard]] expected<const detail::cublas_handle*> blas() {
    if (!blas_) {
      auto h = detail::cublas_handle::make(stream());
      if (!h) return unexpected<error>(h.error());
      blas_ = std::move(*h);
    }
    return blas_.get();
  }

  //! The copies made so far.
  [[nodiscard]] const copy_counts& copies() const noexcept { return counts_; }
  void reset_copies() noexcept { counts_ = {}; }

  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, host_space> src, row_view<T, memory_space> dst) {
    return counted(cuda_copy_exec::copy(src, dst), src, counts_.to_device, counts_.bytes_to_device);
  }
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, host_space> dst) {
    return counted(cuda_copy_exec::copy(src, dst), src, counts_.to_host, counts_.bytes_to_host);
  }
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, memory_space> dst) {
    return counted(cuda_copy_exec::copy(src, dst), src, counts_.on_device, counts_.bytes_on_device);
  }

 private:
  explicit cuda_exec(cudaStream_t s) noexcept : cuda_copy_exec(s) {}
  void release() noexcept {
    if (word_) static_cast<void>(cudaFreeAsync(word_, stream()));
    word_ = nullptr;
    blas_.reset();
  }
  template <class U, class S>
  static status counted(status st, const row_view<U, S>& v, long long& calls, long long& bytes) {
    if (!st) return st;
    ++calls;
    bytes += static_cast<long long>(v.rows()) * v.width() * static_cast<long long>(sizeof(U));
    return st;
  }

  int* word_ = nullptr;
  copy_counts counts_{};
  std::unique_ptr<detail::cublas_handle> blas_{};
  int cc_ = 0;
};

//! Enqueues `kernel` on the context's stream (exec/cuda/cuda_launch.cuh says how); returns without
//! waiting.
template <class K>
requires simt_kernel<K>
[[nodiscard]] status launch(const cuda_exec& x, const launch_grid& grid, const K& kernel) {
  return detail::cuda_run(cuda_exec::name, x.stream(), grid, kernel);
}

//! A cuBLAS call of the cuBLAS backends (exec/blas_call.hpp), enqueued on the context's handle:
//! for the element types cublasGemmEx takes (elsewhere the backends do not run on cuda_exec).
template <class TA, class TB, class TC>
requires detail::blas_types_v<TA, TB, TC>
[[nodiscard]] status run_blas_call(cuda_exec& x, const blas_gemm_call<TA, TB, TC>& c) {
  auto h = x.blas();
  if (!h) return unexpected<error>(h.error());
  return detail::cublas_gemm(**h, c);
}

static_assert(execution_context<cuda_exec>);

}  // namespace v0_1
}  // namespace moefold
