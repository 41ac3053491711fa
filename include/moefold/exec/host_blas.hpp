//! @file host_blas.hpp
//! @brief host_blas: executes, on memory the CPU can address, the very descriptions the GPU
//! backends hand their libraries (a cuBLAS call, exec/blas_call.hpp; a pointer-array grouped
//! GEMM's argument arrays, kernels/grouped_gemm_arrays.hpp), after asserting the rules those
//! libraries document. On host_exec and cpu_exec it is what the cuBLAS and CUTLASS backends run
//! (exec/cublas_dense.hpp, cublas_strided.hpp, cutlass_sm90.hpp), so CI proves every backend's
//! bookkeeping (transposes, leading dimensions, pointer arrays, strides, beta, empty groups) on
//! the whole layer without a GPU.
//!
//! Arithmetic: each output one fma chain over k in ascending order from 0 in the accumulator of
//! kernels/grouped_gemm.hpp (fp32; fp64 for fp64 operands), then + C once with accumulate and one
//! rounding to the output type: simt_gemm's arithmetic, so a backend's result on the CPU equals
//! simt_gemm's bit for bit whenever its description is right (the tests' check).
//!
//! The rules asserted (a broken one is an error naming it, nothing is computed):
//! - cuBLAS (cublasGemmEx, cublasGemmStridedBatchedEx): m, n, k, batch >= 0; lda >= max(1, rows
//!   of A as stored), ldb and ldc likewise; operands present and aligned to their element type
//!   where read or written.
//! - CUTLASS's sm90 grouped GEMM (TMA): per group M, N, K >= 0 and never (M, N, 0) with M N > 0
//!   (its accumulators are not initialized then); for a group with work, every operand's address
//!   16-byte aligned, its leading dimension and its contiguous extent a multiple of 16 bytes, the
//!   leading dimension at least the contiguous extent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <moefold/kernels/grouped_gemm.hpp>
#include <moefold/kernels/grouped_gemm_arrays.hpp>
#include <moefold/kernels/simt/math.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "blas_call.hpp"

