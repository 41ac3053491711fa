//! @file drop_policy_full_sequence.hpp
//! @brief Full-sequence dropping: the capacity and the keep decision are taken over the whole
//! sequences held by the TP x CP group. Each rank gathers the (detached) top-k routing of the
//! group, takes the same deterministic decision in true sequence order, and keeps its own rows.
//! The result does not depend on TP or CP. Megatron-Core no longer ships this mode (it went with
//! the alltoall_seq dispatcher); the semantics are docs/dispatch-semantics.md section 3.4.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "../comm/communicator.hpp"
#include "capacity_keep.hpp"
#include "drop_args.hpp"
#include "drop_policy.hpp"
#include "drop_result.hpp"

namespace moefold {
inline namespace v0_1 {

//! Where this rank's tokens sit in the full sequences (sequence parallelism over TP, context
//! parallelism with Megatron-Core's load-balanced chunks over CP).
struct sequence_layout {
  int tp_rank = 0;
  int tp = 1;
  int cp_rank = 0;
  int cp = 1;
  int local_seq = 0;  //!< S_local = S / (TP*CP)
  int batch = 1;      //!< B
};

//! The true-order key of each local token n = s*B + b: (global position) * B + b. Under CP the
//! sequence is cut into 2*CP chunks and CP rank r holds chunks r and 2*CP-1-r; sequence
//! parallelism then splits the rank's CP part contiguously over TP.
[[nodiscard]] inline expected<std::vector<std::int64_t>> sequence_order_keys(
    const sequence_layout& l) {
  using detail::to_decimal;
  if (l.tp < 1 || l.cp < 1 || l.tp_rank < 0 || l.tp_rank >= l.tp || l.cp_rank < 0 ||
      l.cp_rank >= l.cp || l.local_seq < 0 || l.batch < 1)
    return make_error(errc::invalid_argument,
                      "sequence_layout: ranks must lie in [0, tp) and [0, "
                      "cp); sizes >= 1 (local_seq >= 0)");
  const std::int64_t cp_len = static_cast<std::int64_t>(l.local_seq) * l.tp;  // CP rank's part
  if (l.cp > 1 && cp_len % 2 != 0)
    return make_error(errc::invalid_argument,
                      "sequence_layout: with cp > 1 the CP part S_local*tp (" +
                          to_decimal(static_cast<long long>(cp_len)) +
                          ") must be even (two chunks per CP rank)");
  const std::int64_t chunk = l.cp > 1 ? cp_len / 2 : cp_len;
  std::vector<std::int64_t> keys(static_cast<std::size_t>(l.local_seq) *
                                 static_cast<std::size_t>(l.batch));
  for (int s = 0; s < l.local_seq; ++s) {
    const std::int64_t p = static_cast<std::int64_t>(l.tp_rank) * l.local_seq + s;  // in CP part
    std::int64_t pos = p;
    if (l.cp > 1)
      pos = p < chunk ? l.cp_rank * chunk + p : (2 * l.cp - 1 - l.cp_rank) * chunk + (p - chunk);
    for (int b = 0; b < l.batch; ++b)
      keys[static_cast<std::size_t>(s) * l.batch + b] = pos * l.batch + b;
  }
  return keys;
}

namespace detail {
//! order[i] = the rank of keys[i] among all keys (its place in true sequence order); two equal
//! keys are an error. `by_key` is scratch.
[[nodiscard]] inline status rank_by_key(std::span<const std::int64_t> keys,
                                        std::vector<std::size_t>& by_key,
                                        std::vector<long long>& order) {
  by_key.resize(keys.size());
  std::iota(by_key.begin(), by_key.end(), std::size_t{0});
  std::sort(by_key.begin(), by_key.end(), [&](std::size_t a, std::size_t b) {
    return keys[a] != keys[b] ? keys[a] < keys[b] : a < b;
  });
  order.resize(keys.size());
  for (std::size_t i = 0; i < by_key.size(); ++i) {
    if (i > 0 && keys[by_key[i]] == keys[by_key[i - 1]])
      return make_error(errc::invalid_argument,
                        "full_sequence: two tokens of the group have the same order key " +
                            to_decimal(static_cast<long long>(keys[by_key[i]])));
    order[by_key[i]] = static_cast<long long>(i);
  }
  return {};
}
}  // namespace detail

//! Full-sequence dropping: C = ceil(N_group*k/E * capacity_factor) over the N_group tokens of the
//! TP x CP group; ties (probs) and positions follow the true sequence order given by the keys.
struct full_sequence {
  double capacity_factor = 1.0;
  bool pad_to_capacity = false;
  drop_by by = drop_by::probs;

  //! On an execution context (dispatch/capacity_keep.hpp): the workspace for forwards up to
  //! `shape` (shape.group: the tp-cp group's ranks), and the decision over the group's tokens,
  //! collective over tp_cp. The order keys [N, 1] are sequence_order_keys' values: the group's
  //! keys a permutation of [0, M) (the layer's contract; a key that breaks it is an error naming
  //! it), or empty on every rank to take the group's rank order.
  template <class R>
  [[nodiscard]] std::size_t workspace_bytes(const drop_shape& shape) const {
    return detail::keep_workspace_bytes<R>(shape, true);
  }
  template <class R, class Exec, class Comm>
  [[nodiscard]] expected<drop_decision> apply(Exec& x, Comm& tp_cp,
                                              const drop_input<R, typename Exec::memory_space>& in,
                                              const drop_output<typename Exec::memory_space>& out,
                                              std::span<std::byte> ws) const {
    return detail::keep_on_context<true, R>(
        x, &tp_cp, in, out, ws,
        detail::keep_rule{.capacity_factor = capacity_factor, .pad = pad_to_capacity, .by = by});
  }

  //! `order_keys` [N]: the true sequence-order key of each local token (sequence_order_keys), or
  //! empty to take the group's rank order (rank 0's tokens first) as the sequence order; all ranks
  //! must agree on which. Collective over tp_cp: every rank calls it, and every rank gets the same
  //! error when one rank's input is bad. Writes r.keep and the counts of this rank's tokens;
  //! `ws` holds the group's gathered record between calls (no allocation once grown).
  template <communicator C, class T>
  [[nodiscard]] status apply(C& tp_cp, std::span<const std::int64_t> order_keys,
                             const routing_view<T>& r, drop_counts& out,
                             drop_scratch<T>& ws) const {
    using detail::to_decimal;
    // 1. Exchange a small header: shape, whether keys are given, whether the local input is good.
    const bool keys_ok =
        order_keys.empty() || order_keys.size() == static_cast<std::size_t>(r.num_tokens);
    const status input = !keys_ok ? status(make_error(errc::shape_mismatch,
                                                      "full_sequence: order_keys must be empty or "
                                                      "have num_tokens entries"))
                                  : detail::check_routing(r);
    // Initialized, not assigned: nvcc warns on the discarded result of an assignment of status.
    const status local = input ? detail::check_counts(out, r.num_tokens, r.num_experts) : input;
    const int G = tp_cp.size();
    const int hdr[4] = {local ? r.num_tokens : -1, r.num_experts, r.topk,
                        order_keys.empty() ? 0 : 1};
    ws.header.resize(static_cast<std::size_t>(4 * G));
    if (auto s = tp_cp.all_gather(std::span<const int>(hdr, 4), std::span<int>(ws.header)); !s)
      return s;
    if (!local) return local;
    ws.rows.resize(static_cast<std::size_t>(G));
    ws.pairs_of.resize(static_cast<std::size_t>(G));
    long long total = 0, offset = 0;
    for (int g = 0; g < G; ++g) {
      const int* h = ws.header.data() + 4 * g;
      if (h[0] < 0)
        return make_error(errc::invalid_argument,
                          "full_sequence: rank " + to_decimal(g) + " of the group has bad input");
      if (h[1] != r.num_experts || h[2] != r.topk || h[3] != hdr[3])
        return make_error(errc::comm_mismatch,
                          "full_sequence: ranks disagree on num_experts, topk or whether order "
                          "keys are given (rank " +
                              to_decimal(g) + ")");
      ws.rows[static_cast<std::size_t>(g)] = h[0];
      if (g < tp_cp.rank()) offset += h[0];
      total += h[0];
    }
    if (total * r.topk > INT_MAX)
      return make_error(errc::overflow, "full_sequence: the group's routed pairs overflow int");
    for (int g = 0; g < G; ++g)
      ws.pairs_of[static_cast<std::size_t>(g)] = ws.rows[static_cast<std::size_t>(g)] * r.topk;
    auto cap = expert_capacity(total * r.topk, r.num_experts, capacity_factor);
    if (!cap) return unexpected<error>(cap.error());
    if (pad_to_capacity && *cap > total)
      return make_error(errc::invalid_argument, "pad_to_capacity: capacity " + to_decimal(*cap) +
                                                    " exceeds the " + to_decimal(total) +
                                                    " tokens of the sequence group");

    // 2. Gather the detached routing (and keys) of the whole group, in rank order.
    const auto K = static_cast<std::size_t>(r.topk), N = static_cast<std::size_t>(r.num_tokens);
    const auto all_pairs = static_cast<std::size_t>(total) * K;
    ws.expert.resize(all_pairs);
    ws.probs.resize(all_pairs);
    ws.keep.resize(all_pairs);
    const std::span<const int> pairs_of(ws.pairs_of);
    if (auto s = tp_cp.all_gather_v(std::span<const int>(r.expert, N * K),
                                    std::span<int>(ws.expert), pairs_of);
        !s)
      return s;
    if (auto s = tp_cp.all_gather_v(std::span<const T>(r.probs, N * K), std::span<T>(ws.probs),
                                    pairs_of);
        !s)
      return s;
    ws.order.clear();  // row -> rank in true order; empty: rank order
    if (!order_keys.empty()) {
      ws.keys.resize(static_cast<std::size_t>(total));
      if (auto s = tp_cp.all_gather_v(order_keys, std::span<std::int64_t>(ws.keys),
                                      std::span<const int>(ws.rows));
          !s)
        return s;
      if (auto s =
              detail::rank_by_key(std::span<const std::int64_t>(ws.keys), ws.by_order, ws.order);
          !s)
        return s;
    }

    // 3. The same decision on every rank; keep this rank's pairs and count its rows.
    const routing_view<T> g{.num_tokens = static_cast<int>(total),
                            .topk = r.topk,
                            .num_experts = r.num_experts,
                            .expert = ws.expert.data(),
                            .probs = ws.probs.data(),
                            .keep = ws.keep.data()};
    const auto first = static_cast<std::size_t>(offset);
    detail::keep_within_capacity(g, *cap, by, pad_to_capacity, std::span<const long long>(ws.order),
                                 first, N, out, ws);
    std::copy_n(ws.keep.begin() + static_cast<std::ptrdiff_t>(first * K), N * K, r.keep);
    out.capacity = *cap;
    out.pad_rows = pad_to_capacity ? std::optional<int>(*cap) : std::nullopt;
    return {};
  }
  //! The dense form (tests).
  template <communicator C, class T>
  [[nodiscard]] status apply(C& tp_cp, std::span<const std::int64_t> order_keys,
                             const topk_routing<T>& r, drop_result<T>& out) const {
    return apply_dense(*this, tp_cp, order_keys, r, out);
  }
};

}  // namespace v0_1
}  // namespace moefold
