//! @file group_communicator.hpp
//! @brief This rank's communicator for one group kind of a fold, for any backend that splits.
#pragma once

#include <string>

#include "../core/expected.hpp"
#include "../mesh/groups.hpp"
#include "communicator.hpp"

namespace moefold {
inline namespace v0_1 {

//! This rank's communicator for the group of kind `kind` that holds it: collective over `world`
//! (every rank of `world` must call it with the same groups and kind). The new communicator's
//! ranks are ordered as Megatron-Core orders the group (rank k of the group is rank k here).
//!
//! `world` is either exactly the fold's world (its rank r is mesh rank r + g.rank_offset()) or a
//! larger job whose ranks are the mesh ranks themselves (then g.rank_offset() + g.world_size() <=
//! world.size(), and ranks outside the mesh join no group). A rank that is in no group of the
//! kind (for example embd on a middle pipeline stage) takes part and gets an error value
//! (errc::rank_out_of_range) instead of a communicator.
template <splittable_communicator C>
[[nodiscard]] expected<C> group_communicator(C& world, const megatron_groups& g, named_kind kind) {
  if (!g.has(kind.kind, kind.level))
    return make_error(errc::not_supported,
                      "group kind " + to_string(kind) + " is not built under these group options");
  const int ws = g.world_size(), off = g.rank_offset();
  int mesh_rank = -1;
  if (world.size() == ws)
    mesh_rank = world.rank() + off;
  else if (static_cast<long long>(off) + ws <= world.size())
    mesh_rank = world.rank();
  else
    return make_error(errc::shape_mismatch,
                      "group_communicator: the communicator has " +
                          detail::to_decimal(world.size()) + " ranks, but the fold has " +
                          detail::to_decimal(ws) + " ranks at offset " + detail::to_decimal(off) +
                          " (the communicator must be the fold's world or a job that holds it)");
  const auto at = g(kind).find(mesh_rank);
  auto sub = world.split(at.group >= 0 ? at.group : split_no_color, at.position);
  if (!sub && at.group < 0)
    return make_error(errc::rank_out_of_range, "group_communicator: mesh rank " +
                                                   detail::to_decimal(mesh_rank) +
                                                   " is in no group of kind " + to_string(kind));
  return sub;
}

}  // namespace v0_1
}  // namespace moefold
