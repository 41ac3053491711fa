//! @file cutlass_sm90.hpp
//! @brief cutlass_sm90<TA, TB, TC>: the grouped-GEMM backend (exec/grouped_gemm.hpp) of CUTLASS's
//! Hopper pointer-array grouped GEMM (TMA loads, warp-specialized wgmma, one persistent launch
//! over every group's tiles), bf16 in, fp32 accumulate, for dropless: the problem shapes are read
//! from device memory, so the experts' rows come from the dispatch's device offsets with nothing
//! read back. No split-K or stream-K: runs repeat bit for bit.
//!
//! This header is portable: initialize() writes the kernel's argument arrays on the context with a
//! portable kernel (kernels/grouped_gemm_arrays.hpp) and run() hands them to
//! `run_gemm_arrays(x, arrays, workspace)` (exec/blas_engine.hpp): host_blas on host_exec and
//! cpu_exec, which asserts CUTLASS's rules and computes the same products; CUTLASS itself on
//! cuda_exec (exec/cuda/cutlass_sm90.cuh, built where the CUTLASS headers are).
//!
//! What can_implement accepts is what moefold instantiates (one CUTLASS kernel per translation
//! unit, each about 70 s of nvcc): bf16 A and B, and
//! - A K-major, B K-major, C bf16: fc1 and fc2 forward (x W1^T, h W2^T);
//! - A K-major, B N-major, C bf16: the data gradients (dy W2, da W1);
//! - A M-major, B N-major, C fp32 with accumulate: the weight gradients into fp32 main gradients.
//! The grouped dimension (the rows of the dispatch) must not be an operand's contiguous one, and
//! TMA needs 16-byte aligned operands whose leading dimensions and contiguous extents are
//! multiples of 16 bytes. An empty group becomes the shape (0, 0, 0): CUTLASS 4.2's sm90 grouped
//! kernel does not initialize its accumulators for K = 0, so outputs that must become 0 (an empty
//! group of rows_are_k, or k = 0, without accumulate) are refused here rather than left unwritten.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include <moefold/kernels/grouped_gemm.hpp>
#include <moefold/kernels/grouped_gemm_arrays.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../core/workspace.hpp"
#include "blas_engine.hpp"
#include "exec.hpp"
#include "grouped_gemm.hpp"

