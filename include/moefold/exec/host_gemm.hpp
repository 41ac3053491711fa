//! @file host_gemm.hpp
//! @brief host_gemm<TA, TB, TC>: the grouped-GEMM backend (exec/grouped_gemm.hpp) of host_exec, a
//! cache-blocked loop on host memory for the fast CPU path. The SIMT kernel on host_exec runs
//! each 32 x 32 tile as one thread's scalar loops over strided operands; this one packs blocks
//! of A and B (widened to the accumulator) into the workspace so that its inner loops stream
//! contiguous memory of fixed length whatever the operands' strides, which the compiler turns
//! into vector code. No threads: host_exec is one core.
//!
//! Arithmetic: sums in the accumulator of the kernel (fp32, fp64 when an operand is fp64), each
//! output one chain over k in ascending order, s += a b (the bits of that plain loop where the
//! compiler does not contract it into an fma), so results differ from simt_gemm's fma chains in
//! the last bits: compare them to an fp64 reference at a tolerance. With accumulate, C + sum is
//! rounded once to TC. An output whose sum has no term (an empty group of rows_are_k, or k = 0) is
//! 0, or left untouched with accumulate.
//!
//! Blocking: C in blocks of [mc, nc] = [64, 64] accumulators (workspace), the k range in steps of
//! kc = 128; per step A [mc, kc] and B [kc, nc] packed once, then micro tiles of [4, 16]
//! accumulators in registers over the step's k. Workspace: (mc nc + kc nc + mc kc) accumulators,
//! whatever the arguments.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <moefold/kernels/grouped_gemm.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/workspace.hpp"
#include "grouped_gemm.hpp"
#include "host_exec.hpp"

