//! @file blas_call.hpp
//! @brief The column-major GEMM a cuBLAS backend hands cuBLAS (`cublasGemmEx`, or
//! `cublasGemmStridedBatchedEx` for a batch), as plain data: the one description that the GPU
//! runs and host_blas (exec/host_blas.hpp) executes on the CPU, so the translation from the
//! seam's row-major, strided grouped GEMM (exec/grouped_gemm.hpp) is tested without a GPU.
//!
//! The translation: the seam's group computes C [M, N] = A [M, K] B [K, N] with C row-major
//! (c.s1 = 1). Read column-major, C is C^T [N, M] with leading dimension c.s0, and
//! C^T = B^T A^T: cuBLAS's (m, n, k) = (N, M, K), its A the seam's B and its B the seam's A, each
//! taken as stored (op N) or transposed (op T) by which of its strides is 1.
#pragma once

#include <algorithm>
#include <climits>
#include <string>

#include "../core/expected.hpp"
#include "grouped_gemm.hpp"

namespace moefold {
inline namespace v0_1 {

//! cuBLAS's cublasOperation_t for the two values used (CUBLAS_OP_N = 0, CUBLAS_OP_T = 1).
enum class blas_op : int { n = 0, t = 1 };

//! C_i = op(A_i) op(B_i) (+ C_i with accumulate: beta = 1, else beta = 0 and C_i is not read),
//! for i < batch, X_i = X + i stride_x; column-major, alpha = 1. cuBLAS's argument list.
//! Sizes [m, k] for op(A), [k, n] for op(B), [m, n] for C.
template <class TA, class TB, class TC>
struct blas_gemm_call {
  blas_op transa = blas_op::n, transb = blas_op::n;
  int m = 0, n = 0, k = 0;
  const TA* a = nullptr;
  int lda = 1;
  long long stride_a = 0;
  const TB* b = nullptr;
  int ldb = 1;
  long long stride_b = 0;
  TC* c = nullptr;
  int ldc = 1;
  long long stride_c = 0;
  int batch = 1;
  bool accumulate = false;
};

//! The cuBLAS call of the seam's grouped GEMM with operand types TA, TB, TC: cuBLAS's A is the
//! seam's B.
template <class TA, class TB, class TC>
using blas_call_of_t = blas_gemm_call<TB, TA, TC>;

namespace detail {

//! How a matrix X [r, c] whose element (i, j) is at p + i si + j sj is given to cuBLAS as op(Y)
//! of a column-major Y: Y = X (op N, ld = sj, needs si = 1) or Y = X^T (op T, ld = si, needs
//! sj = 1), op N first. A dimension of size <= 1 has no stride to honour. `ok` false: neither.
struct blas_operand_form {
  blas_op op = blas_op::n;
  long long ld = 1;
  bool ok = false;
};
[[nodiscard]] inline blas_operand_form blas_form(long long r, long long c, long long si,
                                                 long long sj) {
  if ((si == 1 || r <= 1) && (c <= 1 || sj >= std::max(1LL, r)))
    return {blas_op::n, c <= 1 ? std::max(1LL, r) : sj, true};
  if ((sj == 1 || c <= 1) && (r <= 1 || si >= std::max(1LL, c)))
    return {blas_op::t, r <= 1 ? std::max(1LL, c) : si, true};
  return {};
}

//! The cuBLAS call of group g of `a` with the group's first row `first` and `rows` rows (the
//! grouped dimension: M of rows_are_m, K of rows_are_k), or the rule it breaks (prefixed `who`).
//! Batch 1; the strided batch sets batch and the strides.
template <class TA, class TB, class TC>
[[nodiscard]] expected<blas_call_of_t<TA, TB, TC>> blas_call_for(
    const grouped_gemm_args<TA, TB, TC>& a, int g, long long first, long long rows,
    const char* who) {
  const auto fail = [&](const std::string& what) {
    return unexpected<error>(make_error(errc::not_supported, std::string(who) + ": " + what));
  };
  const bool by_m = a.grouping == kernels::gemm_grouping::rows_are_m;
  const long long M = by_m ? rows : a.m, N = a.n, K = by_m ? a.k : rows;
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
    return fail("every size must fit cuBLAS's int (M = " + to_decimal(M) +
                ", N = " + to_decimal(N) + ", K = " + to_decimal(K) + ")");
  if (a.c.s1 != 1 && N > 1)
    return fail("C must be row-major (c.s1 = 1; got " + to_decimal(a.c.s1) + ")");
  const long long ldc = M <= 1 ? std::max(1LL, N) : a.c.s0;
  if (ldc < std::max(1LL, N))
    return fail("C's row stride (c.s0 = " + to_decimal(a.c.s0) +
                ") must be >= n = " + to_decimal(N));
  // cuBLAS's A = op(B^T), B^T [N, K] at (j, q) = b(q, j); its B = A^T [K, M] at (q, i) = a(i, q).
  const blas_operand_form fa = blas_form(N, K, a.b.s1, a.b.s0);
  const blas_operand_form fb = blas_form(K, M, a.a.s1, a.a.s0);
  if (!fa.ok)
    return fail("B (k, n) needs a unit stride and the other >= its extent (got s0 = " +
                to_decimal(a.b.s0) + ", s1 = " + to_decimal(a.b.s1) + ")");
  if (!fb.ok)
    return fail("A (m, k) needs a unit stride and the other >= its extent (got s0 = " +
                to_decimal(a.a.s0) + ", s1 = " + to_decimal(a.a.s1) + ")");
  if (fa.ld > INT_MAX || fb.ld > INT_MAX || ldc > INT_MAX)
    return fail("leading dimensions must fit cuBLAS's int");
  blas_call_of_t<TA, TB, TC> c{};
  c.transa = fa.op;
  c.transb = fb.op;
  c.m = static_cast<int>(N);
  c.n = static_cast<int>(M);
  c.k = static_cast<int>(K);
  c.lda = static_cast<int>(fa.ld);
  c.ldb = static_cast<int>(fb.ld);
  c.ldc = static_cast<int>(ldc);
  c.accumulate = a.accumulate;
  // The group's operands: the row-indexed ones moved to its first row (an empty group's, and
  // absent operands, stay at their bases: nothing reads them).
  const auto at = [rows](auto* p, long long n) { return p != nullptr && rows > 0 ? p + n : p; };
  c.a = at(a.b.data, by_m ? g * a.b.group_stride : first * a.b.s0);
  c.b = at(a.a.data, by_m ? first * a.a.s0 : first * a.a.s1);
  c.c = by_m ? at(a.c.data, first * a.c.s0)
             : (a.c.data != nullptr ? a.c.data + g * a.c.group_stride : a.c.data);
  return c;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
