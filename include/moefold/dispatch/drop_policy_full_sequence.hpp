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

//! Full-sequence dropping: C = ceil(N_group*k/E * capacity_factor) over the N_group tokens of the
//! TP x CP group; ties (probs) and positions follow the true sequence order given by the keys.
struct full_sequence {
  double capacity_factor = 1.0;
  bool pad_to_capacity = false;
  drop_by by = drop_by::probs;

  //! Its rules for forwards up to `shape` (capacity factor, drop-by value, the group's pairs).
  [[nodiscard]] status check(const drop_shape& shape) const {
    return detail::check_keep_rule({.capacity_factor = capacity_factor, .by = by}, shape, true);
  }
  //! With pad_to_capacity, the most rows per expert for forwards up to `shape` (the group's).
  [[nodiscard]] std::optional<int> pad_rows_bound(const drop_shape& shape) const {
    return detail::pad_rows_bound(
        {.capacity_factor = capacity_factor, .pad = pad_to_capacity, .by = by}, shape, true);
  }
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
};

}  // namespace v0_1
}  // namespace moefold
