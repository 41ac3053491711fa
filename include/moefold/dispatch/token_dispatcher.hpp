//! @file token_dispatcher.hpp
//! @brief The token dispatcher concept: what the MoE layer needs from a dispatcher, so that a user
//! can bring their own (a DeepEP-class kernel, a hierarchical All-to-All) and keep the rest of the
//! layer. all_to_all_dispatcher and all_gather_dispatcher model it on host contexts.
#pragma once

#include <concepts>
#include <optional>
#include <span>

#include "../core/expected.hpp"
#include "dispatch_args.hpp"
#include "expert_batch.hpp"

namespace moefold {
inline namespace v0_1 {

//! A dispatcher D of token type `D::value_type` (T) and probability type `D::prob_type` (P) over
//! communicator `Comm`, in the host span form the layer calls (one dispatch per forward, its
//! handle kept until the backward):
//!   D::make(dispatch_shape) -> expected<D>; shape() -> the shape it was made for
//!   workspace_sizes(capacity) -> dispatch_workspace_bytes (saved, scratch, host parts)
//!   dispatch(host_dispatch_input<T, P>, dispatch_groups, dispatch_workspace) -> expected<handle>:
//!     the kept pairs (expert -1: dropped) to the rows this rank's experts compute
//!   handle.batch() -> expert_batch<T, P, S> (rows grouped by local expert, in the memory space
//!     S of D::exec_type), handle.num_rows() -> M
//!   combine(handle&, y [M, H], groups, out [N, H]): each token's rows summed back
//!   combine_backward(handle, dout [N, H], groups, dy [M, H])
//!   dispatch_backward(handle, dx_rows [M, H], dprob_rows [M] (P), groups, dx [N, H],
//!                     dprobs [N, k] (P))
//! Handles of a dispatch in flight stay valid while its saved and host parts are untouched
//! (several may be in flight); every call returns an error, never a crash, on bad input.
template <class D, class Comm>
concept token_dispatcher = requires(
    D& d, const D& cd, const dispatch_shape& shape,
    const host_dispatch_input<typename D::value_type, typename D::prob_type>& in,
    const dispatch_groups<Comm>& g, const dispatch_workspace& ws, typename D::handle_type& h,
    const typename D::handle_type& ch, std::span<const typename D::value_type> rows,
    std::span<typename D::value_type> out, std::span<const typename D::prob_type> prob_rows,
    std::span<typename D::prob_type> prob_out, std::optional<int> capacity) {
  typename D::exec_type;
  { D::make(shape) } -> std::same_as<expected<D>>;
  { cd.shape() } -> std::convertible_to<dispatch_shape>;
  { cd.workspace_sizes(capacity) } -> std::same_as<dispatch_workspace_bytes>;
  { d.dispatch(in, g, ws) } -> std::same_as<expected<typename D::handle_type>>;
  {
    ch.batch()
    } -> std::same_as<expert_batch<typename D::value_type, typename D::prob_type,
                                   typename D::exec_type::memory_space>>;
  { ch.num_rows() } -> std::convertible_to<int>;
  { d.combine(h, rows, g, out) } -> std::same_as<status>;
  { d.combine_backward(ch, rows, g, out) } -> std::same_as<status>;
  { d.dispatch_backward(ch, rows, prob_rows, g, out, prob_out) } -> std::same_as<status>;
};

}  // namespace v0_1
}  // namespace moefold
