//! @file megatron_source.hpp
//! @brief Where a dense slice lies in a Megatron-Core checkpoint, whose MLP is sharded over the
//! attention TP: TP rank t holds linear_fc1.weight [(gated ? 2 : 1) F_d / TP, H], its gate rows
//! [t F_d / TP, (t + 1) F_d / TP) then the same up rows (gate and up fused, ColumnParallelLinear),
//! and linear_fc2.weight [H, F_d / TP], those columns of down_proj (RowParallelLinear). TP = 1 is
//! an unsharded Megatron-Core checkpoint.
//!
//! A slice that upcycle_slices() states (gate or up rows, or down columns, in the dense FFN's
//! Hugging Face coordinates) may straddle TP shards; megatron_pieces() splits it into rectangles of
//! single shards, each with its place in the slice, so that a trainer reads exactly those bytes of
//! exactly the shards it needs and hands the assembled slices to upcycle_experts() unchanged.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../core/expected.hpp"
#include "upcycle_experts.hpp"

namespace moefold {
inline namespace v0_1 {

//! The two weights of one Megatron-Core TP shard of a dense MLP.
enum class megatron_tensor : std::uint8_t { fc1, fc2 };

//! A rectangle of one TP shard's weight (rows [first_row, + rows), columns [first_col, + cols),
//! row-major in that shard's tensor) and where it goes in the slice it serves (rows from dst_row,
//! columns from dst_col of the slice's [rows, cols]).
struct megatron_piece {
  int tp_rank = 0;
  megatron_tensor tensor = megatron_tensor::fc1;
  int first_row = 0, rows = 0;
  int first_col = 0, cols = 0;
  int dst_row = 0, dst_col = 0;
  bool operator==(const megatron_piece&) const = default;
};

//! The pieces of TP shards that make up slice `s` of the dense FFN `d` (checked: TP >= 1 divides
//! F_d, the slice lies inside its tensor, a gate slice needs a gated FFN), in slice order.
[[nodiscard]] inline expected<std::vector<megatron_piece>> megatron_pieces(const dense_ffn_shape& d,
                                                                           int tp,
                                                                           const dense_slice& s) {
  using detail::to_decimal;
  if (tp < 1 || d.ffn < 1 || d.hidden < 1 || d.ffn % tp != 0)
    return make_error(errc::invalid_argument,
                      "megatron_pieces: the attention TP = " + to_decimal(tp) +
                          " must be >= 1 and divide the dense FFN width " + to_decimal(d.ffn) +
                          " (Megatron-Core shards fc1 rows and fc2 columns over TP)");
  if (s.tensor == dense_tensor::gate && !d.gated)
    return make_error(errc::invalid_argument,
                      "megatron_pieces: a gate slice of a dense FFN without a gate");
  const bool rows_of_fc1 = s.tensor != dense_tensor::down;
  // The slice's extent along the sharded axis (FFN neurons) and the full extent of the other.
  const int first = rows_of_fc1 ? s.first_row : s.first_col;
  const int count = rows_of_fc1 ? s.rows : s.cols;
  const int other_first = rows_of_fc1 ? s.first_col : s.first_row;
  const int other_count = rows_of_fc1 ? s.cols : s.rows;
  if (first < 0 || count < 0 || first > d.ffn - count || other_first < 0 || other_count < 0 ||
      other_first > d.hidden - other_count)
    return make_error(errc::shape_mismatch,
                      "megatron_pieces: the slice lies outside the dense FFN [" +
                          to_decimal(d.ffn) + ", " + to_decimal(d.hidden) + "]");
  const int per = d.ffn / tp;  // neurons per TP shard
  std::vector<megatron_piece> out;
  for (int n = first; n < first + count;) {
    const int t = n / per, local = n - t * per;
    const int take = std::min(first + count - n, per - local);
    megatron_piece p{.tp_rank = t,
                     .tensor = rows_of_fc1 ? megatron_tensor::fc1 : megatron_tensor::fc2};
    if (rows_of_fc1) {
      // fc1 of shard t: [gate rows; up rows] when gated, [up rows] otherwise.
      p.first_row = (s.tensor == dense_tensor::up && d.gated ? per : 0) + local;
      p.rows = take;
      p.first_col = other_first;
      p.cols = other_count;
      p.dst_row = n - first;
    } else {
      p.first_row = other_first;
      p.rows = other_count;
      p.first_col = local;
      p.cols = take;
      p.dst_col = n - first;
    }
    out.push_back(p);
    n += take;
  }
  return out;
}

}  // namespace v0_1
}  // namespace moefold
