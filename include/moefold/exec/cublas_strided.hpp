//! @file cublas_strided.hpp
//! @brief cublas_strided<TA, TB, TC>: the grouped-GEMM backend (exec/grouped_gemm.hpp) of one
//! `cublasGemmStridedBatchedEx`, fp32 compute, for pad mode: every expert holds the same number
//! of rows R (the capacity), so the groups are one strided batch (measured on an H200 at 0.95-1.03
//! of the dense rate from 1,024 rows per expert). One call whatever the groups: capturable in a
//! CUDA graph.
//!
//! The row ranges must be on the host and evenly spaced: host_offsets[g] = g R. Group g's
//! operands are group 0's moved by g times a fixed stride (rows_are_m: R rows of A and C, one
//! per-expert B; rows_are_k: R rows of A and B, one per-expert C). R = 0: nothing, or with
//! rows_are_k and no accumulate a K = 0 batch, which BLAS defines as C = 0. On cuda_exec the call
//! goes to cuBLAS (exec/cuda/cublas_gemm.hpp); on host_exec and cpu_exec to host_blas.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "../core/expected.hpp"
#include "blas_call.hpp"
#include "blas_engine.hpp"
#include "cublas_dense.hpp"
#include "exec.hpp"
#include "grouped_gemm.hpp"

namespace moefold {
inline namespace v0_1 {

template <class TA, class TB, class TC>
class cublas_strided {
 public:
  using args_type = grouped_gemm_args<TA, TB, TC>;
  using call_type = blas_call_of_t<TA, TB, TC>;
  static constexpr const char* name = "cublas_strided";
  //! Where a cuBLAS call runs (exec/blas_engine.hpp).
  template <class Exec>
  static constexpr bool runs_on = detail::runs_blas_call<Exec, call_type>;

  //! The seam's rules, cuBLAS's element types, host row ranges evenly spaced, and a layout cuBLAS
  //! takes (a unit stride in each operand, C row-major, sizes within int).
  [[nodiscard]] static status can_implement(const args_type& a) {
    if (auto c = call_of(a); !c) return unexpected<error>(c.error());
    return {};
  }
  //! None: the context's handle has its own.
  [[nodiscard]] static std::size_t workspace_bytes(const args_type&) { return 0; }

  //! Checks `a` and keeps the call.
  template <class Exec>
  [[nodiscard]] status initialize(Exec&, const args_type& a, std::span<std::byte>) {
    ready_ = false;
    auto c = call_of(a);
    if (!c) return unexpected<error>(c.error());
    call_ = *c;
    skip_ = a.host_offsets[1] == 0 &&
            (a.grouping == kernels::gemm_grouping::rows_are_m || a.accumulate);
    ready_ = true;
    return {};
  }

  //! The one batched call, enqueued on the context (none when no output changes).
  template <class Exec>
  [[nodiscard]] status run(Exec& x) const {
    if (!ready_) return detail::not_initialized(name);
    if (skip_) return {};
    return run_blas_call(x, call_);
  }

 private:
  static expected<call_type> call_of(const args_type& a) {
    if (auto st = detail::check_blas_args(a, name); !st) return unexpected<error>(st.error());
    const auto& h = a.host_offsets;
    const long long R = h[1];
    for (int g = 1; g <= a.groups; ++g)
      if (h[g] != g * R)
        return make_error(errc::not_supported,
                          std::string(name) +
                              ": every group must hold the same rows (pad mode): "
                              "host_offsets[" +
                              detail::to_decimal(g) + "] = " + detail::to_decimal(h[g]) + ", not " +
                              detail::to_decimal(g) + " x " + detail::to_decimal(R));
    auto c = detail::blas_call_for(a, 0, 0, R, name);
    if (!c) return c;
    // Group g = group 0 moved along the grouped rows (R of them) or to the next expert.
    const bool by_m = a.grouping == kernels::gemm_grouping::rows_are_m;
    c->batch = a.groups;
    c->stride_a = by_m ? a.b.group_stride : R * a.b.s0;
    c->stride_b = by_m ? R * a.a.s0 : R * a.a.s1;
    c->stride_c = by_m ? R * a.c.s0 : a.c.group_stride;
    return c;
  }

  call_type call_{};
  bool skip_ = false;
  bool ready_ = false;
};

}  // namespace v0_1
}  // namespace moefold