namespace moefold {
inline namespace v0_1 {

template <class TA, class TB, class TC>
class host_gemm {
 public:
  using args_type = grouped_gemm_args<TA, TB, TC>;
  //! The accumulator: the kernel's (fp32; fp64 when an operand is fp64).
  using acc_t = typename kernels::grouped_gemm_kernel<TA, TB, TC>::acc_t;
  static constexpr const char* name = "host_gemm";
  //! Host memory only: it reads and writes the operands (and device offsets) as host memory.
  template <class Exec>
  static constexpr bool runs_on = std::is_same_v<Exec, host_exec>;

  static constexpr int mc = 64, nc = 64, kc = 128;  // cache blocks: C [mc, nc], steps of kc
  static constexpr int mr = 4, nr = 16;             // register tile
  static_assert(mc % mr == 0 && nc % nr == 0);

  //! The rules of grouped_gemm_args.
  [[nodiscard]] static status can_implement(const args_type& a) {
    return detail::check_grouped_gemm_args(a, name);
  }

  //! The packed blocks and the C block's accumulators (host memory).
  [[nodiscard]] static std::size_t workspace_bytes(const args_type&) {
    workspace_carver c;
    (void)carve(c);
    return c.required();
  }

  //! Checks `a` and the workspace (host memory, at least workspace_bytes(a)) and keeps them.
  template <class Exec>
  [[nodiscard]] status initialize(Exec&, const args_type& a, std::span<std::byte> workspace) {
    static_assert(runs_on<Exec>,
                  "host_gemm runs on host_exec only: it reads and writes the operands as host "
                  "memory; use simt_gemm on cpu_exec and cuda_exec");
    ready_ = false;
    if (auto st = can_implement(a); !st) return st;
    workspace_carver c(workspace);
    const blocks b = carve(c);
    if (workspace.size() < workspace_bytes(a) || !c.fits())
      return detail::workspace_too_small(name, workspace.size(), workspace_bytes(a));
    a_ = a;
    blocks_ = b;
    ready_ = true;
    return {};
  }

  //! C (=|+=) A B over every group; complete when it returns. Device offsets (host memory on
  //! host_exec) are checked here, where they are read: 0 first, non-decreasing, within row_bound.
  template <class Exec>
  [[nodiscard]] status run(Exec&) const {
    static_assert(runs_on<Exec>,
                  "host_gemm runs on host_exec only: it reads and writes the operands as host "
                  "memory; use simt_gemm on cpu_exec and cuda_exec");
    if (!ready_) return detail::not_initialized(name);
    const bool by_m = a_.grouping == kernels::gemm_grouping::rows_are_m;
    const long long* off = a_.host_offsets.empty() ? a_.offsets : a_.host_offsets.data();
    if (a_.host_offsets.empty())
      if (auto st = check_device_offsets(off); !st) return st;
    for (int g = 0; g < a_.groups; ++g) {
      const long long first = off[g], rows = off[g + 1] - off[g];
      const long long mg = by_m ? rows : a_.m, kg = by_m ? a_.k : rows;
      // The group's operands: the row-indexed ones moved to its first row.
      const TA* pa = by_m ? a_.a.data + first * a_.a.s0 : a_.a.data + first * a_.a.s1;
      const TB* pb = by_m ? a_.b.data + g * a_.b.group_stride : a_.b.data + first * a_.b.s0;
      TC* pc = by_m ? a_.c.data + first * a_.c.s0 : a_.c.data + g * a_.c.group_stride;
      if (mg == 0 || a_.n == 0 || (kg == 0 && a_.accumulate)) continue;  // nothing changes
      gemm(mg, kg, {pa, a_.a.s0, a_.a.s1, 0}, {pb, a_.b.s0, a_.b.s1, 0}, {pc, a_.c.s0, a_.c.s1, 0});
    }
    scrub();
    return {};
  }

 private:
  struct blocks {
    acc_t* c = nullptr;  // [mc, nc] the C block's accumulators
    acc_t* a = nullptr;  // [mc, kc] A packed, row-major, rows past the block 0
    acc_t* b = nullptr;  // [kc, nc] B packed, row-major, columns past the block 0
  };
  // The one layout of the workspace, measured (empty carver) and carved alike.
  static blocks carve(workspace_carver& c) {
    blocks b;
    b.c = c.take<acc_t>(static_cast<std::size_t>(mc) * nc).data();
    b.a = c.take<acc_t>(static_cast<std::size_t>(mc) * kc).data();
    b.b = c.take<acc_t>(static_cast<std::size_t>(kc) * nc).data();
    return b;
  }

  [[nodiscard]] status check_device_offsets(const long long* off) const {
    const auto fail = [](const std::string& what) {
      return status(make_error(errc::invalid_argument, std::string(name) + ": offsets " + what));
    };
    if (off[0] != 0) return fail("must start at 0 (got " + detail::to_decimal(off[0]) + ")");
    for (int g = 0; g < a_.groups; ++g)
      if (off[g + 1] < off[g])
        return fail("must be non-decreasing (offsets[" + detail::to_decimal(g + 1) +
                    "] = " + detail::to_decimal(off[g + 1]) + " < offsets[" +
                    detail::to_decimal(g) + "] = " + detail::to_decimal(off[g]) + ")");
    if (off[a_.groups] > a_.row_bound)
      return fail("end past row_bound (offsets[groups] = " + detail::to_decimal(off[a_.groups]) +
                  " > " + detail::to_decimal(a_.row_bound) + ")");
    return {};
  }

  // One group: C [M, N] (=|+=) A [M, K] B [K, N], operands at their first element (group
  // strides unused). K = 0 without accumulate writes zeros.
  void gemm(long long M, long long K, kernels::gemm_operand<const TA> A,
            kernels::gemm_operand<const TB> B, kernels::gemm_operand<TC> C) const {
    const long long N = a_.n;
    for (long long n0 = 0; n0 < N; n0 += nc) {
      const int nb = static_cast<int>(std::min<long long>(nc, N - n0));
      for (long long m0 = 0; m0 < M; m0 += mc) {
        const int mb = static_cast<int>(std::min<long long>(mc, M - m0));
        const int mp = (mb + mr - 1) / mr * mr;  // rows of micro tiles
        used_.mp = std::max(used_.mp, mp);
        std::fill(blocks_.c, blocks_.c + static_cast<std::size_t>(mp) * nc, acc_t(0));
        for (long long k0 = 0; k0 < K; k0 += kc) {
          const int kb = static_cast<int>(std::min<long long>(kc, K - k0));
          used_.kb = std::max(used_.kb, kb);
          pack_a(A, m0, k0, mb, mp, kb);
          pack_b(B, k0, n0, kb, nb);
          for (int i0 = 0; i0 < mp; i0 += mr)
            for (int j0 = 0; j0 < nb; j0 += nr) micro_tile(i0, j0, kb);
        }
        store(C, m0, n0, mb, nb);
      }
    }
  }

  // a [i, q] = A (m0 + i, k0 + q), rows [mb, mp) 0; along A's contiguous dimension.
  void pack_a(kernels::gemm_operand<const TA> A, long long m0, long long k0, int mb, int mp,
              int kb) const {
    using moefold::detail::widen;
    acc_t* p = blocks_.a;
    const TA* src = A.data + m0 * A.s0 + k0 * A.s1;
    if (A.s1 == 1 || A.s0 != 1) {
      for (int i = 0; i < mb; ++i)
        for (int q = 0; q < kb; ++q) p[i * kc + q] = acc_t(widen(src[i * A.s0 + q * A.s1]));
    } else {  // transposed: columns of the block are contiguous
      for (int q = 0; q < kb; ++q)
        for (int i = 0; i < mb; ++i) p[i * kc + q] = acc_t(widen(src[i + q * A.s1]));
    }
    for (int i = mb; i < mp; ++i) std::fill(p + i * kc, p + i * kc + kb, acc_t(0));
  }

  // b [q, j] = B (k0 + q, n0 + j), columns [nb, nc) 0; along B's contiguous dimension.
  void pack_b(kernels::gemm_operand<const TB> B, long long k0, long long n0, int kb, int nb) const {
    using moefold::detail::widen;
    acc_t* p = blocks_.b;
    const TB* src = B.data + k0 * B.s0 + n0 * B.s1;
    if (B.s1 == 1 || B.s0 != 1) {
      for (int q = 0; q < kb; ++q) {
        for (int j = 0; j < nb; ++j) p[q * nc + j] = acc_t(widen(src[q * B.s0 + j * B.s1]));
        std::fill(p + q * nc + nb, p + (q + 1) * nc, acc_t(0));
      }
    } else {  // transposed (fc1's weights as B): rows of the block are strided, columns not
      for (int j = 0; j < nb; ++j)
        for (int q = 0; q < kb; ++q) p[q * nc + j] = acc_t(widen(src[j * B.s1 + q]));
      for (int q = 0; q < kb; ++q) std::fill(p + q * nc + nb, p + (q + 1) * nc, acc_t(0));
    }
  }

  // c [i0 + r, j0 + j] += sum_q a [i0 + r, q] b [q, j0 + j]: [mr, nr] accumulators held across
  // the step's k (fixed trip counts: vector code).
  void micro_tile(int i0, int j0, int kb) const {
    acc_t r[mr][nr];
    acc_t* c = blocks_.c + i0 * nc + j0;
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) r[i][j] = c[i * nc + j];
    const acc_t* pa = blocks_.a + i0 * kc;
    const acc_t* pb = blocks_.b + j0;
    for (int q = 0; q < kb; ++q) {
      const acc_t* bq = pb + q * nc;
      for (int i = 0; i < mr; ++i) {
        const acc_t x = pa[i * kc + q];
        for (int j = 0; j < nr; ++j) r[i][j] += x * bq[j];
      }
    }
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) c[i * nc + j] = r[i][j];
  }

