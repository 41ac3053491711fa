//! @file all_to_all_dispatcher.hpp
//! @brief The All-to-All token dispatcher: tokens laid out by the attention mesh go to their
//! experts under the MoE mesh and come back, forward and backward, for any fold, on any execution
//! context (host_exec; cpu_exec and cuda_exec with device memory: one file for host and GPU).
//!
//! Forward (docs/dispatch-semantics.md 5.2.2), per rank:
//!   permute -> All-to-All-V over EP -> AllGather-V over ETP -> chunk sort (t, j, l) -> (l, t, j)
//!   -> [experts] -> chunk unsort -> ReduceScatter-V over ETP -> All-to-All-V back -> un-permute.
//! The backward runs the mirror image and reuses the forward's plan, splits and chunk order, which
//! the typed handle carries. Everything a step needs lives in the caller's workspace: rows and the
//! plan in the context's memory, the bookkeeping the host reads (splits, gathered counts, chunk
//! order) in its host part. A step moves two small arrays between them: the gathered per-expert
//! counts to the host (skipped in pad mode) and the chunk offsets to the context.
//!
//! Probabilities travel with their rows: the permute writes packed rows of W elements (the token
//! row in columns [0, H), its probability of type Prob in the columns from Hp = probs_first(H)
//! (sizeof(Prob) / sizeof(T) of them: one for Prob = T, two for fp32 with bf16 tokens), zeros in
//! between and up to W, a multiple of 16 bytes: detail::packed_layout), so the dispatch's
//! All-to-All-V and AllGather-V, and the backward's ReduceScatter-V and All-to-All-V, are one
//! collective each instead of two. The backward's ReduceScatter-V packs only when Prob is T and at
//! least 32 bits (pack_reductions); otherwise the probability gradients keep their own reduction,
//! in Prob.
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/host_exec.hpp"
#include "chunk_sort.hpp"
#include "dispatch_args.hpp"
#include "dispatch_handle.hpp"
#include "dispatcher_common.hpp"
#include "expert_batch.hpp"
#include "permute.hpp"
#include "plan_builders.hpp"
#include "splits.hpp"
#include "status_rows.hpp"