namespace moefold {
inline namespace v0_1 {

struct host_blas {
  static constexpr const char* name = "host_blas";

  //! Executes a cuBLAS call (every matrix of its batch) on host memory.
  template <class TA, class TB, class TC>
  [[nodiscard]] static status gemm(const blas_gemm_call<TA, TB, TC>& c) {
    if (auto st = check(c); !st) return st;
    using acc_t = typename kernels::grouped_gemm_kernel<TA, TB, TC>::acc_t;
    if (c.m == 0 || c.n == 0 || (c.k == 0 && c.accumulate)) return {};  // BLAS's quick return
    for (int i = 0; i < c.batch; ++i) {
      const TA* a = c.a + i * c.stride_a;
      const TB* b = c.b + i * c.stride_b;
      TC* out = c.c + i * c.stride_c;
      for (long long col = 0; col < c.n; ++col)
        for (long long row = 0; row < c.m; ++row) {
          acc_t acc(0);
          for (long long q = 0; q < c.k; ++q) {
            const TA& x = c.transa == blas_op::n ? a[row + q * c.lda] : a[q + row * c.lda];
            const TB& y = c.transb == blas_op::n ? b[q + col * c.ldb] : b[col + q * c.ldb];
            acc = kernels::simt::fma(acc_t(detail::widen(x)), acc_t(detail::widen(y)), acc);
          }
          store(out[row + col * c.ldc], acc, c.accumulate);
        }
    }
    return {};
  }

  //! Executes a pointer-array grouped GEMM's arrays (host memory, as are the operands):
  //! D_g (M, N) = A_g (M, K) B_g (K, N) (+ C_g with accumulate), D_g = C_g.
  template <class TA, class TB, class TC>
  [[nodiscard]] static status grouped(const kernels::grouped_gemm_arrays<TA, TB, TC>& g) {
    using acc_t = typename kernels::grouped_gemm_kernel<TA, TB, TC>::acc_t;
    using kernels::gemm_major;
    for (int e = 0; e < g.groups; ++e)
      if (auto st = check(g, e); !st) return st;
    for (int e = 0; e < g.groups; ++e) {
      const long long M = g.shapes[3 * e], N = g.shapes[3 * e + 1], K = g.shapes[3 * e + 2];
      if (M == 0 || N == 0) continue;
      const TA* a = g.a[e];
      const TB* b = g.b[e];
      TC* d = g.c[e];
      const long long lda = g.lda[e], ldb = g.ldb[e], ldc = g.ldc[e];
      for (long long i = 0; i < M; ++i)
        for (long long j = 0; j < N; ++j) {
          acc_t acc(0);
          for (long long q = 0; q < K; ++q) {
            const TA& x = g.a_major == gemm_major::k ? a[i * lda + q] : a[i + q * lda];
            const TB& y = g.b_major == gemm_major::k ? b[q + j * ldb] : b[q * ldb + j];
            acc = kernels::simt::fma(acc_t(detail::widen(x)), acc_t(detail::widen(y)), acc);
          }
          store(d[i * ldc + j], acc, g.accumulate);
        }
    }
    return {};
  }

 private:
  template <class TC, class Acc>
  static void store(TC& out, Acc acc, bool accumulate) {
    const Acc v = accumulate ? kernels::simt::add(Acc(detail::widen(out)), acc) : acc;
    out = detail::narrow<TC>(static_cast<accumulator_t<TC>>(v));
  }

  static status fail(const std::string& lib, const std::string& what) {
    return make_error(errc::invalid_argument, std::string(name) + ": " + lib + ": " + what);
  }
  static std::string dec(long long v) { return detail::to_decimal(v); }
  template <class T>
  static bool aligned(const T* p, std::size_t bytes) {
    return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
  }

  template <class TA, class TB, class TC>
  static status check(const blas_gemm_call<TA, TB, TC>& c) {
    const char* lib = "cuBLAS";
    const auto max1 = [](long long v) { return v > 1 ? v : 1; };
    if (c.m < 0 || c.n < 0 || c.k < 0 || c.batch < 0)
      return fail(lib, "m, n, k and batch must be >= 0 (got " + dec(c.m) + ", " + dec(c.n) + ", " +
                           dec(c.k) + ", " + dec(c.batch) + ")");
    const long long rows_a = c.transa == blas_op::n ? c.m : c.k;
    const long long rows_b = c.transb == blas_op::n ? c.k : c.n;
    if (c.lda < max1(rows_a))
      return fail(lib, "lda = " + dec(c.lda) + " < max(1, rows of A) = " + dec(max1(rows_a)));
    if (c.ldb < max1(rows_b))
      return fail(lib, "ldb = " + dec(c.ldb) + " < max(1, rows of B) = " + dec(max1(rows_b)));
    if (c.ldc < max1(c.m))
      return fail(lib, "ldc = " + dec(c.ldc) + " < max(1, m) = " + dec(max1(c.m)));
    if (c.batch == 0 || c.m == 0 || c.n == 0) return {};
    if (c.c == nullptr || !aligned(c.c, alignof(TC)))
      return fail(lib, "C must be present and aligned to its element type");
    if (c.k > 0 && (c.a == nullptr || !aligned(c.a, alignof(TA)) || c.b == nullptr ||
                    !aligned(c.b, alignof(TB))))
      return fail(lib, "A and B must be present and aligned to their element types");
    return {};
  }

  template <class TA, class TB, class TC>
  static status check(const kernels::grouped_gemm_arrays<TA, TB, TC>& g, int e) {
    using kernels::gemm_major;
    const std::string lib = "CUTLASS grouped GEMM, group " + dec(e);
    const long long M = g.shapes[3 * e], N = g.shapes[3 * e + 1], K = g.shapes[3 * e + 2];
    if (M < 0 || N < 0 || K < 0)
      return fail(lib,
                  "M, N and K must be >= 0 (got " + dec(M) + ", " + dec(N) + ", " + dec(K) + ")");
    if (M == 0 || N == 0) return {};
    if (K == 0)
      return fail(lib,
                  "K = 0 with M N > 0: the kernel does not initialize its accumulators "
                  "(write the group as (0, 0, 0))");
    // Which extent of each operand is contiguous, and its leading dimension.
    const long long a_inner = g.a_major == gemm_major::k ? K : M;
    const long long b_inner = g.b_major == gemm_major::k ? K : N;
    const auto operand = [&](const char* what, const void* p, long long ld, long long inner,
                             std::size_t size) -> status {
      const long long ib = inner * static_cast<long long>(size),
                      lb = ld * static_cast<long long>(size);
      if (p == nullptr || !aligned(static_cast<const std::byte*>(p), 16))
        return fail(lib, std::string(what) + "'s address must be 16-byte aligned (TMA)");
      if (lb % 16 != 0)
        return fail(lib, std::string(what) + "'s leading dimension (" + dec(ld) +
                             " elements) must be a multiple of 16 bytes (TMA)");
      if (ib % 16 != 0)
        return fail(lib, std::string(what) + "'s contiguous extent (" + dec(inner) +
                             " elements) must be a multiple of 16 bytes");
      if (ld < inner)
        return fail(lib, std::string(what) + "'s leading dimension (" + dec(ld) +
                             ") must be >= its contiguous extent (" + dec(inner) + ")");
      return {};
    };
    if (auto st = operand("A", g.a[e], g.lda[e], a_inner, sizeof(TA)); !st) return st;
    if (auto st = operand("B", g.b[e], g.ldb[e], b_inner, sizeof(TB)); !st) return st;
    return operand("C", g.c[e], g.ldc[e], N, sizeof(TC));
  }
};

}  // namespace v0_1
}  // namespace moefold
