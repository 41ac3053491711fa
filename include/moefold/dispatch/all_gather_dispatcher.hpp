//! @file all_gather_dispatcher.hpp
//! @brief The AllGather token dispatcher, on any execution context (one file for host and GPU):
//! every rank of the tp-ep group gathers all
//! tokens of the group, computes the rows of its own local experts, and a ReduceScatter sums the
//! experts' contributions (over EP) and the row-parallel partials (over ETP) back to each token's
//! rank (docs/dispatch-semantics.md 5.1). Simpler than the All-to-All path and a test oracle for
//! it: same results, more bytes (O(N * ETP * EP * H) per rank, independent of k).
//!
//! Probabilities travel with their tokens: packed rows of W elements (the token row in columns
//! [0, H), its k probabilities of type Prob from column Hp = probs_first(H), sizeof(Prob) /
//! sizeof(T) columns each, zeros in between and up to W, a multiple of 16 bytes:
//! detail::packed_layout), so the dispatch gathers tokens and probabilities in one AllGather-V (the
//! expert ids, int, in a second), and the backward's ReduceScatter-V returns the input and
//! probability gradients in one, when Prob is T and at least 32 bits (pack_reductions; otherwise
//! the probability gradients keep their own reduction, in Prob).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "../comm/communicator.hpp"
#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/host_exec.hpp"
#include "dispatch_args.hpp"
#include "dispatch_handle.hpp"
#include "dispatcher_common.hpp"
#include "gathered_record.hpp"
#include "permute.hpp"
#include "plan_builders.hpp"

