//! @file moe_layer_communicators.hpp
//! @brief The communicators of one MoE layer on this rank, by name: built once from a world
//! communicator and the fold's Megatron-Core groups (or filled by a trainer with its own, e.g.
//! NCCL communicators it created), then handed once to the layer's make, which holds it by
//! reference (it must outlive the layer, neither moved nor freed) and runs every collective of
//! every call on its groups. The layer takes EP, ETP, TP and this rank's TP position from it, so
//! they are not repeated in its options.
#pragma once

#include <utility>

#include "../comm/communicator.hpp"
#include "../comm/group_communicator.hpp"
#include "../core/expected.hpp"
#include "../dispatch/dispatch_args.hpp"
#include "../mesh/groups.hpp"

namespace moefold {
inline namespace v0_1 {

//! Every group a layer uses, owned, by name (what each is for: docs/layer.md). Rank order inside
//! each is the group's position order of megatron_groups.
template <communicator Comm>
struct moe_layer_communicators {
  Comm tp;        //!< attention TP: the shared expert's sequence-parallel MLP
  Comm tp_cp;     //!< router statistics, full-sequence dropping
  Comm tp_dp_cp;  //!< the stage's data ranks: router and gate gradients, global aux, expert bias
  Comm dp_cp;     //!< the shared expert's MLP gradients
  Comm ep;        //!< expert parallel: the dispatch All-to-All
  Comm etp;       //!< expert tensor parallel: the expert shards' partial sums
  Comm tp_ep;     //!< the AllGather dispatcher's group, the count exchange
  Comm edp;       //!< expert data parallel: the expert gradients
};

//! Splits `world` into a layer's eight groups (megatron_groups of the fold; every rank calls it
//! together). An error names the first group that could not be made.
template <splittable_communicator C>
[[nodiscard]] expected<moe_layer_communicators<C>> make_layer_communicators(
    C& world, const megatron_groups& groups) {
  auto tp = group_communicator(world, groups, {group_kind::tp});
  if (!tp) return unexpected<error>(tp.error());
  auto tp_cp = group_communicator(world, groups, {group_kind::tp_cp});
  if (!tp_cp) return unexpected<error>(tp_cp.error());
  auto tp_dp_cp = group_communicator(world, groups, {group_kind::tp_dp_cp});
  if (!tp_dp_cp) return unexpected<error>(tp_dp_cp.error());
  auto dp_cp = group_communicator(world, groups, {group_kind::dp_cp});
  if (!dp_cp) return unexpected<error>(dp_cp.error());
  auto ep = group_communicator(world, groups, {group_kind::ep});
  if (!ep) return unexpected<error>(ep.error());
  auto etp = group_communicator(world, groups, {group_kind::etp});
  if (!etp) return unexpected<error>(etp.error());
  auto tp_ep = group_communicator(world, groups, {group_kind::tp_ep});
  if (!tp_ep) return unexpected<error>(tp_ep.error());
  auto edp = group_communicator(world, groups, {group_kind::edp});
  if (!edp) return unexpected<error>(edp.error());
  return moe_layer_communicators<C>{.tp = std::move(*tp),
                                    .tp_cp = std::move(*tp_cp),
                                    .tp_dp_cp = std::move(*tp_dp_cp),
                                    .dp_cp = std::move(*dp_cp),
                                    .ep = std::move(*ep),
                                    .etp = std::move(*etp),
                                    .tp_ep = std::move(*tp_ep),
                                    .edp = std::move(*edp)};
}

}  // namespace v0_1
}  // namespace moefold
