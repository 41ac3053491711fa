//! @file simt_gemm.hpp
//! @brief simt_gemm<TA, TB, TC>: the grouped-GEMM backend (exec/grouped_gemm.hpp) of the portable
//! SIMT kernel (kernels/grouped_gemm.hpp), launched by launch_grouped_gemm on any execution
//! context: host_exec, cpu_exec (CI's checker), cuda_exec. The reference path every other backend
//! is compared with: each output one fma chain over k in ascending order, so its bits are those of
//! a direct launch of the kernel, on every context.
//!
//! Row ranges on the host: initialize() writes them into the workspace (groups + 1 integers in
//! the context's memory, by a kernel carrying them: nothing copied from the host, so a CUDA graph
//! captures the operation) and keeps the host span to size the grid exactly. Row ranges on the
//! context: no workspace, nothing written; the grid comes from row_bound (blocks past the real
//! tiles find none).
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include <moefold/kernels/grouped_gemm.hpp>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/workspace.hpp"
#include "exec.hpp"
#include "grouped_gemm.hpp"
#include "grouped_gemm_launch.hpp"

namespace moefold {
inline namespace v0_1 {

template <class TA, class TB, class TC>
class simt_gemm {
 public:
  using args_type = grouped_gemm_args<TA, TB, TC>;
  using kernel_type = kernels::grouped_gemm_kernel<TA, TB, TC>;
  static constexpr const char* name = "simt_gemm";
  //! Every execution context launches the kernel.
  template <class Exec>
  static constexpr bool runs_on = execution_context<Exec>;

  //! The rules of grouped_gemm_args (the kernel has no limits of its own).
  [[nodiscard]] static status can_implement(const args_type& a) {
    return detail::check_grouped_gemm_args(a, name);
  }

  //! The host offsets' copy on the context ([groups + 1] long long); 0 with device offsets.
  [[nodiscard]] static std::size_t workspace_bytes(const args_type& a) {
    if (a.host_offsets.empty()) return 0;
    workspace_carver c;
    (void)carve(c, a);
    return c.required();
  }

  //! Checks `a`, writes host offsets into `workspace` (memory of `x`; at least
  //! workspace_bytes(a)) and keeps the kernel's arguments. Enqueues the write, waits for nothing.
  //! host_offsets must stay valid until the last run(): they size its grid.
  template <execution_context Exec>
  [[nodiscard]] status initialize(Exec& x, const args_type& a, std::span<std::byte> workspace) {
    ready_ = false;
    if (auto st = can_implement(a); !st) return st;
    const long long* offsets = a.offsets;
    if (!a.host_offsets.empty()) {
      if (workspace.size() < workspace_bytes(a))
        return detail::workspace_too_small(name, workspace.size(), workspace_bytes(a));
      workspace_carver c(workspace);
      const std::span<long long> on_context = carve(c, a);  // [groups + 1]
      if (auto st = detail::copy_host_offsets(x, a, on_context); !st) return st;
      offsets = on_context.data();
    }
    kernel_ = kernel_type{.grouping = a.grouping,
                          .offsets = offsets,
                          .groups = a.groups,
                          .m = a.m,
                          .n = a.n,
                          .k = a.k,
                          .a = a.a,
                          .b = a.b,
                          .c = a.c,
                          .accumulate = a.accumulate};
    host_offsets_ = a.host_offsets;
    row_bound_ = a.row_bound;
    exec_ = &detail::exec_tag<Exec>;
    ready_ = true;
    return {};
  }

  //! Launches the kernel on `x` (the kind of context initialize() had): the grid from the host
  //! offsets when given, else from row_bound. Nothing is launched when there is no output tile.
  template <execution_context Exec>
  [[nodiscard]] status run(Exec& x) const {
    if (!ready_ || exec_ != &detail::exec_tag<Exec>)
      return make_error(errc::invalid_argument,
                        std::string(name) + ": run() on " + Exec::name +
                            (ready_ ? " after initialize() on another kind of context"
                                    : " before a successful initialize()"));
    if (host_offsets_.empty()) return launch_grouped_gemm(x, kernel_, row_bound_);
    return launch_grouped_gemm(x, kernel_, host_offsets_);
  }

 private:
  // The one layout of the workspace, measured (empty carver) and carved alike.
  static std::span<long long> carve(workspace_carver& c, const args_type& a) {
    return c.take<long long>(a.host_offsets.size());
  }

  kernel_type kernel_{};
  std::span<const long long> host_offsets_{};
  long long row_bound_ = 0;
  const char* exec_ = nullptr;
  bool ready_ = false;
};

}  // namespace v0_1
}  // namespace moefold
