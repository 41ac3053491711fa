//! @file blas_engine.hpp
//! @brief Where the library backends' descriptions run: `run_blas_call(x, call)` (a cuBLAS call,
//! exec/blas_call.hpp) and `run_gemm_arrays(x, arrays, workspace)` (a pointer-array grouped
//! GEMM, kernels/grouped_gemm_arrays.hpp), found by argument-dependent lookup on the context.
//! Here: contexts whose memory the CPU addresses (host_exec, cpu_exec) run them on host_blas. On
//! cuda_exec, exec/cuda/cublas_gemm.hpp runs the cuBLAS call and exec/cuda/cutlass_sm90.cuh the
//! arrays. A backend runs on the contexts for which these are declared (its `runs_on`).
//!
//! Which element types the libraries take is stated here too, so that can_implement refuses the
//! same on every context: cuBLAS's GemmEx with fp32 compute (16-bit inputs into their own type
//! or fp32, fp32 and fp64 into their own), CUTLASS's kernels as moefold instantiates them (bf16
//! inputs into bf16 or fp32; exec/cutlass_sm90.hpp lists the layouts).
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include <moefold/kernels/grouped_gemm_arrays.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "blas_call.hpp"
#include "exec.hpp"
#include "host_blas.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! A context whose memory is the host's (host_space, or cpu_exec's cpu_device_space).
template <class Exec>
concept cpu_addressable_context = execution_context<Exec> &&
    (std::is_same_v<typename Exec::memory_space, host_space> ||
     std::is_same_v<typename Exec::memory_space, cpu_device_space>);

//! Whether a cuBLAS call of type Call runs on Exec (the cuBLAS backends' runs_on).
template <class Exec, class Call>
concept runs_blas_call = requires(Exec& x, const Call& c) {
  { run_blas_call(x, c) } -> std::same_as<status>;
};

//! The element types cublasGemmEx takes with fp32 (fp64) compute: A and B of one type; C of that
//! type, or fp32 for 16-bit inputs.
template <class TA, class TB, class TC>
inline constexpr bool blas_types_v = std::is_same_v<TA, TB> &&
                                     ((std::is_same_v<TA, bfloat16> || std::is_same_v<TA, float16>)
                                          ? (std::is_same_v<TC, TA> || std::is_same_v<TC, float>)
                                          : ((std::is_same_v<TA, float> ||
                                              std::is_same_v<TA, double>)&&std::is_same_v<TC, TA>));

}  // namespace detail

//! A cuBLAS call on host memory: host_blas.
template <class Exec, class TA, class TB, class TC>
requires detail::cpu_addressable_context<Exec>
[[nodiscard]] status run_blas_call(Exec&, const blas_gemm_call<TA, TB, TC>& c) {
  return host_blas::gemm(c);
}

//! A pointer-array grouped GEMM on host memory: host_blas (no workspace of its own).
template <class Exec, class TA, class TB, class TC>
requires detail::cpu_addressable_context<Exec>
[[nodiscard]] status run_gemm_arrays(Exec&, const kernels::grouped_gemm_arrays<TA, TB, TC>& g,
                                     std::span<std::byte>) {
  return host_blas::grouped(g);
}

}  // namespace v0_1
}  // namespace moefold
