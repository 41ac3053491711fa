//! @file dispatch_args.hpp
//! @brief What every token dispatcher is built for and called with, and the checks they share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "../comm/communicator.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "pad_mode.hpp"

namespace moefold {
inline namespace v0_1 {

//! What a dispatcher is sized for. max_tokens bounds N on every rank of the tp-ep group;
//! max_recv_rows bounds the rows this rank's experts receive in one step (after the AllGather
//! over ETP), as DeepEP's num_worst_tokens: unset, it is the worst case max_tokens * topk * EP *
//! ETP (every routed pair of the tp-ep group lands on this rank's experts), which grows with EP.
//! A trainer sets it from its capacity or its measured maximum; a step that would exceed it fails
//! with errc::receive_bound_exceeded on every rank of the group before any row moves.
//! moefold's two dispatchers (Megatron-Core's moe_token_dispatcher_type "alltoall" and
//! "allgather"), for a dispatcher chosen at run time (dispatcher_variant).
enum class dispatcher_kind { all_to_all, all_gather };

//! The kind's name as Megatron-Core's configuration spells it ("alltoall", "allgather").
[[nodiscard]] constexpr const char* to_string(dispatcher_kind k) noexcept {
  return k == dispatcher_kind::all_to_all ? "alltoall" : "allgather";
}

struct dispatch_shape {
  int max_tokens = 0;                  //!< upper bound of N on each rank
  int hidden = 0;                      //!< H
  int topk = 1;                        //!< k
  int num_experts = 1;                 //!< E (global); E % EP == 0
  int ep = 1;                          //!< EP
  int etp = 1;                         //!< ETP
  std::optional<int> max_recv_rows{};  //!< receive bound (rows); unset: the worst case
  //! The dispatcher asked for: a concrete dispatcher refuses the other kind (so a configuration
  //! naming one never silently runs the other); dispatcher_variant makes the one named. Unset:
  //! whichever dispatcher the type names (dispatcher_variant: its first).
  std::optional<dispatcher_kind> kind{};
};

//! The three parts of a dispatcher's workspace. `saved`: what the handle keeps from dispatch to
//! the backward on the context (plan, the experts' batch), one per MoE layer of a model.
//! `scratch`: rows and counts used inside one call and dead after it, so one scratch buffer can
//! serve every layer of a model (calls of different layers never overlap). Both are in the
//! execution context's memory space (device memory for cuda_exec and cpu_exec: addresses the
//! host never dereferences). `host`: host memory for the bookkeeping the host reads (splits,
//! gathered counts, chunk order), kept with the handle like `saved`; small (O(EP * ETP * E)).
//! On a GPU context `host` may be pinned; a dispatch's copy from it may then still be pending
//! when dispatch returns, so the caller writes into it (for another purpose) only after a wait of
//! the context: a later copy to the host, or synchronize(). The dispatchers themselves rewrite it
//! only after such a wait (All-to-All pad mode, which never waits, copies nothing from it).
struct dispatch_workspace {
  std::span<std::byte> saved{};
  std::span<std::byte> scratch{};
  std::span<std::byte> host{};
};

//! Bytes of each part; `total()` is their sum.
struct dispatch_workspace_bytes {
  std::size_t saved = 0;
  std::size_t scratch = 0;
  std::size_t host = 0;
  [[nodiscard]] constexpr std::size_t total() const noexcept { return saved + scratch + host; }
};

//! One rank's inputs to dispatch, as views in the memory space of the dispatcher's context.
//! T is the tokens' element type, P the probabilities' (P = T, or wider: fp32 probabilities with
//! bf16 tokens, as Megatron-Core's moe_router_dtype='fp32' keeps them).
template <class T, memory_space Space = host_space, class P = T>
struct dispatch_input {
  int num_tokens = 0;                   //!< N <= max_tokens
  row_view<const T, Space> x{};         //!< [N, H] tokens (any row stride)
  row_view<const int, Space> expert{};  //!< [N, k] expert of each pair, -1 = dropped (contiguous)
  row_view<const P, Space> probs{};     //!< [N, k] router probability of each pair (contiguous)
  //! Pad mode when set (static shapes, docs/dispatch-semantics.md 5.2.1): every expert receives
  //! exactly `capacity` (>= 0) rows from this rank, its kept pairs in token order and then zero
  //! rows of probability 0, so no counts need exchanging. Every rank of the tp-ep group must pass
  //! the same value (drop_counts::pad_rows); a mismatch is reported by the communicator's count
  //! check (All-to-All path) or by the dispatcher (AllGather path). Unset: rows as routed.
  std::optional<int> capacity{};
  //! The caller's word that every one of the N k slots names an expert (no -1: dropless routing
  //! straight from the router). Dropless with EP = ETP = 1 on a context that runs kernels, either
  //! dispatcher then dispatches without bringing anything to the host (no wait): the batch is the
  //! N k rows, its rows per expert stay on the context (handle.batch_offsets()), and a record
  //! that breaks the word is a fault its device_status() reports (a -1 gave its own pair no row;
  //! a bad id or a repeat gave the record none). Elsewhere it changes nothing.
  bool every_pair_routed = false;
};

//! This rank's communicators for the three groups a dispatcher uses. The tp-ep rank must be
//! ep_rank * ETP + etp_rank (Megatron-Core's layout; group_communicator builds it so).
template <class Comm>
struct dispatch_groups {
  Comm& ep;
  Comm& etp;
  Comm& tp_ep;
};

namespace detail {

//! The worst-case receive rows of a shape (every routed pair of the tp-ep group), in 64 bits.
[[nodiscard]] constexpr std::int64_t worst_recv_rows(const dispatch_shape& s) noexcept {
  return static_cast<std::int64_t>(s.max_tokens) * s.topk * s.ep * s.etp;
}

//! Sizes >= 1 (max_tokens >= 0), E divisible by EP, k <= E, row counts below 2^31 (elements and
//! bytes are 64-bit: a DeepSeek-V3 layer, H 7168, k 8, 4,096 tokens, EP 64, fits).
[[nodiscard]] inline status check_dispatch_shape(const dispatch_shape& s) {
  if (s.max_tokens < 0 || s.hidden < 1 || s.topk < 1 || s.num_experts < 1 || s.ep < 1 || s.etp < 1)
    return make_error(errc::invalid_size, "dispatcher: sizes must be >= 1 (max_tokens >= 0)");
  if (s.num_experts % s.ep != 0)
    return make_error(errc::invalid_argument,
                      "dispatcher: num_experts = " + to_decimal(s.num_experts) +
                          " is not divisible by ep = " + to_decimal(s.ep) +
                          " (each EP rank owns E / EP experts)");
  if (s.topk > s.num_experts)
    return make_error(errc::invalid_argument,
                      "dispatcher: topk = " + to_decimal(s.topk) +
                          " exceeds num_experts = " + to_decimal(s.num_experts));
  if (s.max_recv_rows && (*s.max_recv_rows < 0))
    return make_error(errc::invalid_size, "dispatcher: max_recv_rows must be >= 0 (got " +
                                              to_decimal(*s.max_recv_rows) + ")");
  if (static_cast<std::int64_t>(s.max_tokens) * s.topk > max_rows)
    return make_error(errc::overflow,
                      "dispatcher: max_tokens * topk = " +
                          to_decimal(static_cast<long long>(s.max_tokens) * s.topk) +
                          " rows reach 2^31");
  if (!s.max_recv_rows && worst_recv_rows(s) > max_rows)
    return make_error(errc::overflow, "dispatcher: the worst case max_tokens * topk * ep * etp = " +
                                          to_decimal(worst_recv_rows(s)) +
                                          " rows reaches 2^31; set dispatch_shape::max_recv_rows");
  return {};
}

//! The shape's checks for a dispatcher of kind `k` named `name`: check_dispatch_shape, and a
//! shape that asks for the other kind is refused by name.
[[nodiscard]] inline status check_dispatch_shape(const dispatch_shape& s, dispatcher_kind k,
                                                 const char* name) {
  if (s.kind && *s.kind != k)
    return make_error(errc::invalid_argument,
                      std::string(name) + ": the shape asks for the " + to_string(*s.kind) +
                          " dispatcher (dispatch_shape::kind); choose it at run time with "
                          "dispatcher_variant");
  return check_dispatch_shape(s);
}

//! The communicators match the shape and come from one fold.
template <class Comm>
[[nodiscard]] status check_dispatch_groups(const dispatch_shape& s,
                                           const dispatch_groups<Comm>& g) {
  if (g.ep.size() != s.ep || g.etp.size() != s.etp || g.tp_ep.size() != s.ep * s.etp)
    return make_error(errc::shape_mismatch,
                      "dispatcher: communicators of sizes ep " + to_decimal(g.ep.size()) +
                          ", etp " + to_decimal(g.etp.size()) + ", tp-ep " +
                          to_decimal(g.tp_ep.size()) + " do not match EP = " + to_decimal(s.ep) +
                          ", ETP = " + to_decimal(s.etp));
  if (g.tp_ep.rank() != g.ep.rank() * s.etp + g.etp.rank())
    return make_error(
        errc::invalid_argument,
        "dispatcher: tp-ep rank " + to_decimal(g.tp_ep.rank()) +
            " is not ep_rank * ETP + etp_rank = " + to_decimal(g.ep.rank() * s.etp + g.etp.rank()) +
            " (build the groups with group_communicator from one fold)");
  return {};
}

//! N within the bound and the views shaped x [N, H], expert and probs [N, k] (contiguous).
template <class T, class S, class P>
[[nodiscard]] status check_dispatch_input(const dispatch_shape& s,
                                          const dispatch_input<T, S, P>& in) {
  if (in.num_tokens < 0 || in.num_tokens > s.max_tokens)
    return make_error(errc::invalid_size,
                      "dispatch: num_tokens = " + to_decimal(in.num_tokens) +
                          " outside [0, max_tokens = " + to_decimal(s.max_tokens) + "]");
  const int N = in.num_tokens;
  auto is = [N](const auto& v, int w) {
    return v.rows() == N && (N == 0 || (v.width() == w && (v.data() != nullptr)));
  };
  if (!is(in.x, s.hidden) || !is(in.expert, s.topk) || !is(in.probs, s.topk) ||
      !in.expert.contiguous() || !in.probs.contiguous())
    return make_error(errc::shape_mismatch,
                      "dispatch: x must be [N, H] and expert, probs [N, k] (contiguous) for N = " +
                          to_decimal(N) + ", H = " + to_decimal(s.hidden) + ", k = " +
                          to_decimal(s.topk) + " (got x [" + to_decimal(in.x.rows()) + ", " +
                          to_decimal(in.x.width()) + "], expert [" + to_decimal(in.expert.rows()) +
                          ", " + to_decimal(in.expert.width()) + "], probs [" +
                          to_decimal(in.probs.rows()) + ", " + to_decimal(in.probs.width()) + "])");
  if (in.capacity && *in.capacity < 0)
    return make_error(errc::invalid_argument,
                      "dispatch: capacity = " + to_decimal(*in.capacity) +
                          " (pad mode takes a capacity >= 0; leave it unset for no padding)");
  // Pad mode: a rank's experts compute C rows from each of the EP * ETP sources per local
  // expert, C * E * ETP rows in all (what the workspace of workspace_sizes(C) holds).
  const long long pad_bound =
      static_cast<long long>(pad_or_off(in.capacity)) * s.num_experts * s.etp;
  if (in.capacity && pad_bound > max_rows)
    return make_error(errc::overflow, "dispatch: capacity * num_experts * etp = " +
                                          to_decimal(pad_bound) + " rows reach 2^31");
  if (in.capacity && s.max_recv_rows && pad_bound > *s.max_recv_rows)
    return make_error(
        errc::receive_bound_exceeded,
        "dispatch: pad mode with capacity " + to_decimal(*in.capacity) +
            " receives capacity * num_experts * etp = " + to_decimal(pad_bound) +
            " rows on every rank, more than max_recv_rows = " + to_decimal(*s.max_recv_rows));
  return {};
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