namespace moefold {
inline namespace v0_1 {

//! The AllGather dispatcher for tokens of element type T and probabilities of type Prob (T, or
//! wider by a whole number of T's: fp32 with bf16) over communicators of type Comm, run on
//! execution context Exec: Comm's memory space must be Exec's (communicator_for).
template <class T, class Comm, class Exec = host_exec, class Prob = T>
requires dispatch_context<Exec> && communicator_for<Comm, Exec, T> &&
    communicator_for<Comm, Exec, Prob> && communicator_for<Comm, Exec, int>
class all_gather_dispatcher
    : public dispatcher_common<all_gather_dispatcher<T, Comm, Exec, Prob>, T, Comm, Exec, Prob> {
  using common = dispatcher_common<all_gather_dispatcher<T, Comm, Exec, Prob>, T, Comm, Exec, Prob>;
  using layout = detail::packed_layout<T, Prob>;
  using common::check_rows;
  using common::columns_of;
  using common::probs_of;
  using common::rows_of;
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
  //! What the handle keeps: the token count of every tp-ep rank (in tp-ep rank order, host).
  struct state {
    std::span<int> tokens;  //!< [EP*ETP]
    int gathered = 0;       //!< sum of tokens
    //! The scratch rows of its dispatch (the context's memory; any later call may reuse them)
    std::span<T> rows_a, rows_b;
    std::span<Prob> probs_a;
  };
  //! In pad mode (dispatch_input::capacity set) every local expert gets `capacity` rows from
  //! each rank of the group: its rows are EP*ETP blocks in tp-ep rank order.

  //! Which of moefold's dispatchers it is (dispatch_shape::kind).
  static constexpr dispatcher_kind kind = dispatcher_kind::all_gather;

  //! Checks the shape (detail::check_dispatch_shape; a shape asking for the other kind is
  //! refused).
  [[nodiscard]] static expected<all_gather_dispatcher> make(const dispatch_shape& s) {
    if (auto st = detail::check_dispatch_shape(s, kind, "all_gather_dispatcher"); !st)
      return unexpected<error>(st.error());
    if (auto st =
            detail::check_packed_width(layout::width(s.hidden, s.topk), "H + k probabilities");
        !st)
      return unexpected<error>(st.error());
    all_gather_dispatcher d;
    d.s_ = s;
    return d;
  }

  [[nodiscard]] const dispatch_shape& shape() const noexcept { return s_; }
  //! Elements of a packed token row (token row, its k probabilities, zeros): a multiple of 16
  //! bytes.
  [[nodiscard]] int packed_width() const noexcept {
    return static_cast<int>(layout::width(s_.hidden, s_.topk));
  }

  //! Bytes of workspace one round trip (and its backward) needs, per part (dispatch_workspace);
  //! in pad mode pass the capacity. The gathered tokens (scratch) are O(max_tokens * EP * ETP *
  //! H), inherent to this path; the experts' batch (saved) follows the receive bound. A query:
  //! nothing is allocated.
  [[nodiscard]] dispatch_workspace_bytes workspace_sizes(std::optional<int> capacity = {}) const {
    const int cap = detail::pad_or_off(capacity);
    workspace_carver saved, scratch, host;
    buffers b;
    carve_saved(saved, cap, b);
    carve_scratch(scratch, b);
    carve_host(host, b);
    return {saved.required(), scratch.required(), host.required()};
  }

  //! Forward dispatch: gather the group's tokens, keep the rows of this rank's experts.
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
    carve_scratch(cx, b);
    carve_host(ch, b);
    if (!cs.fits() || !cx.fits() || !ch.fits())
      return make_error(errc::workspace_too_small,
                        "dispatch: the workspace has " + to_decimal(ws.saved.size()) + " saved, " +
                            to_decimal(ws.scratch.size()) + " scratch and " +
                            to_decimal(ws.host.size()) + " host bytes, workspace_sizes(" +
                            (in.capacity ? to_decimal(cap) : std::string()) + ") = {" +
                            to_decimal(cs.required()) + ", " + to_decimal(cx.required()) + ", " +
                            to_decimal(ch.required()) + "}");
    const auto K = detail::uz(s_.topk);
    handle_type h;
    h.issue(this, ++serial_, b.stamp.data(), s_.hidden, in.num_tokens);
    h.st_.rows_a = b.rows_a;
    h.st_.rows_b = b.rows_b;
    h.st_.probs_a = b.probs_a;
    h.st_.tokens = b.tokens;
    // With EP = ETP = 1 the group is this rank alone. If the caller vouches that every pair is
    // routed, a context that runs kernels plans the N k rows (the plan's bound) and reads nothing
    // back: the header and its one wait go, the experts find their rows per expert on the context
    // (batch_offsets()), and device_status() checks the record when asked (as the All-to-All
    // dispatcher's direct path).
    if (g.tp_ep.size() == 1 && cap < 0 && in.every_pair_routed && runs_kernels_v<Exec> &&
        static_cast<long long>(in.num_tokens) * s_.topk <= recv_rows(cap))
      return dispatch_routed(x, in, b, h);
    // 1. The group's header rows (token count, pad capacity, the first bad entry of the routing
    //    record, routed pairs per expert: gathered_header), so that every rank checks every
    //    rank's record alike, on the host, before any row moves. The counts are made in the
    //    context's memory, the rest on the host; the gathered table comes back to the host.
    using hdr = detail::gathered_header;
    const int n = in.num_tokens, P = g.tp_ep.size();
    const int HW = hdr::width(s_.num_experts);
    const row_view<int, space> mine(b.header_row.data(), 1, HW);  // [1, 4 + E]
    // The counts and the record's first fault {slot or -1, id} are written in the context's
    // memory (columns fault_slot, fault_expert, counts..), the token count and capacity from here.
    if (auto st = count_routed_pairs(
            x, in.expert,
            row_view<int, space>(b.header_row.data() + hdr::counts, 1, s_.num_experts),
            row_view<int, space>(b.header_row.data() + hdr::fault_slot, 1, 2));
        !st)
      return unexpected<error>(st.error());
    const int head[2] = {n, cap};
    static_assert(hdr::tokens == 0 && hdr::capacity == 1);
    if (auto st = x.template store_host_values<int>(
            row_view<const int>(head, 1, 2), row_view<int, space>(b.header_row.data(), 1, 2));
        !st)
      return unexpected<error>(st.error());
    const row_view<int, space> table(b.header.data(), P, HW);  // [P, 4 + E]
    if (auto st = g.tp_ep.all_gather(x, row_view<const int, space>(mine), table); !st)
      return unexpected<error>(st.error());
    const row_view<int> table_host(b.header_host.data(), P, HW);
    if (auto st = x.copy(row_view<const int, space>(table), table_host); !st)
      return unexpected<error>(st.error());
    const std::span<const int> header = b.header_host;
    auto gathered = detail::check_gathered_header(header, HW, s_.max_tokens, b.tokens);
    if (!gathered) return unexpected<error>(gathered.error());
    const long long total = *gathered;
    h.st_.gathered = static_cast<int>(total);
    const auto G = detail::uz(total);
    const int peers = P - 1;
    h.volume_.count_gather = {
        peers, static_cast<long long>(peers) * HW * static_cast<long long>(sizeof(int))};
    // 2. Every rank checks every rank's record (expert ids; in pad mode every (source, expert)
    //    against the capacity) and the receive bound on every EP rank's rows, on the same table,
    //    so a bad rank fails all of them alike, never alone (without a bound the worst case holds
    //    by construction).
    if (auto st = detail::check_gathered_routing(header, HW, P, s_.num_experts, s_.topk, cap); !st)
      return unexpected<error>(st.error());
    const int L = s_.num_experts / s_.ep, first = g.ep.rank() * L;
    if (cap < 0 && s_.max_recv_rows)
      if (const dispatch::receive_peak peak =
              detail::gathered_peak_receive(header, HW, P, s_.num_experts, s_.ep);
          peak.rows > recv_rows(cap))
        return dispatch::receive_bound_error(peak, recv_rows(cap));
    // 3. Tokens and probabilities in packed rows, gathered in one collective; the expert ids in
    //    a second.                   x [n, H], probs [n, k] -> xs [n, W] -> xg [G, W]
    const int W = packed_width(), Hp = probs_first();
    const auto Wz = detail::uz(W);
    auto xs = b.rows_b.first(detail::uz(n) * Wz);
    if (auto st = x.copy(in.x, columns_of(xs, W, 0, s_.hidden)); !st)
      return unexpected<error>(st.error());
    if (auto st = x.copy(in.probs, probs_of(xs, W, Hp, s_.topk)); !st)
      return unexpected<error>(st.error());
    if (auto st = zero_gaps(x, xs); !st) return unexpected<error>(st.error());
    auto xg = b.rows_a.first(G * Wz);
    auto eg = b.experts.first(G * K);
    const std::span<const int> tokens = b.tokens;  // rows per tp-ep rank
    if (auto st =
            g.tp_ep.all_gather_v(x, rows_of(std::span<const T>(xs), W), rows_of(xg, W), tokens);
        !st)
      return unexpected<error>(st.error());
    if (auto st = g.tp_ep.all_gather_v(x, in.expert, rows_of(eg, s_.topk), tokens); !st)
      return unexpected<error>(st.error());
    const long long sent = static_cast<long long>(n) * peers;
    h.volume_.dispatch_agv = {sent,
                              sent * static_cast<long long>(Wz * sizeof(T) + K * sizeof(int))};
    // 4. Keep this rank's experts: a local routing record over the gathered tokens.
    auto local = b.local_experts.first(G * K);
    if (auto st = x.relabel(rows_of(std::span<const int>(eg), s_.topk), first, L,
                            rows_of(local, s_.topk));
        !st)
      return unexpected<error>(st.error());
    const bool pad = cap >= 0;
    const plan_input<space> pa{.num_tokens = static_cast<int>(total),
                               .topk = s_.topk,
                               .num_experts = L,
                               .expert = rows_of(std::span<const int>(local), s_.topk),
                               .capacity = in.capacity,
                               .num_sources = pad ? P : 1,
                               .source_tokens = pad ? b.tokens : std::span<int>()};
    // The local plan's counts are the header's (checked above, every rank alike): nothing of it
    // is read back.
    auto plan = enqueue_permute_plan(x, pa, b.plan);
    if (!plan) return unexpected<error>(plan.error());
    h.plan_ = *plan;
    // Rows per local expert, padding included, from the header (host): C per source in pad mode.
    detail::gathered_rows_per_expert(header, HW, P, first, cap, b.per_expert);
    h.per_expert_ = b.per_expert;
    detail::gathered_local_status(header, HW, P, first, b.local_status);
    if (auto st = resolve_permute_plan(x, pa, h.plan_, b.local_status); !st)
      return unexpected<error>(st.error());
    const auto M = detail::uz(h.plan_.num_rows());
    h.x_ = common::batch_rows_of(b.batch_x, static_cast<int>(M), s_.hidden);
    h.p_ = rows_of(b.batch_probs.first(M), 1);
    // The experts' batch out of the packed rows: the token rows by slot, and the probabilities,
    // copied out of their columns to be indexed by slot.
    const std::span<const T> xgc = xg;
    if (auto st = x.template gather_rows<T>(columns_of(xgc, W, 0, s_.hidden), h.plan_.row_slots(),
                                            s_.topk, h.x_);
        !st)
      return unexpected<error>(st.error());
    auto pg = b.probs_a.first(G * K);
    if (auto st = x.copy(probs_of(xgc, W, Hp, s_.topk), rows_of(pg, s_.topk)); !st)
      return unexpected<error>(st.error());
    if (auto st = x.template gather_rows<Prob>(rows_of(std::span<const Prob>(pg), 1),
                                               h.plan_.row_slots(), 1, h.p_);
        !st)
      return unexpected<error>(st.error());
    return h;
  }

  //! The check of a record the forward left to the device: with EP = ETP = 1 and
  //! dispatch_input::every_pair_routed on a context that runs kernels, the record is read here
  //! (one copy, a wait: a bad id or a repeat gave it no rows, a -1 its own pair none). Otherwise
  //! the forward checked every rank's record on the gathered header (its one wait), so this
  //! returns at once, after reading the context's device error word where it has one
  //! (cuda_exec: bad indices its row kernels met).
  [[nodiscard]] status device_status(Exec& x, const handle_type& h) const {
    if (auto st = h.check_issued_by(this); !st) return st;
    if (auto st = device_status_of(x); !st) return st;  // the context's error word, if any
    if (!h.routed_unchecked_) return {};
    return common::routed_record_status(x, h.plan_.status_row(), s_.num_experts, s_.topk,
                                        h.num_tokens());
  }

  //! Forward combine: y [M, H] -> out [N, H].
  [[nodiscard]] status combine(Exec& x, handle_type& h, const_view y,
                               const dispatch_groups<Comm>& g, view out) {
    if (auto st = check_handle(h, g); !st) return st;
    const auto H = detail::uz(s_.hidden), G = detail::uz(h.st_.gathered);
    if (auto st = check_rows("combine: y", y, h.num_rows(), s_.hidden); !st) return st;
    if (auto st = check_rows("combine: out", out, h.num_tokens(), s_.hidden); !st) return st;
    auto u = h.st_.rows_b.first(G * H);  // zeros for tokens without a local expert
    if (auto st = x.template gather_sum_rows<T, T, accumulator_t<T>>(y, h.plan_.token_rows(), {},
                                                                     rows_of(u, s_.hidden));
        !st)
      return st;
    if (auto st = g.tp_ep.reduce_scatter_v(x, rows_of(std::span<const T>(u), s_.hidden),
                                           std::span<const int>(h.st_.tokens), out, reduce_op::sum);
        !st)
      return st;
    const long long rows = static_cast<long long>(G) - h.num_tokens();
    h.volume_.combine_rsv = {rows, rows * static_cast<long long>(H * sizeof(T))};
    return {};
  }

  //! Backward of combine: dout [N, H] -> dy [M, H].
  [[nodiscard]] status combine_backward(Exec& x, const handle_type& h, const_view dout,
                                        const dispatch_groups<Comm>& g, view dy) {
    if (auto st = check_handle(h, g); !st) return st;
    const auto H = detail::uz(s_.hidden), G = detail::uz(h.st_.gathered);
    if (auto st = check_rows("combine_backward: dout", dout, h.num_tokens(), s_.hidden); !st)
      return st;
    if (auto st = check_rows("combine_backward: dy", dy, h.num_rows(), s_.hidden); !st) return st;
    if (!dout.contiguous())
      return make_error(errc::shape_mismatch, "combine_backward: dout must be contiguous");
    auto gu = h.st_.rows_b.first(G * H);  // ReduceScatter backward = AllGather
    if (auto st = g.tp_ep.all_gather_v(x, dout, rows_of(gu, s_.hidden),
                                       std::span<const int>(h.st_.tokens));
        !st)
      return st;
    // Un-permute backward = permute.
    return x.template gather_rows<T>(rows_of(std::span<const T>(gu), s_.hidden),
                                     h.plan_.row_slots(), s_.topk, dy);
  }

  //! Backward of dispatch: dx_rows [M, H], dprob_rows [M, 1] -> dx [N, H], dprobs [N, k]
  //! (dx and dprobs contiguous).
  [[nodiscard]] status dispatch_backward(Exec& x, const handle_type& h, const_view dx_rows,
                                         const_prob_view dprob_rows, const dispatch_groups<Comm>& g,
                                         view dx, prob_view dprobs) {
    if (auto st = check_handle(h, g); !st) return st;
    if (auto st = this->check_backward_shapes(h, dx_rows, dprob_rows, dx, dprobs); !st) return st;
    if (pack_reductions) return dispatch_backward_packed(x, h, dx_rows, dprob_rows, g, dx, dprobs);
    return dispatch_backward_separate(x, h, dx_rows, dprob_rows, g, dx, dprobs);
  }

 private:
  // The dispatch of one rank taking every_pair_routed on trust: the group's tokens are this
  // rank's (G = N: combine's and the backward's collectives over the group of one move them as
  // they are), the plan's rows the experts' batch, its offsets left on the context.
  //                                                     x [N, H], probs [N, k] -> [N k, .]
  template <class Buffers>
  expected<handle_type> dispatch_routed(Exec& x, const dispatch_input<T, space, Prob>& in,
                                        const Buffers& b, handle_type& h) {
    b.tokens[0] = in.num_tokens;
    h.st_.gathered = in.num_tokens;
    const plan_input<space> pa{.num_tokens = in.num_tokens,
                               .topk = s_.topk,
                               .num_experts = s_.num_experts,
                               .expert = in.expert};
    auto plan = enqueue_permute_plan(x, pa, b.plan);
    if (!plan) return unexpected<error>(plan.error());
    h.plan_ = *plan;
    h.routed_unchecked_ = true;
    h.offsets_ = h.plan_.offset_row();
    const auto M = detail::uz(h.plan_.num_rows());
    h.x_ = common::batch_rows_of(b.batch_x, static_cast<int>(M), s_.hidden);
    h.p_ = rows_of(b.batch_probs.first(M), 1);
    if (auto st = common::permute_by_slot(x, in, h.plan_.row_slots(), s_.topk, h.x_, h.p_); !st)
      return unexpected<error>(st.error());
    return std::move(h);
  }

  // The carved workspace. The spans of the saved and scratch parts are addresses in the
  // context's memory, reached only as views handed to the context's operations and the
  // collectives; the host part holds what the host reads.
  struct buffers {
    std::span<std::byte> plan;                                     // saved, context
    std::span<T> batch_x;                                          // saved, context
    std::span<Prob> batch_probs;                                   // saved, context
    std::span<int> header_row, header, experts, local_experts;     // scratch, context
    std::span<T> rows_a, rows_b;                                   // scratch, context
    std::span<Prob> probs_a;                                       // scratch, context
    std::span<detail::dispatch_stamp> stamp;                       // host
    std::span<int> header_host, tokens, per_expert, local_status;  // host
  };

  // Permute backward (a sum per gathered token), then the AllGather backward: a sum over the
  // group, which adds the experts of the other EP ranks and the partials of the ETP peers. Packed:
  // the input gradients in columns [0, H) and the probability gradients in their columns from Hp
  // of one ReduceScatter-V (both summed in T: pack_reductions, Prob is T).
  status dispatch_backward_packed(Exec& x, const handle_type& h, const_view dx_rows,
                                  const_prob_view dprob_rows, const dispatch_groups<Comm>& g,
                                  view dx, prob_view dprobs) {
    const auto K = detail::uz(s_.topk), G = detail::uz(h.st_.gathered);
    const int W = packed_width(), Hp = probs_first();
    const auto Wz = detail::uz(W);
    auto gx = h.st_.rows_b.first(G * Wz);
    if (auto st = x.template gather_sum_rows<T, T, accumulator_t<T>>(
            dx_rows, h.plan_.token_rows(), {}, columns_of(gx, W, 0, s_.hidden));
        !st)
      return st;
    auto gp = h.st_.probs_a.first(G * K);  // by slot, then into the packed rows' columns
    if (auto st = x.template gather_rows<Prob>(dprob_rows, h.plan_.slot_rows(), 1, rows_of(gp, 1));
        !st)
      return st;
    if (auto st = x.copy(rows_of(std::span<const Prob>(gp), s_.topk), probs_of(gx, W, Hp, s_.topk));
        !st)
      return st;
    if (auto st = zero_gaps(x, gx); !st) return st;
    auto rr = h.st_.rows_a.first(detail::uz(h.num_tokens()) * Wz);
    if (auto st = g.tp_ep.reduce_scatter_v(x, rows_of(std::span<const T>(gx), W),
                                           std::span<const int>(h.st_.tokens), rows_of(rr, W),
                                           reduce_op::sum);
        !st)
      return st;
    const std::span<const T> rrc = rr;
    if (auto st = x.copy(columns_of(rrc, W, 0, s_.hidden), dx); !st) return st;
    return x.copy(probs_of(rrc, W, Hp, s_.topk), dprobs);
  }

  // The backward when the probability gradients may not be summed in packed rows
  // (!pack_reductions: 16-bit T, or Prob other than T): they keep their own ReduceScatter-V, in
  // Prob.
  status dispatch_backward_separate(Exec& x, const handle_type& h, const_view dx_rows,
                                    const_prob_view dprob_rows, const dispatch_groups<Comm>& g,
                                    view dx, prob_view dprobs) {
    const auto H = detail::uz(s_.hidden), K = detail::uz(s_.topk), G = detail::uz(h.st_.gathered);
    auto gx = h.st_.rows_b.first(G * H);
    if (auto st = x.template gather_sum_rows<T, T, accumulator_t<T>>(dx_rows, h.plan_.token_rows(),
                                                                     {}, rows_of(gx, s_.hidden));
        !st)
      return st;
    if (auto st = g.tp_ep.reduce_scatter_v(x, rows_of(std::span<const T>(gx), s_.hidden),
                                           std::span<const int>(h.st_.tokens), dx, reduce_op::sum);
        !st)
      return st;
    auto gp = h.st_.probs_a.first(G * K);
    if (auto st = x.template gather_rows<Prob>(dprob_rows, h.plan_.slot_rows(), 1, rows_of(gp, 1));
        !st)
      return st;
    return g.tp_ep.reduce_scatter_v(x, rows_of(std::span<const Prob>(gp), s_.topk),
                                    std::span<const int>(h.st_.tokens), dprobs, reduce_op::sum);
  }

  // The first probability column of a packed row, and zeros in the columns that hold neither the
  // token row nor the probabilities: [H, Hp) and [Hp + k * prob_cols, W).
  int probs_first() const noexcept { return static_cast<int>(layout::probs_first(s_.hidden)); }
  status zero_gaps(Exec& x, std::span<T> packed) const {
    const int W = packed_width(), Hp = probs_first();
    if (auto st = zero_columns(x, packed, W, s_.hidden, Hp); !st) return st;
    return zero_columns(x, packed, W, Hp + s_.topk * common::prob_cols, W);
  }

  // Rows of the experts' batch at most: the receive bound (by default every routed pair of the
  // group), or C per (rank, local expert) in pad mode.
  long long recv_rows(int capacity) const noexcept {
    const long long P = static_cast<long long>(s_.ep) * s_.etp, L = s_.num_experts / s_.ep;
    if (capacity >= 0) return static_cast<long long>(capacity) * L * P;
    return s_.max_recv_rows ? *s_.max_recv_rows : detail::worst_recv_rows(s_);
  }

  // Saved (kept by the handle until the backward): the plan, the batch.
  void carve_saved(workspace_carver& c, int capacity, buffers& b) const {
    const auto P = detail::uz(s_.ep) * detail::uz(s_.etp);
    const auto G = detail::uz(s_.max_tokens) * P, L = detail::uz(s_.num_experts / s_.ep);
    const auto M = detail::uz(recv_rows(capacity));
    const permute_args pa{.num_tokens = static_cast<int>(G),
                          .topk = s_.topk,
                          .num_experts = static_cast<int>(L),
                          .capacity = capacity >= 0 ? std::optional<int>(capacity) : std::nullopt,
                          .num_sources = capacity >= 0 ? static_cast<int>(P) : 1};
    b.plan = c.take<std::byte>(permute_plan::workspace_bytes(pa));
    b.batch_x = c.take<T>(M * detail::uz(common::batch_stride(s_.hidden)));
    b.batch_probs = c.take<Prob>(M);
  }
  // Host (kept with the handle): the gathered header, the token counts, the rows per expert.
  void carve_host(workspace_carver& c, buffers& b) const {
    const auto P = detail::uz(s_.ep) * detail::uz(s_.etp), L = detail::uz(s_.num_experts / s_.ep);
    b.stamp = c.take<detail::dispatch_stamp>(1);
    b.header_host = c.take<int>(P * detail::uz(detail::gathered_header::width(s_.num_experts)));
    b.local_status = c.take<int>(detail::uz(s_.num_experts / s_.ep) + 2);
    b.tokens = c.take<int>(P);
    b.per_expert = c.take<int>(L);
  }
  // Scratch (dead after each call): this rank's header row and the gathered table, the gathered
  // tokens with their probabilities (packed rows of W elements), the gathered routing, and the
  // probabilities by slot.
  void carve_scratch(workspace_carver& c, buffers& b) const {
    const auto P = detail::uz(s_.ep) * detail::uz(s_.etp), W = detail::uz(packed_width()),
               K = detail::uz(s_.topk);
    const auto G = detail::uz(s_.max_tokens) * P;
    const auto HW = detail::uz(detail::gathered_header::width(s_.num_experts));
    b.header_row = c.take<int>(HW);
    b.header = c.take<int>(P * HW);
    b.experts = c.take<int>(G * K);
    b.local_experts = c.take<int>(G * K);
    b.rows_a = c.take<T>(G * W);
    b.rows_b = c.take<T>(G * W);
    b.probs_a = c.take<Prob>(G * K);
  }

  status check_handle(const handle_type& h, const dispatch_groups<Comm>& g) const {
    if (auto st = h.check_issued_by(this); !st) return st;
    return detail::check_dispatch_groups(s_, g);
  }

  dispatch_shape s_{};
  std::uint64_t serial_ = 0;  // dispatches made (the stamp of the latest)
};

}  // namespace v0_1
}  // namespace moefold