  // C (m0 + i, n0 + j) = c [i, j] (+ C with accumulate), rounded once to TC.
  void store(kernels::gemm_operand<TC> C, long long m0, long long n0, int mb, int nb) const {
    using moefold::detail::narrow;
    using moefold::detail::widen;
    using out_t = accumulator_t<TC>;
    TC* dst = C.data + m0 * C.s0 + n0 * C.s1;
    for (int i = 0; i < mb; ++i)
      for (int j = 0; j < nb; ++j) {
        TC& out = dst[i * C.s0 + j * C.s1];
        const acc_t v = blocks_.c[i * nc + j];
        out = narrow<TC>(static_cast<out_t>(a_.accumulate ? acc_t(widen(out)) + v : v));
      }
  }

  // Zeroes what this run left in the workspace (the packed operands, the accumulators), so that
  // no scratch outlives the call holding a copy of a weight or a gradient: caller-owned
  // parameters stay the only copies (a layer's memory audit finds none; tests/layer). Only the
  // rows and columns used are touched: the cost is a fraction of the packing's.
  void scrub() const {
    for (int i = 0; i < used_.mp; ++i) {
      std::fill(blocks_.a + i * kc, blocks_.a + i * kc + used_.kb, acc_t(0));
      std::fill(blocks_.c + i * nc, blocks_.c + i * nc + nc, acc_t(0));
    }
    for (int q = 0; q < used_.kb; ++q)
      std::fill(blocks_.b + q * nc, blocks_.b + q * nc + nc, acc_t(0));
    used_ = {};
  }

  args_type a_{};
  blocks blocks_{};
  struct extents {
    int mp = 0, kb = 0;  // the most rows of A and C, and columns of A / rows of B, packed
  };
  mutable extents used_{};
  bool ready_ = false;
};

}  // namespace v0_1
}  // namespace moefold