namespace moefold {
inline namespace v0_1 {

//! One CUTLASS kernel moefold instantiates: the operands' majors and C's element type.
struct cutlass_sm90_layout {
  kernels::gemm_major a, b;
  dtype c;
  bool accumulate;  //!< beta = 1 (weight gradients), else beta = 0
};
//! The kernels exec/cuda/cutlass_sm90_*.cu instantiate (see the file comment).
inline constexpr cutlass_sm90_layout cutlass_sm90_layouts[] = {
    {kernels::gemm_major::k, kernels::gemm_major::k, dtype::bf16, false},
    {kernels::gemm_major::k, kernels::gemm_major::mn, dtype::bf16, false},
    {kernels::gemm_major::mn, kernels::gemm_major::mn, dtype::f32, true},
};

template <class TA, class TB, class TC>
class cutlass_sm90 {
 public:
  using args_type = grouped_gemm_args<TA, TB, TC>;
  using arrays_type = kernels::grouped_gemm_arrays<TA, TB, TC>;
  static constexpr const char* name = "cutlass_sm90";
  //! Where the arrays run (exec/blas_engine.hpp): host_exec, cpu_exec (host_blas), cuda_exec with
  //! exec/cuda/cutlass_sm90.cuh included.
  template <class Exec>
  static constexpr bool runs_on = requires(Exec& x, const arrays_type& g, std::span<std::byte> w) {
    { run_gemm_arrays(x, g, w) } -> std::same_as<status>;
  };
  //! Bytes at the end of the workspace for CUTLASS's own: the TMA descriptors its kernel rewrites
  //! per group, 128 bytes per operand per SM (five of them: 84 KB on a 132-SM H100 or H200), and
  //! its tile scheduler's. The GPU side refuses a kernel that asks for more.
  static constexpr std::size_t library_workspace_bytes = std::size_t{128} << 10;

  //! Whether the kernels run on x's device: compute capability 9.0 (wgmma, TMA), where the
  //! context tells its device's (cuda_exec); everywhere else (host_blas).
  template <class Exec>
  [[nodiscard]] static status runs_here(const Exec& x) {
    if constexpr (requires { x.compute_capability(); }) {
      if (x.compute_capability() != 90)
        return make_error(errc::not_supported,
                          std::string(name) +
                              ": the kernels need compute capability 9.0 (wgmma, TMA); this "
                              "device has " +
                              detail::to_decimal(x.compute_capability() / 10) + "." +
                              detail::to_decimal(x.compute_capability() % 10));
    }
    return {};
  }

  //! The seam's rules and the kernels' (see the file comment), each named in the message.
  [[nodiscard]] static status can_implement(const args_type& a) {
    if (auto st = detail::check_grouped_gemm_args(a, name); !st) return st;
    const auto fail = [](const std::string& what) {
      return status(make_error(errc::not_supported, std::string(name) + ": " + what));
    };
    if constexpr (!std::is_same_v<TA, bfloat16> || !std::is_same_v<TB, bfloat16> ||
                  !(std::is_same_v<TC, bfloat16> || std::is_same_v<TC, float>)) {
      return fail("takes bf16 A and B into bf16 or fp32 C; got " +
                  std::string(to_string(dtype_of<TA>)) + " x " +
                  std::string(to_string(dtype_of<TB>)) + " -> " +
                  std::string(to_string(dtype_of<TC>)));
    } else {
      const bool by_m = a.grouping == kernels::gemm_grouping::rows_are_m;
      const form f = form_of(a);
      if (!f.ok) return fail("each operand needs a unit stride (A, B) and C row-major (c.s1 = 1)");
      const bool known = [&] {
        for (const auto& l : cutlass_sm90_layouts)
          if (l.a == f.a && l.b == f.b && l.c == dtype_of<TC> && l.accumulate == a.accumulate)
            return true;
        return false;
      }();
      if (!known)
        return fail(std::string("no kernel instantiated for A ") + major_name(f.a) + ", B " +
                    major_name(f.b) + ", C " + to_string(dtype_of<TC>) +
                    (a.accumulate ? " with" : " without") +
                    " accumulate (K-major x K-major and K-major x N-major into bf16, M-major x "
                    "N-major into fp32 with accumulate)");
      // The grouped dimension is M (A's rows) or K (A's columns, B's rows).
      if ((by_m && f.a == kernels::gemm_major::mn) ||
          (!by_m && (f.a == kernels::gemm_major::k || f.b == kernels::gemm_major::k)))
        return fail(
            "the grouped dimension must not be an operand's contiguous one (each "
            "group's first row would break TMA's 16-byte alignment)");
      if (!a.accumulate && (!by_m || a.k == 0))
        return fail(
            "outputs without terms (an empty group of rows_are_k, or k = 0) must keep "
            "their values (accumulate): the kernel leaves them unwritten, not 0");
      const long long a_inner = f.a == kernels::gemm_major::k ? a.k : a.m;
      const long long b_inner = f.b == kernels::gemm_major::k ? a.k : a.n;
      if (auto st = aligned("A", a.a.data, f.lda, a_inner, sizeof(TA)); !st) return st;
      if (auto st = aligned("B", a.b.data, f.ldb, b_inner, sizeof(TB)); !st) return st;
      if (auto st = aligned("C", a.c.data, a.c.s0, a.n, sizeof(TC)); !st) return st;
      const long long gs = by_m ? a.b.group_stride * static_cast<long long>(sizeof(TB))
                                : a.c.group_stride * static_cast<long long>(sizeof(TC));
      if (a.groups > 1 && gs % 16 != 0)
        return fail(std::string(by_m ? "B" : "C") +
                    "'s group stride must be a multiple of 16 bytes (each group's operand "
                    "16-byte aligned)");
      if (a.n > INT32_MAX || a.m > INT32_MAX || a.k > INT32_MAX ||
          (by_m ? a.row_bound : 0) > INT32_MAX)
        return fail("every size must fit CUTLASS's int problem shapes");
      return {};
    }
  }

  //! The arrays (and the row ranges' copy when they are on the host) in the context's memory,
  //! then library_workspace_bytes for CUTLASS.
  [[nodiscard]] static std::size_t workspace_bytes(const args_type& a) {
    workspace_carver c;
    (void)carve(c, a);
    return c.required();
  }

  //! Checks `a`, copies host row ranges into the workspace and enqueues the kernel that writes
  //! the arrays from them. Waits for nothing; the workspace must stay until the last run().
  template <class Exec>
  [[nodiscard]] status initialize(Exec& x, const args_type& a, std::span<std::byte> workspace) {
    ready_ = false;
    if (auto st = can_implement(a); !st) return st;
    if (auto st = runs_here(x); !st) return st;
    workspace_carver c(workspace);
    const parts p = carve(c, a);
    if (!c.fits()) return detail::workspace_too_small(name, workspace.size(), workspace_bytes(a));
    const long long* offsets = a.offsets;
    if (!a.host_offsets.empty()) {
      if (auto st = detail::copy_host_offsets(x, a, p.offsets); !st) return st;
      offsets = p.offsets.data();
    }
    const form f = form_of(a);
    arrays_ = p.arrays;
    arrays_.a_major = f.a;
    arrays_.b_major = f.b;
    arrays_.accumulate = a.accumulate;
    const kernels::grouped_gemm_arrays_kernel<TA, TB, TC> k{.grouping = a.grouping,
                                                            .offsets = offsets,
                                                            .m = a.m,
                                                            .n = a.n,
                                                            .k = a.k,
                                                            .a = a.a,
                                                            .b = a.b,
                                                            .c = a.c,
                                                            .lda = f.lda,
                                                            .ldb = f.ldb,
                                                            .ldc = a.c.s0,
                                                            .out = arrays_};
    using K = decltype(k);
    if (auto st =
            launch(x, launch_grid{.blocks = capped_blocks<Exec>(a.groups, K::block_threads)}, k);
        !st)
      return st;
    library_ = p.library;
    ready_ = true;
    return {};
  }

  //! The grouped GEMM over the arrays, enqueued on the context.
  template <class Exec>
  [[nodiscard]] status run(Exec& x) const {
    if (!ready_) return detail::not_initialized(name);
    return run_gemm_arrays(x, arrays_, library_);
  }

  //! The arrays initialize() wrote (context memory): what run() hands CUTLASS.
  [[nodiscard]] const arrays_type& arrays() const noexcept { return arrays_; }

 private:
  // Each operand's major and its leading dimension (C row-major: ldc = c.s0).
  struct form {
    kernels::gemm_major a = kernels::gemm_major::k, b = kernels::gemm_major::k;
    long long lda = 0, ldb = 0;
    bool ok = false;
  };
  static form form_of(const args_type& a) {
    form f;
    if (a.a.s1 == 1)
      f.a = kernels::gemm_major::k, f.lda = a.a.s0;
    else if (a.a.s0 == 1)
      f.a = kernels::gemm_major::mn, f.lda = a.a.s1;
    else
      return f;
    if (a.b.s0 == 1)
      f.b = kernels::gemm_major::k, f.ldb = a.b.s1;
    else if (a.b.s1 == 1)
      f.b = kernels::gemm_major::mn, f.ldb = a.b.s0;
    else
      return f;
    f.ok = a.c.s1 == 1;
    return f;
  }
  static const char* major_name(kernels::gemm_major m) {
    return m == kernels::gemm_major::k ? "K-major" : "MN-major";
  }
  // An operand's base, leading dimension and contiguous extent (fixed: the grouped dimension is
  // never contiguous) for TMA: 16-byte multiples, ld >= extent.
  static status aligned(const char* what, const void* p, long long ld, long long inner,
                        std::size_t size) {
    const auto fail = [&](const std::string& rule) {
      return status(make_error(errc::not_supported,
                               std::string(name) + ": " + what + "'s " + rule + " (TMA)"));
    };
    const long long s = static_cast<long long>(size);
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0)
      return fail("address must be 16-byte aligned");
    if ((ld * s) % 16 != 0)
      return fail("leading dimension (" + detail::to_decimal(ld) +
                  " elements) must be a multiple of 16 bytes");
    if ((inner * s) % 16 != 0)
      return fail("contiguous extent (" + detail::to_decimal(inner) +
                  " elements) must be a multiple of 16 bytes");
    if (ld < inner)
      return fail("leading dimension (" + detail::to_decimal(ld) +
                  ") must be >= " + detail::to_decimal(inner));
    return {};
  }

  struct parts {
    std::span<long long> offsets;  // [groups + 1] the host row ranges' copy (host offsets only)
    arrays_type arrays;
    std::span<std::byte> library;  // CUTLASS's workspace
  };
  // The one layout of the workspace, measured (empty carver) and carved alike.
  static parts carve(workspace_carver& c, const args_type& a) {
    const auto L = static_cast<std::size_t>(a.groups > 0 ? a.groups : 0);
    parts p;
    p.offsets = c.take<long long>(a.host_offsets.empty() ? 0 : L + 1);
    p.arrays.groups = a.groups;
    p.arrays.shapes = c.take<int>(3 * L).data();
    p.arrays.a = c.take<const TA*>(L).data();
    p.arrays.b = c.take<const TB*>(L).data();
    p.arrays.c = c.take<TC*>(L).data();
    p.arrays.lda = c.take<long long>(L).data();
    p.arrays.ldb = c.take<long long>(L).data();
    p.arrays.ldc = c.take<long long>(L).data();
    p.library = c.take<std::byte>(library_workspace_bytes);
    return p;
  }

  arrays_type arrays_{};
  std::span<std::byte> library_{};
  bool ready_ = false;
};

}  // namespace v0_1
}  // namespace moefold
