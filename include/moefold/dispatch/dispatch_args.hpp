//! @file dispatch_args.hpp
//! @brief What every token dispatcher is built for and called with, and the checks they share.
#pragma once

#include <cstddef>
#include <span>

#include "../comm/communicator.hpp"
#include "../core/expected.hpp"

namespace moefold {

//! What a dispatcher is sized for. max_tokens bounds N on every rank of the tp-ep group (the
//! workspace holds the worst case: every token of the group routed to this rank's experts).
struct dispatch_shape {
  int max_tokens = 0;   //!< upper bound of N on each rank
  int hidden = 0;       //!< H
  int topk = 1;         //!< k
  int num_experts = 1;  //!< E (global); E % EP == 0
  int ep = 1;           //!< EP
  int etp = 1;          //!< ETP
};

//! One rank's inputs to dispatch.
template <class T>
struct dispatch_input {
  int num_tokens = 0;             //!< N <= max_tokens
  std::span<const T> x{};         //!< [N, H] tokens
  std::span<const int> expert{};  //!< [N*k] expert of each pair, -1 = dropped
  std::span<const T> probs{};     //!< [N*k] router probability of each pair
  //! Pad mode when >= 0 (static shapes, dispatch-semantics.md 5.2.1): every expert receives
  //! exactly `capacity` rows from this rank, its kept pairs in token order and then zero rows of
  //! probability 0, so no counts need exchanging. Every rank of the tp-ep group must pass the same
  //! value (drop_result::pad_rows); a mismatch is reported by the communicator's count check
  //! (All-to-All path) or by the dispatcher (AllGather path). -1: rows as routed.
  int capacity = -1;
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

//! Sizes >= 1 (max_tokens >= 0), E divisible by EP, k <= E, worst-case buffers within int.
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
  const long long bound = static_cast<long long>(s.max_tokens) * s.topk * s.ep * s.etp;
  if (bound * s.hidden > 2147483647LL)
    return make_error(errc::overflow,
                      "dispatcher: max_tokens * topk * ep * etp * hidden exceeds 2^31-1");
  return {};
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

//! N within the bound and the buffers shaped [N, H] and [N*k].
template <class T>
[[nodiscard]] status check_dispatch_input(const dispatch_shape& s, const dispatch_input<T>& in) {
  if (in.num_tokens < 0 || in.num_tokens > s.max_tokens)
    return make_error(errc::invalid_size,
                      "dispatch: num_tokens = " + to_decimal(in.num_tokens) +
                          " outside [0, max_tokens = " + to_decimal(s.max_tokens) + "]");
  const auto N = static_cast<std::size_t>(in.num_tokens);
  const auto H = static_cast<std::size_t>(s.hidden), K = static_cast<std::size_t>(s.topk);
  if (in.x.size() != N * H || in.probs.size() != N * K || in.expert.size() != N * K)
    return make_error(errc::shape_mismatch, "dispatch: x must be [N, H] and expert, probs [N*k]");
  if (in.capacity < -1)
    return make_error(errc::invalid_argument,
                      "dispatch: capacity = " + to_decimal(in.capacity) +
                          " (pad mode takes a capacity >= 0, -1 turns it off)");
  // Pad mode: a rank's experts compute C rows from each of the EP * ETP sources per local
  // expert, C * E * ETP rows in all.
  const long long pad_bound = static_cast<long long>(in.capacity) * s.num_experts * s.etp;
  if (in.capacity > 0 && pad_bound * s.hidden > 2147483647LL)
    return make_error(errc::overflow,
                      "dispatch: capacity * num_experts * etp * hidden exceeds 2^31-1");
  return {};
}

}  // namespace detail
}  // namespace moefold
