//! @file token_dispatcher.hpp
//! @brief The token dispatcher concept: what the MoE layer needs from a dispatcher, so that a user
//! can bring their own (a DeepEP-class kernel, a hierarchical All-to-All) and keep the rest of the
//! layer. all_to_all_dispatcher and all_gather_dispatcher model it on every context.
#pragma once

#include <concepts>
#include <optional>
#include <span>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "dispatch_args.hpp"
#include "expert_batch.hpp"

namespace moefold {
inline namespace v0_1 {

//! A dispatcher D of token type `D::value_type` (T) and probability type `D::prob_type` (P) over
//! communicator `Comm`, on its execution context `D::exec_type` (every view in that context's
//! memory space S), in the form the layer calls (one dispatch per forward, its handle kept until
//! the backward):
//!   D::make(dispatch_shape) -> expected<D>; shape() -> the shape it was made for
//!   workspace_sizes(capacity) -> dispatch_workspace_bytes (saved, scratch, host parts)
//!   dispatch(x, dispatch_input<T, S, P>, dispatch_groups, dispatch_workspace) -> expected<handle>:
//!     the kept pairs (expert -1: dropped) to the rows this rank's experts compute
//!   handle.batch() -> expert_batch<T, P, S> (rows grouped by local expert), handle.num_rows() -> M
//!   combine(x, handle&, y [M, H], groups, out [N, H]): each token's rows summed back
//!   combine_backward(x, handle, dout [N, H], groups, dy [M, H])
//!   dispatch_backward(x, handle, dx_rows [M, H], dprob_rows [M, 1] (P), groups, dx [N, H],
//!                     dprobs [N, k] (P))
//! The experts' rows (y, dy, dx_rows [M, H]) the layer passes have rows 16 bytes apart: their
//! stride may exceed H (read them through row_data/stride, not flat()); dx and dprobs are
//! contiguous.
//! Handles of a dispatch in flight stay valid while its saved and host parts are untouched
//! (several may be in flight); every call returns an error, never a crash, on bad input.
template <class D, class Comm>
concept token_dispatcher =
    requires(D& d, const D& cd, typename D::exec_type& x, const dispatch_shape& shape,
             const dispatch_input<typename D::value_type, typename D::exec_type::memory_space,
                                  typename D::prob_type>& in,
             const dispatch_groups<Comm>& g, const dispatch_workspace& ws,
             typename D::handle_type& h, const typename D::handle_type& ch,
             row_view<const typename D::value_type, typename D::exec_type::memory_space> rows,
             row_view<typename D::value_type, typename D::exec_type::memory_space> out,
             row_view<const typename D::prob_type, typename D::exec_type::memory_space> prob_rows,
             row_view<typename D::prob_type, typename D::exec_type::memory_space> prob_out,
             std::optional<int> capacity) {
  { D::make(shape) } -> std::same_as<expected<D>>;
  { cd.shape() } -> std::convertible_to<dispatch_shape>;
  { cd.workspace_sizes(capacity) } -> std::same_as<dispatch_workspace_bytes>;
  { d.dispatch(x, in, g, ws) } -> std::same_as<expected<typename D::handle_type>>;
  {
    ch.batch()
    } -> std::same_as<expert_batch<typename D::value_type, typename D::prob_type,
                                   typename D::exec_type::memory_space>>;
  { ch.num_rows() } -> std::convertible_to<int>;
  { d.combine(x, h, rows, g, out) } -> std::same_as<status>;
  { d.combine_backward(x, ch, rows, g, out) } -> std::same_as<status>;
  { d.dispatch_backward(x, ch, rows, prob_rows, g, out, prob_out) } -> std::same_as<status>;
};

}  // namespace v0_1
}  // namespace moefold