namespace moefold {
inline namespace v0_1 {

//! The All-to-All dispatcher for tokens of element type T and probabilities of type Prob (T, or
//! wider by a whole number of T's: fp32 with bf16) over communicators of type Comm, run on
//! execution context Exec: Comm's memory space must be Exec's (communicator_for).
template <class T, class Comm, class Exec = host_exec, class Prob = T>
requires dispatch_context<Exec> && communicator_for<Comm, Exec, T> &&
    communicator_for<Comm, Exec, Prob> && communicator_for<Comm, Exec, int>
class all_to_all_dispatcher
    : public dispatcher_common<all_to_all_dispatcher<T, Comm, Exec, Prob>, T, Comm, Exec, Prob> {
  using common = dispatcher_common<all_to_all_dispatcher<T, Comm, Exec, Prob>, T, Comm, Exec, Prob>;
  using layout = detail::packed_layout<T, Prob>;
  using common::check_rows;
  using common::columns_of;
  using common::probs_of;
  using common::rows_of;
  using common::rows_then_probs;
  using common::zero_columns;

 public:
  using value_type = T;
  using prob_type = Prob;
  using exec_type = Exec;
  using space = typename Exec::memory_space;
  using view = row_view<T, space>;
  using const_view = row_view<const T, space>;
  using prob_view = row_view<Prob, space>;
  using const_prob_view = row_view<const Prob, space>;
  using handle_type = typename common::handle_type;
  using common::pack_reductions;
  //! What the handle keeps for combine and the backward: splits and the chunk order (host
  //! memory), and the chunk sizes and offsets the chunk copies read (the context's memory).
  struct state {
    std::span<int> input_splits, output_splits, output_splits_tp, per_expert, chunk_counts, order;
    std::span<int> chunk_src, chunk_dst;  //!< [ETP*EP*L] chunk offsets (rows) before/after the sort
    //! chunk_counts, chunk_src, chunk_dst as the rows of [3, ETP*EP*L] in the context's memory
    row_view<const int, space> chunk_sizes{}, chunk_from{}, chunk_to{};
    //! The scratch rows of its dispatch (the context's memory; any later call may reuse them)
    std::span<T> rows_a, rows_b, rows_c;
  };

  //! Which of moefold's dispatchers it is (dispatch_shape::kind).
  static constexpr dispatcher_kind kind = dispatcher_kind::all_to_all;

  //! Checks the shape (detail::check_dispatch_shape; a shape asking for the other kind is
  //! refused).
  [[nodiscard]] static expected<all_to_all_dispatcher> make(const dispatch_shape& s) {
    if (auto st = detail::check_dispatch_shape(s, kind, "all_to_all_dispatcher"); !st)
      return unexpected<error>(st.error());
    if (auto st = detail::check_packed_width(layout::width(s.hidden, 1), "H + its probability");
        !st)
      return unexpected<error>(st.error());
    all_to_all_dispatcher d;
    d.s_ = s;
    return d;
  }

  [[nodiscard]] const dispatch_shape& shape() const noexcept { return s_; }
  //! Elements of a packed row (token row, probability, zeros): a multiple of 16 bytes.
  [[nodiscard]] int packed_width() const noexcept {
    return static_cast<int>(layout::width(s_.hidden, 1));
  }

  //! Bytes of workspace one dispatch/combine round trip (and its backward) needs, per part
  //! (dispatch_workspace): rows grow with the receive bound (dispatch_shape::max_recv_rows), not
  //! with EP. In pad mode (dispatch_input::capacity set) pass the capacity: the rows then follow
  //! from it. A query: nothing is allocated.
  [[nodiscard]] dispatch_workspace_bytes workspace_sizes(std::optional<int> capacity = {}) const {
    const int cap = detail::pad_or_off(capacity);
    workspace_carver saved, scratch, host;
    buffers b;
    carve_saved(saved, cap, b);
    carve_scratch(scratch, cap, b);
    carve_host(host, b);
    return {saved.required(), scratch.required(), host.required()};
  }

  //! Forward dispatch: after it, handle.batch_rows() is what the local experts compute.
  //! `ws.saved` and `ws.host` stay with the handle until the backward; `ws.scratch` may be
  //! shared with other layers.
  [[nodiscard]] expected<handle_type> dispatch(Exec& x, const dispatch_input<T, space, Prob>& in,
                                               const dispatch_groups<Comm>& g,
                                               const dispatch_workspace& ws) {
    using detail::to_decimal;
    if (auto st = detail::check_dispatch_groups(s_, g); !st) return unexpected<error>(st.error());
    if (auto st = detail::check_dispatch_input(s_, in); !st) return unexpected<error>(st.error());
    const int cap = detail::pad_or_off(in.capacity);  // -1: no pad mode
    workspace_carver cs(ws.saved), cx(ws.scratch), ch(ws.host);
    buffers b;
    carve_saved(cs, cap, b);
    carve_scratch(cx, cap, b);
    carve_host(ch, b);
    if (!cs.fits() || !cx.fits() || !ch.fits())
      return make_error(errc::workspace_too_small,
                        "dispatch: the workspace has " + to_decimal(ws.saved.size()) + " saved, " +
                            to_decimal(ws.scratch.size()) + " scratch and " +
                            to_decimal(ws.host.size()) + " host bytes, workspace_sizes(" +
                            (in.capacity ? to_decimal(cap) : std::string()) + ") = {" +
                            to_decimal(cs.required()) + ", " + to_decimal(cx.required()) + ", " +
                            to_decimal(ch.required()) + "}");
    handle_type h;
    h.issue(this, ++serial_, b.stamp.data(), s_.hidden, in.num_tokens);
    h.st_.rows_a = b.rows_a;
    h.st_.rows_b = b.rows_b;
    h.st_.rows_c = b.rows_c;
    // 1. Plan the permutation and exchange each rank's status row (its counts and the faults
    //    the plan kernels found in its record), then bring them to the host: the one wait of the
    //    forward, where every rank checks every rank's record alike before any row moves. A
    //    context whose builder is host code has checked its record already. In pad mode every
    //    count is the capacity, so nothing is exchanged (static shapes) and nothing waits: a
    //    context that runs kernels leaves the record's check to device_status().
    // NOTE: aggregates are built as named variables, not braced arguments: nvcc 13 miscompiles a
    // braced designated initializer with dependent members passed as an argument in a template.
    const bool pad = cap >= 0;
    const plan_input<space> pa{.num_tokens = in.num_tokens,
                               .topk = s_.topk,
                               .num_experts = s_.num_experts,
                               .expert = in.expert,
                               .capacity = in.capacity};
    auto plan = enqueue_permute_plan(x, pa, b.plan);
    if (!plan) return unexpected<error>(plan.error());
    h.plan_ = *plan;
    h.plan_unchecked_ = pad && runs_kernels_v<Exec>;
    const int P = s_.ep * s_.etp;
    // With EP = ETP = 1 the rows stay on this rank (direct): no exchange and no chunk sort, the
    // plan's rows are the experts' batch. If the caller vouches that every pair is routed, a
    // context that runs kernels takes the batch as the N k rows (the plan's bound) and reads no
    // count back: the one wait of the forward goes, the experts find their rows per expert on the
    // context (batch_offsets()), and device_status() checks the record when asked.
    const bool direct = P == 1;
    const bool trusted = direct && !pad && in.every_pair_routed && runs_kernels_v<Exec> &&
                         static_cast<long long>(in.num_tokens) * s_.topk <= recv_rows(cap);
    h.routed_unchecked_ = trusted;
    if (!pad && !trusted) {
      const int E = s_.num_experts, SW = E + 2;
      const auto gathered = rows_of(b.gathered, SW);  // [EP*ETP, E + 2]
      if (auto st = g.tp_ep.all_gather(x, h.plan_.status_row(), gathered); !st)
        return unexpected<error>(st.error());
      if (auto st = x.copy(row_view<const int, space>(gathered),
                           row_view<int>(b.gathered_host.data(), P, SW));
          !st)
        return unexpected<error>(st.error());
      // This rank's faults first (the host builder's words), then any rank's, alike everywhere.
      if (auto st = resolve_permute_plan(x, pa, h.plan_,
                                         detail::status_row_of(b.gathered_host, E, g.tp_ep.rank()));
          !st)
        return unexpected<error>(st.error());
      if (auto st = detail::check_status_rows(b.gathered_host, P, E); !st)
        return unexpected<error>(st.error());
      detail::pack_status_counts(b.gathered_host, P, E);
      h.volume_.count_gather = volume(SW * (P - 1), sizeof(int), 1);
    }
    // 2. Splits, chunk order.
    h.st_.input_splits = b.input_splits;
    h.st_.output_splits = b.output_splits;
    h.st_.output_splits_tp = b.output_splits_tp;
    h.st_.per_expert = b.per_expert;
    const auto C = detail::uz(s_.ep) * detail::uz(s_.etp) * detail::uz(local_experts());
    h.st_.chunk_counts = b.chunk_meta_host.first(C);
    h.st_.order = b.order;
    h.st_.chunk_src = b.chunk_meta_host.subspan(C, C);
    h.st_.chunk_dst = b.chunk_meta_host.subspan(2 * C, C);
    if (trusted) return dispatch_direct(x, in, b.batch_x, b.batch_probs, h);
    const dispatch::split_args sa{
        .ep = s_.ep,
        .etp = s_.etp,
        .num_experts = s_.num_experts,
        .my_ep = g.ep.rank(),
        .my_etp = g.etp.rank(),
        .gathered_counts = b.gathered_host.first(detail::uz(P) * detail::uz(s_.num_experts))};
    const dispatch::split_view sv{.input_splits = h.st_.input_splits,
                                  .output_splits = h.st_.output_splits,
                                  .output_splits_tp = h.st_.output_splits_tp,
                                  .tokens_per_local_expert = h.st_.per_expert,
                                  // Pad mode leaves the host chunk table alone: a dropless
                                  // dispatch's copy from it may still be pending.
                                  .chunk_counts = pad ? std::span<int>{} : h.st_.chunk_counts};
    if (pad)
      dispatch::uniform_splits(cap, s_.ep, s_.etp, local_experts(), sv);
    else if (auto st = dispatch::compute_splits(sa, sv); !st)
      return unexpected<error>(st.error());
    // Every rank knows every rank's counts: all check the bound on the most loaded EP rank and
    // fail alike, before any row moves (pad mode was checked against it up front; without a
    // bound the worst case holds by construction: no rank routes more than max_tokens * k).
    if (!pad && s_.max_recv_rows)
      if (const dispatch::receive_peak peak = dispatch::peak_receive(sa);
          peak.rows > recv_rows(cap))
        return dispatch::receive_bound_error(peak, recv_rows(cap));
    if (direct) return dispatch_direct(x, in, b.batch_x, b.batch_probs, h);
    if (!pad) {  // the host chunk table (pad mode writes its own on the context, below)
      dispatch::expert_major_chunk_order(s_.etp, s_.ep, local_experts(), h.st_.order);
      dispatch::chunk_offsets(h.st_.chunk_counts, h.st_.order, h.st_.chunk_src, h.st_.chunk_dst);
    }
    // The chunk sizes and offsets in the context's memory, where the chunk copies read them:
    // the host table's values stored there by kernels carrying them (store_host_values: nothing
    // copied from the host, so the host table may be rewritten by the next dispatch at once), or
    // in pad mode written there from the fold alone.
    const row_view<int, space> meta(b.chunk_meta.data(), 3, static_cast<int>(C));
    const kernels::uniform_chunks uniform{
        .etp = s_.etp, .ep = s_.ep, .local_experts = local_experts(), .rows = pad ? cap : 0};
    if (auto st =
            pad ? x.uniform_chunk_table(meta, uniform)
                : x.template store_host_values<int>(
                      row_view<const int>(b.chunk_meta_host.data(), 3, static_cast<int>(C)), meta);
        !st)
      return unexpected<error>(st.error());
    h.st_.chunk_sizes = meta.subrows(0, 1);
    h.st_.chunk_from = meta.subrows(1, 1);
    h.st_.chunk_to = meta.subrows(2, 1);
    h.per_expert_ = h.st_.per_expert;
    const int m_send = h.plan_.num_rows();
    const int m_a2a = dispatch::split_total(h.st_.output_splits);
    const int m_all = dispatch::split_total(h.st_.output_splits_tp);
    // 3. Permute into packed rows: the token row in columns [0, H), its probability from column
    //    Hp, zeros in between and after.            x [N,H], probs [N,k] -> xp [m_send, W]
    const int W = packed_width(), Hp = probs_first();
    auto xp = b.rows_c.first(detail::uz(m_send) * detail::uz(W));
    if (auto st = common::permute_by_slot(x, in, h.plan_.row_slots(), s_.topk,
                                          columns_of(xp, W, 0, s_.hidden), probs_of(xp, W, Hp, 1));
        !st)
      return unexpected<error>(st.error());
    if (auto st = zero_gaps(x, xp); !st) return unexpected<error>(st.error());
    // 4. All-to-All-V over EP, rows and probabilities in one.   -> [m_a2a, W] ordered (j, l, token)
    auto xr = b.rows_b.first(detail::uz(m_a2a) * detail::uz(W));
    if (auto st = a2a(x, g.ep, xp, h.st_.input_splits, xr, h.st_.output_splits, W); !st)
      return unexpected<error>(st.error());
    h.volume_.dispatch_a2a =
        volume(m_send - h.st_.input_splits[detail::uz(g.ep.rank())], sizeof(T), W);
    // 5. AllGather-V over ETP.                        -> [m_all, W] ordered (t, j, l, token)
    std::span<T> xg = xr;
    if (s_.etp > 1) {
      xg = b.rows_a.first(detail::uz(m_all) * detail::uz(W));
      if (auto st = agv(x, g.etp, xr, xg, h.st_.output_splits_tp, W); !st)
        return unexpected<error>(st.error());
      h.volume_.dispatch_agv = volume(static_cast<long long>(m_a2a) * (s_.etp - 1), sizeof(T), W);
    }
    // 6. Chunk sort (t, j, l) -> (l, t, j): rows grouped by local expert, out of the packed rows
    //    into the experts' batch.                    -> x [m_all, H], probs [m_all]
    h.x_ = common::batch_rows_of(b.batch_x, m_all, s_.hidden);
    h.p_ = rows_of(b.batch_probs.first(detail::uz(m_all)), 1);
    const std::span<const T> xgc = xg;
    if (auto st = sort_chunks<T>(x, h, columns_of(xgc, W, 0, s_.hidden), h.x_); !st)
      return unexpected<error>(st.error());
    if (auto st = sort_chunks<Prob>(x, h, probs_of(xgc, W, Hp, 1), h.p_); !st)
      return unexpected<error>(st.error());
    return h;
  }

  //! The check of a dispatch's routing record that its forward left to the device. In pad mode
  //! on a context that runs kernels, dispatch() waits for nothing: a record naming an expert
  //! outside [-1, E), one expert twice for a token, or more pairs for an expert than the
  //! capacity gets no rows (its tokens' outputs and gradients are zero) and is reported here,
  //! at the cost of one device-to-host copy (a wait). Otherwise the forward checked the record
  //! (every rank every rank's) and this returns at once. On a context with a device error word
  //! (cuda_exec: bad indices its row kernels met) that word is read too (one more copy).
  [[nodiscard]] status device_status(Exec& x, const handle_type& h) const {
    if (auto st = h.check_issued_by(this); !st) return st;
    if (auto st = device_status_of(x); !st) return st;  // the context's error word, if any
    if (h.routed_unchecked_)
      return common::routed_record_status(x, h.plan_.status_row(), s_.num_experts, s_.topk,
                                          h.num_tokens());
    if (!h.plan_unchecked_) return {};
    int fault[2] = {0, 0};
    const row_view<const int, space> words(h.plan_.status_row().data() + s_.num_experts, 1, 2);
    if (auto st = x.copy(words, row_view<int>(fault, 1, 2)); !st) return st;
    return detail::pad_record_fault(fault[0], fault[1], s_.topk, s_.num_experts,
                                    h.plan_.num_rows() / s_.num_experts);
  }

  //! Forward combine: y [M, H] (the experts' outputs for handle.batch(), ETP partials) ->
  //! out [N, H]. Probabilities were applied inside the experts.
  [[nodiscard]] status combine(Exec& x, handle_type& h, const_view y,
                               const dispatch_groups<Comm>& g, view out) {
    if (auto st = check_handle(h, g); !st) return st;
    const auto H = detail::uz(s_.hidden);
    if (auto st = check_rows("combine: y", y, h.num_rows(), s_.hidden); !st) return st;
    if (auto st = check_rows("combine: out", out, h.num_tokens(), s_.hidden); !st) return st;
    if (direct())  // the batch is the plan's rows: un-permute them
      return x.template gather_sum_rows<T, T, accumulator_t<T>>(y, h.plan_.token_rows(), {}, out);
    const int m_a2a = dispatch::split_total(h.st_.output_splits), m_send = h.plan_.num_rows(),
              m_all = h.num_rows();
    // Unsort (l, t, j) -> (t, j, l).
    auto yu = h.st_.rows_a.first(detail::uz(m_all) * H);
    if (auto st = unsort_chunks<T>(x, h, y, rows_of(yu, s_.hidden)); !st) return st;
    // ReduceScatter-V over ETP: sums the row-parallel partials, returns each peer its rows.
    std::span<T> yr = yu;
    if (s_.etp > 1) {
      yr = h.st_.rows_b.first(detail::uz(m_a2a) * H);
      if (auto st = rsv(x, g.etp, yu, yr, h.st_.output_splits_tp, s_.hidden); !st) return st;
      h.volume_.combine_rsv = volume(m_all - m_a2a, sizeof(T), s_.hidden);
    }
    // All-to-All-V back over EP.
    auto yc = h.st_.rows_c.first(detail::uz(m_send) * H);
    if (auto st = a2a(x, g.ep, yr, h.st_.output_splits, yc, h.st_.input_splits, s_.hidden); !st)
      return st;
    h.volume_.combine_a2a =
        volume(m_a2a - h.st_.output_splits[detail::uz(g.ep.rank())], sizeof(T), s_.hidden);
    // Un-permute: out[t] = sum over its pairs, in slot order.
    return x.template gather_sum_rows<T, T, accumulator_t<T>>(
        rows_of(std::span<const T>(yc), s_.hidden), h.plan_.token_rows(), {}, out);
  }

  //! Backward of combine: dout [N, H] -> dy [M, H] (the experts' output gradient, batch order).
  [[nodiscard]] status combine_backward(Exec& x, const handle_type& h, const_view dout,
                                        const dispatch_groups<Comm>& g, view dy) {
    if (auto st = check_handle(h, g); !st) return st;
    const auto H = detail::uz(s_.hidden);
    if (auto st = check_rows("combine_backward: dout", dout, h.num_tokens(), s_.hidden); !st)
      return st;
    if (auto st = check_rows("combine_backward: dy", dy, h.num_rows(), s_.hidden); !st) return st;
    if (direct())  // un-permute backward = permute
      return x.template gather_rows<T>(dout, h.plan_.row_slots(), s_.topk, dy);
    const int m_a2a = dispatch::split_total(h.st_.output_splits), m_send = h.plan_.num_rows(),
              m_all = h.num_rows();
    auto gc = h.st_.rows_c.first(detail::uz(m_send) * H);  // un-permute backward = permute
    if (auto st =
            x.template gather_rows<T>(dout, h.plan_.row_slots(), s_.topk, rows_of(gc, s_.hidden));
        !st)
      return st;
    auto gr = h.st_.rows_b.first(detail::uz(m_a2a) * H);  // All-to-All backward: swap the splits
    if (auto st = a2a(x, g.ep, gc, h.st_.input_splits, gr, h.st_.output_splits, s_.hidden); !st)
      return st;
    std::span<T> gu = gr;  // ReduceScatter backward = AllGather
    if (s_.etp > 1) {
      gu = h.st_.rows_a.first(detail::uz(m_all) * H);
      if (auto st = agv(x, g.etp, gr, gu, h.st_.output_splits_tp, s_.hidden); !st) return st;
    }
    return sort_chunks<T>(x, h, rows_of(std::span<const T>(gu), s_.hidden), dy);
  }

  //! Backward of dispatch: the experts' input and probability gradients (batch order, ETP
  //! partials) dx_rows [M, H], dprob_rows [M, 1] -> dx [N, H] and dprobs [N, k] (0 for dropped
  //! pairs; contiguous).
  [[nodiscard]] status dispatch_backward(Exec& x, const handle_type& h, const_view dx_rows,
                                         const_prob_view dprob_rows, const dispatch_groups<Comm>& g,
                                         view dx, prob_view dprobs) {
    if (auto st = check_handle(h, g); !st) return st;
    if (auto st = this->check_backward_shapes(h, dx_rows, dprob_rows, dx, dprobs); !st) return st;
    if (direct()) {  // permute backward = un-permute without probs; the probs' a gather
      if (auto st = x.template gather_sum_rows<T, T, accumulator_t<T>>(
              dx_rows, h.plan_.token_rows(), {}, dx);
          !st)
        return st;
      return x.template gather_rows<Prob>(dprob_rows, h.plan_.slot_rows(), 1, by_slot(dprobs));
    }
    // Packed unless the ReduceScatter-V over ETP would sum the probabilities as T when they are
    // not T, or in 16 bits.
    if (pack_reductions || s_.etp == 1)
      return dispatch_backward_packed(x, h, dx_rows, dprob_rows, g, dx, dprobs);
    return dispatch_backward_separate(x, h, dx_rows, dprob_rows, g, dx, dprobs);
  }

 private:
  // EP = ETP = 1: the rows never leave this rank.
  [[nodiscard]] bool direct() const noexcept { return s_.ep * s_.etp == 1; }

  // The direct dispatch, after the plan (and, unless every pair is vouched for, its counts):
  // the batch is the plan's rows, permuted straight into it.    x [N, H], probs [N, k] -> [M, .]
  // (The batch's buffers come as spans: `buffers` is declared below.)
  expected<handle_type> dispatch_direct(Exec& x, const dispatch_input<T, space, Prob>& in,
                                        std::span<T> batch_x, std::span<Prob> batch_probs,
                                        handle_type& h) {
    const int M = h.plan_.num_rows();
    h.x_ = common::batch_rows_of(batch_x, M, s_.hidden);
    h.p_ = rows_of(batch_probs.first(detail::uz(M)), 1);
    if (h.routed_unchecked_)
      h.offsets_ = h.plan_.offset_row();
    else
      h.per_expert_ = h.st_.per_expert;
    if (auto st = common::permute_by_slot(x, in, h.plan_.row_slots(), s_.topk, h.x_, h.p_); !st)
      return unexpected<error>(st.error());
    return std::move(h);
  }

  // The carved workspace. The spans of the saved and scratch parts are addresses in the
  // context's memory: the dispatcher reaches them only as views (rows_of, columns_of) handed to
  // the context's operations and the collectives. The host part holds what the host reads.
  struct buffers {
    // saved, the context's memory: the plan, the chunk table [3, C] (sizes, offsets before and
    // after the sort), the expert batch (the experts read it again in the backward)
    std::span<std::byte> plan;
    std::span<int> chunk_meta;
    std::span<T> batch_x;
    std::span<Prob> batch_probs;
    // scratch, the context's memory: the gathered status rows [EP*ETP, E + 2] and rows reused by
    // every step (packed rows [., W] in dispatch and its backward, plain rows [., H] in combine and
    // its backward)
    std::span<int> gathered;
    std::span<T> rows_a, rows_b, rows_c;
    // host: the stamp, the gathered counts, splits, chunk order and the host copy of the chunk
    // table
    std::span<detail::dispatch_stamp> stamp;
    std::span<int> gathered_host, input_splits, output_splits, output_splits_tp, per_expert,
        chunk_meta_host, order;
  };

  // The backward with packed rows: the row gradients in columns [0, H), the probability
  // gradients in their column Hp; one ReduceScatter-V over ETP (sums both in T) and one
  // All-to-All-V. The ReduceScatter-V only runs when ETP > 1, so ETP 1 packs for every Prob.
  status dispatch_backward_packed(Exec& x, const handle_type& h, const_view dx_rows,
                                  const_prob_view dprob_rows, const dispatch_groups<Comm>& g,
                                  view dx, prob_view dprobs) {
    const int m_a2a = dispatch::split_total(h.st_.output_splits), m_send = h.plan_.num_rows(),
              m_all = h.num_rows(), W = packed_width(), Hp = probs_first();
    const auto Wz = detail::uz(W);
    auto gx = h.st_.rows_a.first(detail::uz(m_all) * Wz);  // sort backward = unsort
    if (auto st = unsort_chunks<T>(x, h, dx_rows, columns_of(gx, W, 0, s_.hidden)); !st) return st;
    if (auto st = unsort_chunks<Prob>(x, h, dprob_rows, probs_of(gx, W, Hp, 1)); !st) return st;
    if (auto st = zero_gaps(x, gx); !st) return st;
    std::span<T> rx = gx;  // AllGather backward = ReduceScatter (a sum over ETP)
    if (s_.etp > 1) {
      rx = h.st_.rows_b.first(detail::uz(m_a2a) * Wz);
      if (auto st = rsv(x, g.etp, gx, rx, h.st_.output_splits_tp, W); !st) return st;
    }
    auto sx = h.st_.rows_c.first(detail::uz(m_send) * Wz);  // All-to-All backward: swap the splits
    if (auto st = a2a(x, g.ep, rx, h.st_.output_splits, sx, h.st_.input_splits, W); !st) return st;
    // Permute backward = un-permute without probs; the probs' permute backward is a gather.
    const std::span<const T> sxc = sx;
    if (auto st = x.template gather_sum_rows<T, T, accumulator_t<T>>(
            columns_of(sxc, W, 0, s_.hidden), h.plan_.token_rows(), {}, dx);
        !st)
      return st;
    return x.template gather_rows<Prob>(probs_of(sxc, W, Hp, 1), h.plan_.slot_rows(), 1,
                                        by_slot(dprobs));
  }

  // The backward with ETP > 1 when the probability gradients may not be summed in packed rows
  // (!pack_reductions: 16-bit T, or Prob other than T): they keep their own ReduceScatter-V and
  // All-to-All-V in Prob, in plain layouts inside the packed buffers (rows_then_probs: [rows, H]
  // followed by [rows] of Prob).
  status dispatch_backward_separate(Exec& x, const handle_type& h, const_view dx_rows,
                                    const_prob_view dprob_rows, const dispatch_groups<Comm>& g,
                                    view dx, prob_view dprobs) {
    const int m_a2a = dispatch::split_total(h.st_.output_splits), m_send = h.plan_.num_rows(),
              m_all = h.num_rows();
    auto [gx, gp] = rows_then_probs(h.st_.rows_a, m_all, s_.hidden);  // sort backward = unsort
    if (auto st = unsort_chunks<T>(x, h, dx_rows, rows_of(gx, s_.hidden)); !st) return st;
    if (auto st = unsort_chunks<Prob>(x, h, dprob_rows, rows_of(gp, 1)); !st) return st;
    // AllGather backward = ReduceScatter
    auto [rx, rp] = rows_then_probs(h.st_.rows_b, m_a2a, s_.hidden);
    if (auto st = rsv<T>(x, g.etp, gx, rx, h.st_.output_splits_tp, s_.hidden); !st) return st;
    if (auto st = rsv<Prob>(x, g.etp, gp, rp, h.st_.output_splits_tp, 1); !st) return st;
    // All-to-All backward: swap the splits
    auto [sx, sp] = rows_then_probs(h.st_.rows_c, m_send, s_.hidden);
    if (auto st = a2a<T>(x, g.ep, rx, h.st_.output_splits, sx, h.st_.input_splits, s_.hidden); !st)
      return st;
    if (auto st = a2a<Prob>(x, g.ep, rp, h.st_.output_splits, sp, h.st_.input_splits, 1); !st)
      return st;
    if (auto st = x.template gather_sum_rows<T, T, accumulator_t<T>>(
            rows_of(std::span<const T>(sx), s_.hidden), h.plan_.token_rows(), {}, dx);
        !st)
      return st;
    return x.template gather_rows<Prob>(rows_of(std::span<const Prob>(sp), 1), h.plan_.slot_rows(),
                                        1, by_slot(dprobs));
  }

  // dprobs [N, k] (contiguous) as [N*k, 1], indexed by slot.
  static prob_view by_slot(prob_view dprobs) noexcept {
    return prob_view(dprobs.data(), dprobs.rows() * dprobs.width(), 1);
  }
  // The first probability column of a packed row, and zeros in the columns that hold neither
  // the token row nor the probability: [H, Hp) and [Hp + prob_cols, W).
  int probs_first() const noexcept { return static_cast<int>(layout::probs_first(s_.hidden)); }
  status zero_gaps(Exec& x, std::span<T> packed) const {
    const int W = packed_width(), Hp = probs_first();
    if (auto st = zero_columns(x, packed, W, s_.hidden, Hp); !st) return st;
    return zero_columns(x, packed, W, Hp + common::prob_cols, W);
  }
  // Chunk sort (t, j, l) -> (l, t, j) and its inverse: one chunk copy with the offsets the
  // forward planned, swapped for the inverse.   src, dst [rows, width], either may be strided
  // (the columns of packed rows); U is T (rows) or Prob (probabilities)
  template <class U>
  static status sort_chunks(Exec& x, const handle_type& h, row_view<const U, space> src,
                            row_view<U, space> dst) {
    return x.template copy_chunks<U>(src, column(h.st_.chunk_sizes), column(h.st_.chunk_from),
                                     column(h.st_.chunk_to), dst);
  }
  template <class U>
  static status unsort_chunks(Exec& x, const handle_type& h, row_view<const U, space> src,
                              row_view<U, space> dst) {
    return x.template copy_chunks<U>(src, column(h.st_.chunk_sizes), column(h.st_.chunk_to),
                                     column(h.st_.chunk_from), dst);
  }
  // A row [1, C] of the chunk table as the column [C, 1] copy_chunks takes.
  static row_view<const int, space> column(row_view<const int, space> r) noexcept {
    return {r.data(), r.width(), 1};
  }
  int local_experts() const noexcept { return s_.num_experts / s_.ep; }
  // Rows this rank receives at most (after the AllGather-V): the receive bound, by default every
  // routed pair of the tp-ep group; in pad mode exactly C*L rows from each of the EP * ETP
  // sources, C*E*ETP.
  long long recv_rows(int capacity) const noexcept {
    if (capacity >= 0) return static_cast<long long>(capacity) * s_.num_experts * s_.etp;
    return s_.max_recv_rows ? *s_.max_recv_rows : detail::worst_recv_rows(s_);
  }
  // Rows this rank sends at most: its routed pairs, or C per expert in pad mode.
  long long send_rows(int capacity) const noexcept {
    if (capacity >= 0) return static_cast<long long>(capacity) * s_.num_experts;
    return static_cast<long long>(s_.max_tokens) * s_.topk;
  }
  static comm_volume volume(long long rows, std::size_t elem, int per_row) noexcept {
    return {rows, rows * static_cast<long long>(elem) * per_row};
  }

  // One layout per part, used both to size and to carve (never two functions that can drift).
  // Saved (kept by the handle until the backward): the plan, the splits, the experts' batch.
  void carve_saved(workspace_carver& c, int capacity, buffers& b) const {
    const auto EP = detail::uz(s_.ep), ETP = detail::uz(s_.etp), L = detail::uz(local_experts());
    const auto R = detail::uz(recv_rows(capacity));  // rows the experts receive at most
    const permute_args pa{.num_tokens = s_.max_tokens,
                          .topk = s_.topk,
                          .num_experts = s_.num_experts,
                          .capacity = capacity >= 0 ? std::optional<int>(capacity) : std::nullopt};
    b.plan = c.take<std::byte>(permute_plan::workspace_bytes(pa));
    b.chunk_meta = c.take<int>(3 * ETP * EP * L);
    b.batch_x = c.take<T>(R * detail::uz(common::batch_stride(s_.hidden)));
    b.batch_probs = c.take<Prob>(R);
  }
  // Host (kept with the handle): the gathered counts, splits, chunk order and chunk table.
  void carve_host(workspace_carver& c, buffers& b) const {
    const auto E = detail::uz(s_.num_experts), EP = detail::uz(s_.ep), ETP = detail::uz(s_.etp),
               L = detail::uz(local_experts());
    b.stamp = c.take<detail::dispatch_stamp>(1);
    b.gathered_host = c.take<int>(EP * ETP * (E + 2));  // status rows [P, E + 2], then counts
    b.input_splits = c.take<int>(EP);
    b.output_splits = c.take<int>(EP);
    b.output_splits_tp = c.take<int>(ETP);
    b.per_expert = c.take<int>(L);
    b.chunk_meta_host = c.take<int>(3 * ETP * EP * L);
    b.order = c.take<int>(ETP * EP * L);
  }
  // Scratch (dead after each call): the gathered counts and the rows in flight, packed rows of W
  // elements (the probabilities travel in them). Buffers a and b hold received rows (at most the
  // receive bound), c the rows this rank sends.
  void carve_scratch(workspace_carver& c, int capacity, buffers& b) const {
    const auto E = detail::uz(s_.num_experts), EP = detail::uz(s_.ep), ETP = detail::uz(s_.etp),
               W = detail::uz(packed_width());
    const auto R = detail::uz(recv_rows(capacity)), S = detail::uz(send_rows(capacity));
    b.gathered = c.take<int>(EP * ETP * (E + 2));  // status rows [P, E + 2]
    b.rows_a = c.take<T>(R * W);
    b.rows_b = c.take<T>(R * W);
    b.rows_c = c.take<T>(S * W);
  }

  status check_handle(const handle_type& h, const dispatch_groups<Comm>& g) const {
    if (auto st = h.check_issued_by(this); !st) return st;
    return detail::check_dispatch_groups(s_, g);
  }

  // The collectives on row views: counts in rows of `width` elements (the communicator does the
  // 64-bit element arithmetic).
  // U: T (rows) or Prob (the probabilities of the separate reductions), given, never deduced.
  template <class U = T>
  static status a2a(Exec& x, Comm& c, std::type_identity_t<std::span<const U>> send,
                    std::span<const int> send_rows, std::type_identity_t<std::span<U>> recv,
                    std::span<const int> recv_rows, int width) {
    return c.all_to_all_v(x, rows_of(send, width), send_rows, rows_of(recv, width), recv_rows);
  }
  static status agv(Exec& x, Comm& c, std::span<const T> send, std::span<T> recv,
                    std::span<const int> rows, int width) {
    return c.all_gather_v(x, rows_of(send, width), rows_of(recv, width), rows);
  }
  template <class U = T>
  static status rsv(Exec& x, Comm& c, std::type_identity_t<std::span<const U>> send,
                    std::type_identity_t<std::span<U>> recv, std::span<const int> rows, int width) {
    return c.reduce_scatter_v(x, rows_of(send, width), rows, rows_of(recv, width), reduce_op::sum);
  }

  dispatch_shape s_{};
  std::uint64_t serial_ = 0;  // dispatches made (the stamp of the latest)
};

}  // namespace v0_1
}  // namespace moefold
