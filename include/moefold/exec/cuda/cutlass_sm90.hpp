//! @file cutlass_sm90.hpp
//! @brief Where cutlass_sm90's arrays run on cuda_exec (exec/cutlass_sm90.hpp): CUTLASS's Hopper
//! pointer-array grouped GEMM, compiled once in the units of the `moefold_cutlass_sm90` library
//! (exec/cuda/cutlass_sm90_units/*.cu over cutlass_sm90_kernel.cuh, one kernel per unit, built
//! where the CUTLASS headers are: meson option `cutlass`, scripts/setup.sh installs them). This
//! header needs neither CUTLASS nor nvcc: it declares the units' entry points, and cuda_exec.cuh
//! includes it where the build defines MOEFOLD_CUTLASS_SM90 (with the library linked), so that
//! cutlass_sm90 runs on cuda_exec there and falls back to cuBLAS elsewhere. Every translation
//! unit of a program must agree on MOEFOLD_CUTLASS_SM90 (the build's dependency sets it).
//!
//! The kernels need compute capability 9.0 (wgmma, TMA): on another GPU the backend declines at
//! initialize (cutlass_sm90::runs_here) and the GEMM falls back.
#pragma once

#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>
#include <span>

#include <moefold/kernels/grouped_gemm_arrays.hpp>

#include "../../core/dtype.hpp"
#include "../../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {

class cuda_exec;

namespace detail {
// The three kernels (exec/cutlass_sm90.hpp's cutlass_sm90_layouts), one per unit: the arrays,
// the workspace's CUTLASS part (library_workspace_bytes), the stream.
[[nodiscard]] status cutlass_sm90_run_kk_bf16(
    const kernels::grouped_gemm_arrays<bfloat16, bfloat16, bfloat16>& g,
    std::span<std::byte> workspace, cudaStream_t stream);
[[nodiscard]] status cutlass_sm90_run_kn_bf16(
    const kernels::grouped_gemm_arrays<bfloat16, bfloat16, bfloat16>& g,
    std::span<std::byte> workspace, cudaStream_t stream);
[[nodiscard]] status cutlass_sm90_run_mn_f32(
    const kernels::grouped_gemm_arrays<bfloat16, bfloat16, float>& g,
    std::span<std::byte> workspace, cudaStream_t stream);
}  // namespace detail

//! The grouped GEMM's arrays on cuda_exec's stream (a template so that cuda_exec, declared here
//! only, is complete where it is called).
template <class Exec, class TC>
requires std::same_as<Exec, cuda_exec>
[[nodiscard]] status run_gemm_arrays(Exec& x,
                                     const kernels::grouped_gemm_arrays<bfloat16, bfloat16, TC>& g,
                                     std::span<std::byte> workspace) {
  using kernels::gemm_major;
  if constexpr (std::same_as<TC, float>) {
    if (g.a_major == gemm_major::mn && g.b_major == gemm_major::mn)
      return detail::cutlass_sm90_run_mn_f32(g, workspace, x.stream());
  } else if constexpr (std::same_as<TC, bfloat16>) {
    if (g.a_major == gemm_major::k && g.b_major == gemm_major::k)
      return detail::cutlass_sm90_run_kk_bf16(g, workspace, x.stream());
    if (g.a_major == gemm_major::k && g.b_major == gemm_major::mn)
      return detail::cutlass_sm90_run_kn_bf16(g, workspace, x.stream());
  }
  return make_error(errc::not_supported,
                    "cutlass_sm90: no kernel instantiated for these operand majors and C type");
}

}  // namespace v0_1
}  // namespace moefold
