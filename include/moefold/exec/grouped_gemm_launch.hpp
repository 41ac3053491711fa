//! @file grouped_gemm_launch.hpp
//! @brief The host side of the SIMT grouped GEMM (kernels/grouped_gemm.hpp) for simt_gemm, the
//! seam's backend that runs it on an execution context (exec/simt_gemm.hpp; the experts and the
//! router reach it through the seam only): the grid from the groups' row ranges as the host knows
//! them, or from a bound, capped at the context's grid limit (capped_blocks, simt_launch.hpp; the
//! kernel's tiles stride over the grid), and the launch. One place, so that the tile arithmetic
//! cannot drift.
#pragma once

#include <span>

#include <moefold/kernels/grouped_gemm.hpp>

#include "../core/expected.hpp"
#include "../core/simt_launch.hpp"
#include "exec.hpp"

namespace moefold {
inline namespace v0_1 {

//! Launches `k` with one block per 32 x 32 output tile (capped): per group, its rows (rows_are_m)
//! or its [m, n] weight gradient (rows_are_k) over n. `host_offsets` [groups + 1] are the row
//! ranges `k.offsets` holds on the context. No tile (every group empty): nothing is launched.
template <execution_context Exec, class TA, class TB, class TC>
[[nodiscard]] status launch_grouped_gemm(Exec& x, const kernels::grouped_gemm_kernel<TA, TB, TC>& k,
                                         std::span<const long long> host_offsets) {
  using K = kernels::grouped_gemm_kernel<TA, TB, TC>;
  const long long tn = (static_cast<long long>(k.n) + K::tile_n - 1) / K::tile_n;
  long long tiles = 0;
  for (std::size_t g = 0; g + 1 < host_offsets.size(); ++g) {
    const long long rows = k.grouping == kernels::gemm_grouping::rows_are_m
                               ? host_offsets[g + 1] - host_offsets[g]
                               : static_cast<long long>(k.m);
    tiles += (rows + K::tile_m - 1) / K::tile_m * tn;
  }
  if (tiles == 0) return {};
  return launch(
      x, launch_grid{.blocks = capped_blocks<Exec>(tiles, 1), .smem_bytes = K::smem_bytes}, k);
}

//! The same when the row ranges are on the context only (nothing read back): the grid from a
//! bound, `total_rows` rows over the groups (the kernel walks the tiles the offsets give and the
//! blocks beyond them find none). rows_are_m: sum over g of ceil(rows_g / 32) <= (M + 31 L) / 32
//! tile rows; rows_are_k: L [m, n] gradients, whatever the rows.
template <execution_context Exec, class TA, class TB, class TC>
[[nodiscard]] status launch_grouped_gemm(Exec& x, const kernels::grouped_gemm_kernel<TA, TB, TC>& k,
                                         long long total_rows) {
  using K = kernels::grouped_gemm_kernel<TA, TB, TC>;
  const long long tn = (static_cast<long long>(k.n) + K::tile_n - 1) / K::tile_n;
  const long long L = k.groups;
  const long long tile_rows = k.grouping == kernels::gemm_grouping::rows_are_m
                                  ? (total_rows + (K::tile_m - 1) * L) / K::tile_m
                                  : L * ((static_cast<long long>(k.m) + K::tile_m - 1) / K::tile_m);
  const long long tiles = tile_rows * tn;
  if (tiles == 0) return {};
  return launch(
      x, launch_grid{.blocks = capped_blocks<Exec>(tiles, 1), .smem_bytes = K::smem_bytes}, k);
}

}  // namespace v0_1
}  // namespace moefold
