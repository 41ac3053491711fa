//! @file grouped_gemm_arrays.hpp
//! @brief The argument arrays of a pointer-array grouped GEMM (CUTLASS's Hopper grouped kernel
//! takes them from device memory), written on the context from the experts' row ranges, so that
//! nothing is read back: per group its problem shape (M, N, K), the first element of A, B and C,
//! and the one dynamic stride of each operand. The same arrays are executed by host_blas on the
//! CPU (exec/host_blas.hpp) and by the CUTLASS backend on the GPU, whose `.cuh` checks these
//! layouts against CuTe's types (`static_assert`), so CUTLASS stays out of this folder.
//!
//! CUTLASS's convention: D (M, N) = A (M, K) B' (N, K)^T, our B (k, n) being its B' transposed.
//! An operand is K-major when its K index is contiguous (CUTLASS's RowMajor A, ColumnMajor B) and
//! MN-major otherwise; C and D are row-major (N contiguous). Its stride array holds the other
//! index's stride, the leading dimension (CuTe's `Stride<int64_t, Int<1>, Int<0>>` for K-major A,
//! `Stride<Int<1>, int64_t, Int<0>>` for MN-major A: one int64 per group either way).
//!
//! An empty group (no row) is written as the shape (0, 0, 0): no tile, nothing read or written.
//! CUTLASS 4.2's sm90 grouped kernel does not initialize its accumulators for a K = 0 group, so a
//! K = 0 group must never reach it as (M, N, 0): with accumulate (beta = 1) C then stays as it is,
//! which (0, 0, 0) gives; without accumulate the backend refuses (exec/cutlass_sm90.hpp).
#pragma once

#include <moefold/core/config.hpp>

#include "grouped_gemm.hpp"

namespace moefold::kernels {

//! Which index of an operand is contiguous.
enum class gemm_major : int {
  k = 0,   //!< K contiguous (A (M, K) row-major; B (k, n) with s0 = 1)
  mn = 1,  //!< M (A) or N (B) contiguous
};

//! The arrays of one grouped GEMM, [groups] entries each, in the context's memory.
template <class TA, class TB, class TC>
struct grouped_gemm_arrays {
  int groups = 0;
  gemm_major a_major = gemm_major::k;
  gemm_major b_major = gemm_major::k;
  bool accumulate = false;   //!< beta = 1 (C = D, read and written), else beta = 0
  int* shapes = nullptr;     //!< [groups, 3]: M, N, K (CuTe's Shape<int, int, int>)
  const TA** a = nullptr;    //!< [groups] first element of A_g
  const TB** b = nullptr;    //!< [groups] first element of B_g
  TC** c = nullptr;          //!< [groups] first element of C_g (also D_g)
  long long* lda = nullptr;  //!< [groups] A's dynamic stride (see the file comment)
  long long* ldb = nullptr;  //!< [groups] B's
  long long* ldc = nullptr;  //!< [groups] C's row stride
};

//! Writes the arrays of a grouped GEMM (kernels/grouped_gemm.hpp's shapes and addressing) from
//! the row ranges on the context, a thread per group (grid-strided). The leading dimensions come
//! from the host (the backend has checked that each operand has one unit stride).
template <class TA, class TB, class TC>
struct grouped_gemm_arrays_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "grouped_gemm_arrays";

  gemm_grouping grouping;
  const long long* offsets;  //!< [groups + 1], non-decreasing from 0
  int m, n, k;               //!< the fixed sizes (the grouped one comes from offsets)
  gemm_operand<const TA> a;
  gemm_operand<const TB> b;
  gemm_operand<TC> c;
  long long lda, ldb, ldc;  //!< each operand's non-unit stride
  grouped_gemm_arrays<TA, TB, TC> out;

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& ctx) const {
    const bool by_m = grouping == gemm_grouping::rows_are_m;
    for (int g = ctx.block() * block_threads + ctx.thread(); g < out.groups;
         g += ctx.grid_blocks() * block_threads) {
      const long long first = offsets[g], rows = offsets[g + 1] - offsets[g];
      const int mg = by_m ? static_cast<int>(rows) : m;
      const int kg = by_m ? k : static_cast<int>(rows);
      const bool empty = rows == 0 || mg == 0 || n == 0 || kg == 0;
      out.shapes[3 * g + 0] = empty ? 0 : mg;
      out.shapes[3 * g + 1] = empty ? 0 : n;
      out.shapes[3 * g + 2] = empty ? 0 : kg;
      // The group's operands: the row-indexed ones moved to its first row (an empty group's are
      // never read: the bases, which may be null when nothing is read at all).
      out.a[g] = empty ? a.data : by_m ? a.data + first * a.s0 : a.data + first * a.s1;
      out.b[g] = empty ? b.data : by_m ? b.data + g * b.group_stride : b.data + first * b.s0;
      out.c[g] = empty ? c.data : by_m ? c.data + first * c.s0 : c.data + g * c.group_stride;
      out.lda[g] = lda;
      out.ldb[g] = ldb;
      out.ldc[g] = ldc;
    }
  }
};

}  // namespace moefold::kernels
