//! @file cublas_dense.hpp
//! @brief cublas_dense<TA, TB, TC>: the grouped-GEMM backend (exec/grouped_gemm.hpp) of one
//! `cublasGemmEx` per group, fp32 compute: the router's three GEMMs, the shared expert, and the
//! benchmark's dense ceiling (one group each). Several groups are a loop of calls (a benchmark
//! column; the experts' grouped GEMMs are cutlass_sm90's and cublas_strided's).
//!
//! The row ranges must be on the host (cuBLAS takes its sizes from the host). Each group becomes
//! one column-major call (exec/blas_call.hpp); an empty group is skipped, or with rows_are_k and no
//! accumulate written as a K = 0 call, which BLAS defines as C = 0 (beta = 0). On cuda_exec the
//! call goes to cuBLAS on the context's handle and workspace (exec/cuda/cublas_gemm.hpp, so runs
//! repeat bit for bit); on host_exec and cpu_exec to host_blas, which checks it.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "../core/expected.hpp"
#include "blas_call.hpp"
#include "blas_engine.hpp"
#include "exec.hpp"
#include "grouped_gemm.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! The rules of the cuBLAS backends: the seam's, the element types, host row ranges, and every
//! group's call (its layout) for `who`.
template <class TA, class TB, class TC>
[[nodiscard]] status check_blas_args(const grouped_gemm_args<TA, TB, TC>& a, const char* who) {
  if (auto st = check_grouped_gemm_args(a, who); !st) return st;
  if constexpr (!blas_types_v<TA, TB, TC>) {
    return make_error(errc::not_supported,
                      std::string(who) +
                          ": cuBLAS takes A and B of one type and C of that type "
                          "(or fp32 for 16-bit inputs); got " +
                          std::string(to_string(dtype_of<TA>)) + " x " +
                          std::string(to_string(dtype_of<TB>)) + " -> " +
                          std::string(to_string(dtype_of<TC>)));
  }
  if (a.host_offsets.empty())
    return make_error(errc::not_supported, std::string(who) +
                                               ": needs the row ranges on the host (host_offsets): "
                                               "cuBLAS takes its sizes from the host");
  return {};
}

//! Runs group g's cuBLAS call on x (nothing for an empty group whose outputs keep their values).
template <class Exec, class TA, class TB, class TC>
[[nodiscard]] status run_blas_group(Exec& x, const grouped_gemm_args<TA, TB, TC>& a, int g,
                                    const char* who) {
  const long long first = a.host_offsets[g], rows = a.host_offsets[g + 1] - first;
  const bool by_m = a.grouping == kernels::gemm_grouping::rows_are_m;
  if (rows == 0 && (by_m || a.accumulate)) return {};
  auto call = blas_call_for(a, g, first, rows, who);
  if (!call) return unexpected<error>(call.error());
  return run_blas_call(x, *call);
}

}  // namespace detail

template <class TA, class TB, class TC>
class cublas_dense {
 public:
  using args_type = grouped_gemm_args<TA, TB, TC>;
  using call_type = blas_call_of_t<TA, TB, TC>;
  static constexpr const char* name = "cublas_dense";
  //! Where a cuBLAS call runs (exec/blas_engine.hpp): host_exec, cpu_exec (host_blas), cuda_exec
  //! with exec/cuda/cublas_gemm.hpp included.
  template <class Exec>
  static constexpr bool runs_on = detail::runs_blas_call<Exec, call_type>;

  //! The seam's rules, cuBLAS's element types, host row ranges, and a layout cuBLAS takes for
  //! every group (a unit stride in each operand, C row-major, sizes within int).
  [[nodiscard]] static status can_implement(const args_type& a) {
    if (auto st = detail::check_blas_args(a, name); !st) return st;
    for (int g = 0; g < a.groups; ++g) {
      const long long first = a.host_offsets[g];
      if (auto c = detail::blas_call_for(a, g, first, a.host_offsets[g + 1] - first, name); !c)
        return unexpected<error>(c.error());
    }
    return {};
  }
  //! None: the context's handle has its own.
  [[nodiscard]] static std::size_t workspace_bytes(const args_type&) { return 0; }

  //! Checks `a` and keeps it (host_offsets must stay valid until the last run()).
  template <class Exec>
  [[nodiscard]] status initialize(Exec&, const args_type& a, std::span<std::byte>) {
    ready_ = false;
    if (auto st = can_implement(a); !st) return st;
    a_ = a;
    ready_ = true;
    return {};
  }

  //! One call per group with work, enqueued on the context.
  template <class Exec>
  [[nodiscard]] status run(Exec& x) const {
    if (!ready_) return detail::not_initialized(name);
    for (int g = 0; g < a_.groups; ++g)
      if (auto st = detail::run_blas_group(x, a_, g, name); !st) return st;
    return {};
  }

 private:
  args_type a_{};
  bool ready_ = false;
};

}  // namespace v0_1
}  // namespace moefold
