//! @file capacity_keep.hpp
//! @brief The drop policies' decision on an execution context, one implementation for every
//! context (the kernels of kernels/capacity.hpp, histogram.hpp and sequence_order.hpp): the
//! capacity C = ceil(M k / E x capacity factor) over the M tokens the decision sees (this rank's N
//! for sub-sequence dropping; the tp-cp group's G N for full-sequence dropping, whose routing and
//! order keys are gathered on the context first), the routed pairs grouped by expert (histogram,
//! offsets, lists), each pair's rank among its expert's in true sequence order, kept below C, pad
//! mode's fillers, and this rank's slice: the keep mask, the kept record, per-expert counts and
//! totals. Dropless keeps every pair and counts them.
//!
//! Rules of the routing (every selected expert in [0, E), none twice for a token) and of the order
//! keys (the tp-cp group's keys a permutation of [0, M): sequence_order_keys' values, the layer's
//! contract) are checked by the kernels themselves. On host memory (host_exec) a fault is read
//! back at once and reported, naming the first bad slot or key. A context of device memory
//! (cuda_exec, and cpu_exec, which stands for it in CI) reads nothing back, as the rest of a
//! GPU step: on every context the kernels lower the caller's sticky fault words
//! (drop_output::faults), which its device status reads.
//!
//! Workspace: keep_workspace_bytes(shape) bytes of the context's memory, dead after the call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include <moefold/kernels/capacity.hpp>
#include <moefold/kernels/histogram.hpp>
#include <moefold/kernels/sequence_order.hpp>

#include "../comm/communicator.hpp"
#include "../core/drop_by.hpp"
#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/exec.hpp"
#include "drop_args.hpp"
#include "expert_capacity.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {

//! How a policy decides: dropless (no factor), or capacity C with its drop order and pad mode,
//! over this rank's tokens or the tp-cp group's (full).
struct keep_rule {
  std::optional<double> capacity_factor{};
  bool pad = false;
  drop_by by = drop_by::probs;
};

//! The workspace's parts (the full-sequence ones empty for a local decision).
template <class R, class S>
struct keep_views {
  row_view<int, S> histogram, offsets, fault, lists, dispatched;
  row_view<int, S> ids;                    // [M, k] the group's experts (full)
  row_view<R, S> probs;                    // [M, k] their probabilities (full)
  row_view<std::uint8_t, S> keep;          // [M, k] the group's keep mask (full)
  row_view<std::int64_t, S> keys;          // [M, 1] the group's order keys (full, keys given)
  row_view<long long, S> order, by_order;  // [1, M]
  row_view<int, S> key_counts, key_fault, key_sticky;
};

//! The header a full-sequence group agrees on first, reduced with max over the group: N, k, E,
//! whether order keys are given, each also negated (so that the max of both gives the group's
//! largest and smallest), and whether some rank's input is bad. No allocation: [1, 9].
inline constexpr int keep_header_words = 9;
template <class S>
row_view<int, S> carve_header(workspace_carver& c) {
  return row_view<int, S>(c.take<int>(keep_header_words).data(), 1, keep_header_words);
}

template <class R, class S>
keep_views<R, S> carve_keep(workspace_carver& c, long long M, int k, int E, bool full) {
  const auto take = [&c]<class U>(long long rows, long long width) {
    return row_view<U, S>(c.take<U>(uz(rows * width)).data(), rows, width);
  };
  keep_views<R, S> v;
  v.histogram = take.template operator()<int>(1, E);
  v.offsets = take.template operator()<int>(1, E + 1);
  v.fault = take.template operator()<int>(1, 2);
  v.lists = take.template operator()<int>(1, M * k);
  v.dispatched = take.template operator()<int>(1, E);
  if (full) {
    v.ids = take.template operator()<int>(M, k);
    v.probs = take.template operator()<R>(M, k);
    v.keep = take.template operator()<std::uint8_t>(M, k);
    v.keys = take.template operator()<std::int64_t>(M, 1);
    v.order = take.template operator()<long long>(1, M);
    v.by_order = take.template operator()<long long>(1, M);
    v.key_counts = take.template operator()<int>(1, M);
    v.key_fault = take.template operator()<int>(1, 2);
    v.key_sticky = take.template operator()<int>(1, 2);
  }
  return v;
}

//! Bytes of the decision's workspace for forwards up to `shape`, for element type R.
template <class R>
[[nodiscard]] std::size_t keep_workspace_bytes(const drop_shape& shape, bool full) {
  workspace_carver c;
  if (full) (void)carve_header<host_space>(c);
  (void)carve_keep<R, host_space>(c,
                                  static_cast<long long>(full ? shape.group : 1) * shape.max_tokens,
                                  shape.topk, shape.num_experts, full);
  return c.required();
}

//! The rules of a capacity decision for forwards up to `shape` (a layer checks them when it is
//! made, so a bad policy is refused before any forward): the capacity factor's, the drop-by
//! value's, and the most pairs one decision sees (the group's with `full`) fitting an int.
[[nodiscard]] inline status check_keep_rule(const keep_rule& r, const drop_shape& shape,
                                            bool full) {
  if (r.by != drop_by::probs && r.by != drop_by::position)
    return make_error(errc::invalid_argument,
                      "drop policy: drop.by must be drop_by::probs or drop_by::position");
  if (!r.capacity_factor) return {};
  const long long pairs = static_cast<long long>(full ? shape.group : 1) * shape.max_tokens *
                          static_cast<long long>(shape.topk);
  if (pairs > 2147483647LL)
    return make_error(errc::overflow,
                      "drop policy: the routed pairs one decision sees (group x max_tokens x "
                      "topk) reach 2^31");
  auto c = expert_capacity(pairs, shape.num_experts, *r.capacity_factor);
  if (!c) return unexpected<error>(c.error());
  return {};
}

//! The most rows per expert a padding decision gives for forwards up to `shape`: the capacity of
//! the most pairs one decision sees, and no more than its tokens (a larger capacity is refused:
//! no expert could be padded to it); nullopt without padding. The capacity grows with the pairs,
//! so no smaller forward pads to more.
[[nodiscard]] inline std::optional<int> pad_rows_bound(const keep_rule& r, const drop_shape& shape,
                                                       bool full) {
  if (!r.pad || !r.capacity_factor) return std::nullopt;
  const long long tokens = static_cast<long long>(full ? shape.group : 1) * shape.max_tokens;
  auto c = expert_capacity(tokens * shape.topk, shape.num_experts, *r.capacity_factor);
  if (!c) return std::nullopt;  // check_keep_rule refuses the policy
  return static_cast<int>(std::min<long long>(*c, tokens));
}

//! Host memory's fault words are read back at once; device memory's (a GPU context's, and
//! cpu_exec's, which runs the GPU path in CI) stay for the caller's device status.
template <class Exec>
inline constexpr bool reads_faults_at_once = host_accessible_v<typename Exec::memory_space>;

template <class Exec, class S>
[[nodiscard]] status read_words(Exec& x, row_view<const int, S> v, int (&out)[2]) {
  if (auto st = x.copy(v, row_view<int, host_space>(out, 1, 2)); !st) return st;
  return x.synchronize();
}

//! The decision (see the file comment): over the tp-cp group `group` with Full (full-sequence
//! dropping), over this rank's tokens without (group unused, may be null).
template <bool Full, class R, class Exec, class Comm>
[[nodiscard]] expected<drop_decision> keep_on_context(
    Exec& x, Comm* group, const drop_input<R, typename Exec::memory_space>& in,
    const drop_output<typename Exec::memory_space>& out, std::span<std::byte> workspace,
    const keep_rule& rule) {
  using S = typename Exec::memory_space;
  const int N = in.experts.rows(), k = in.experts.width(), E = out.routed.width();
  const auto nk = [&](const auto& v) { return v.rows() == N && v.width() == k && v.contiguous(); };
  const auto e1 = [&](const auto& v) { return v.rows() == 1 && v.width() == E && v.contiguous(); };
  constexpr bool full = Full;
  const bool keys = !in.order_keys.empty();
  // This rank's input, judged before anything is exchanged.
  const status local = [&]() -> status {
    if (k < 1 || E < 1 || !in.experts.contiguous() || !nk(in.probs) || !nk(out.keep) ||
        !nk(out.kept) || !e1(out.routed) || !e1(out.dropped) || !e1(out.padded) ||
        out.totals.rows() != 1 || out.totals.width() != 2 ||
        (!out.filler_map.empty() && (out.filler_map.rows() != N || out.filler_map.width() != E ||
                                     !out.filler_map.contiguous())) ||
        (!out.faults.empty() &&
         (out.faults.rows() != 1 || out.faults.width() != 3 || !out.faults.contiguous())))
      return make_error(errc::shape_mismatch,
                        "drop policy: experts, probs, keep and kept must be contiguous [N, k], "
                        "routed, dropped and padded [1, E], totals [1, 2], filler_map [N, E] or "
                        "empty, faults [1, 3] or empty");
    if (keys && !full)
      return make_error(
          errc::invalid_argument,
          "drop policy: order keys are for full-sequence dropping; this policy decides locally");
    if (keys &&
        (in.order_keys.rows() != N || in.order_keys.width() != 1 || !in.order_keys.contiguous()))
      return make_error(errc::shape_mismatch,
                        "drop policy: the order keys must be contiguous [N, 1]");
    return {};
  }();
  int G = 1;
  if constexpr (Full) G = group->size();
  workspace_carver c(workspace);
  if constexpr (Full) {
    // Every rank of the group learns every rank's shape and whether its input is good before
    // the gathers, so that all return the same error instead of mismatching collectives (on
    // device memory the header is not read back: equal shapes are the caller's contract there).
    const row_view<int, S> h = carve_header<S>(c);
    if constexpr (reads_faults_at_once<Exec>) {
      if (!c.fits())
        return unexpected<error>(make_error(errc::workspace_too_small,
                                            "drop policy: the workspace is smaller than "
                                            "workspace_bytes()"));
      const int kk = keys ? 1 : 0;
      int w[keep_header_words] = {N, -N, k, -k, E, -E, kk, -kk, local ? 0 : 1};
      if (auto st = x.copy(row_view<const int, host_space>(w, 1, keep_header_words), h); !st)
        return unexpected<error>(st.error());
      if (auto st = group->all_reduce(x, h, reduce_op::max); !st)
        return unexpected<error>(st.error());
      if (auto st =
              x.copy(row_view<const int, S>(h), row_view<int, host_space>(w, 1, keep_header_words));
          !st)
        return unexpected<error>(st.error());
      if (auto st = x.synchronize(); !st) return unexpected<error>(st.error());
      if (!local) return unexpected<error>(local.error());
      if (w[8] != 0)
        return unexpected<error>(
            make_error(errc::invalid_argument,
                       "full-sequence dropping: another rank of the tp-cp group has a bad input"));
      if (w[0] != -w[1] || w[2] != -w[3] || w[4] != -w[5] || w[6] != -w[7])
        return unexpected<error>(make_error(
            errc::shape_mismatch,
            "full-sequence dropping: every rank of the tp-cp group must give the same N, k and "
            "E, and all or none order keys (the group has N " +
                to_decimal(-w[1]) + " to " + to_decimal(w[0]) + ", k " + to_decimal(-w[3]) +
                " to " + to_decimal(w[2]) + ", E " + to_decimal(-w[5]) + " to " + to_decimal(w[4]) +
                (w[6] != -w[7] ? ", keys on some ranks only)" : ")")));
    }
  }
  if (!local) return unexpected<error>(local.error());
  const long long M = static_cast<long long>(G) * N;
  if (M * k >= (1LL << 31))
    return unexpected<error>(make_error(errc::overflow,
                                        "drop policy: the decision's pairs (tokens x topk) reach "
                                        "2^31"));
  const keep_views<R, S> v = carve_keep<R, S>(c, M, k, E, full);
  if (!c.fits())
    return unexpected<error>(make_error(
        errc::workspace_too_small,
        "drop policy: the workspace has " + to_decimal(workspace.size()) +
            " bytes; this forward needs " + to_decimal(c.required()) + " (workspace_bytes)"));

  // The routing the decision sees: this rank's, or the group's gathered (equal N on every rank:
  // a rank with another N fails the gather's count check).
  row_view<const int, S> ids = in.experts;
  const R* probs = in.probs.data();
  long long first = 0;
  const long long* order = nullptr;
  const long long* by_order = nullptr;
  if constexpr (Full) {
    first = static_cast<long long>(group->rank()) * N;
    if (auto st = group->all_gather(x, in.experts, v.ids); !st)
      return unexpected<error>(st.error());
    if (auto st = group->all_gather(x, in.probs, v.probs); !st)
      return unexpected<error>(st.error());
    ids = v.ids;
    probs = v.probs.data();
  }
  // Every selected expert in [0, E), none twice for a token: the histogram's fault word.
  if (auto st = x.template fill<int>(v.histogram, 0); !st) return unexpected<error>(st.error());
  if (auto st = x.template fill<int>(v.fault, kernels::order_fault_none); !st)
    return unexpected<error>(st.error());
  const long long pairs = M * k;
  if (pairs > 0)
    if (auto st = launch(x,
                         launch_grid{.blocks = capped_blocks<Exec>(pairs, 256),
                                     .smem_bytes = kernels::expert_histogram_kernel::smem_bytes(E)},
                         kernels::expert_histogram_kernel{.ids = ids.data(),
                                                          .n = pairs,
                                                          .num_experts = E,
                                                          .counts = v.histogram.data(),
                                                          .first_bad = v.fault.data(),
                                                          .topk = k});
        !st)
      return unexpected<error>(st.error());
  if (!out.faults.empty())
    if (auto st = launch(x, launch_grid{.blocks = 1},
                         kernels::sticky_fault_kernel{
                             .fault = v.fault.data(), .words = 1, .sticky = out.faults.data()});
        !st)
      return unexpected<error>(st.error());
  if constexpr (reads_faults_at_once<Exec>) {
    int f[2];
    if (auto st = read_words(x, row_view<const int, S>(v.fault), f); !st)
      return unexpected<error>(st.error());
    if (f[0] != kernels::order_fault_none)
      return unexpected<error>(make_error(
          errc::invalid_argument, "drop policy: routing pair " + to_decimal(f[0]) + " (token " +
                                      to_decimal(f[0] / k) + (full ? " of the tp-cp group" : "") +
                                      ") names an expert outside [0, " + to_decimal(E) +
                                      ") or one its token already named"));
  }
  if constexpr (Full)
    if (keys) {
      // The true order from the group's keys (a permutation of [0, M)).
      if (auto st = group->all_gather(x, in.order_keys, v.keys); !st)
        return unexpected<error>(st.error());
      if (auto st = x.template fill<int>(v.key_counts, 0); !st)
        return unexpected<error>(st.error());
      if (auto st = x.template fill<int>(v.key_fault, kernels::order_fault_none); !st)
        return unexpected<error>(st.error());
      // The caller's sticky words when it gave them, else the workspace's (dead after the call).
      if (out.faults.empty())
        if (auto st = x.template fill<int>(v.key_sticky, kernels::order_fault_none); !st)
          return unexpected<error>(st.error());
      const kernels::order_key_args a{
          .keys = v.keys.data(),
          .rows = M,
          .counts = v.key_counts.data(),
          .fault = v.key_fault.data(),
          .sticky = out.faults.empty() ? v.key_sticky.data() : out.faults.data() + 1,
          .order = v.order.data(),
          .by_order = v.by_order.data()};
      const launch_grid grid{
          .blocks = capped_blocks<Exec>(M, kernels::order_key_count_kernel::block_threads)};
      if (auto st = launch(x, grid, kernels::order_key_count_kernel{a}); !st)
        return unexpected<error>(st.error());
      if (auto st = launch(x, grid, kernels::order_key_check_kernel{a}); !st)
        return unexpected<error>(st.error());
      if (auto st = launch(x, grid, kernels::order_from_keys_kernel{a}); !st)
        return unexpected<error>(st.error());
      if constexpr (reads_faults_at_once<Exec>) {
        int f[2];
        if (auto st = read_words(x, row_view<const int, S>(v.key_fault), f); !st)
          return unexpected<error>(st.error());
        if (f[0] != kernels::order_fault_none || f[1] != kernels::order_fault_none)
          return unexpected<error>(make_error(
              errc::invalid_argument,
              "full-sequence dropping: the tp-cp group's order keys must be a permutation of [0, " +
                  to_decimal(M) + ") (sequence_order_keys' values): " +
                  (f[0] != kernels::order_fault_none
                       ? "the group's row " + to_decimal(f[0]) + " has a key outside it"
                       : "the key " + to_decimal(f[1]) + " is held by no row or by two")));
      }
      order = v.order.data();
      by_order = v.by_order.data();
    }

  drop_decision d;
  if (!rule.capacity_factor) {  // dropless: every pair kept and counted
    if (auto st = x.template fill<std::uint8_t>(out.keep, 1); !st)
      return unexpected<error>(st.error());
    if (auto st = x.copy(in.experts, out.kept); !st) return unexpected<error>(st.error());
    if (auto st = x.copy(row_view<const int, S>(v.histogram), out.routed); !st)
      return unexpected<error>(st.error());
    if (auto st = x.template fill<int>(out.dropped, 0); !st) return unexpected<error>(st.error());
    if (auto st = x.template fill<int>(out.padded, 0); !st) return unexpected<error>(st.error());
    if (auto st = x.template fill<long long>(out.totals, 0); !st)
      return unexpected<error>(st.error());
    if (!out.filler_map.empty())
      if (auto st = x.template fill<std::uint8_t>(out.filler_map, 0); !st)
        return unexpected<error>(st.error());
    return d;
  }
  auto cap = expert_capacity(pairs, E, *rule.capacity_factor);
  if (!cap) return unexpected<error>(cap.error());
  if (rule.pad && *cap > M)
    return unexpected<error>(
        make_error(errc::invalid_argument,
                   "pad_to_capacity: capacity " + to_decimal(*cap) + " exceeds the " +
                       to_decimal(M) + (full ? " tokens of the sequence group" : " tokens") +
                       ", so no expert can be padded to it (lower capacity_factor to at most "
                       "num_experts/topk)"));
  if (auto st =
          launch(x, launch_grid{.blocks = 1},
                 kernels::expert_offsets_kernel{
                     .counts = v.histogram.data(), .num_experts = E, .offsets = v.offsets.data()});
      !st)
    return unexpected<error>(st.error());
  const kernels::keep_args<R> a{
      .expert = ids.data(),
      .probs = probs,
      .order = order,
      .by_order = by_order,
      .offsets = v.offsets.data(),
      .scratch = v.lists.data(),
      .num_tokens = static_cast<int>(M),
      .topk = k,
      .num_experts = E,
      .capacity = *cap,
      .by = rule.by,
      .pad = rule.pad,
      .first = first,
      .count = N,
      .keep = full ? v.keep.data() : out.keep.data(),
      .routed = out.routed.data(),
      .dropped = out.dropped.data(),
      .padded = out.padded.data(),
      .filler_map = out.filler_map.empty() ? nullptr : out.filler_map.data()};
  const long long own = static_cast<long long>(N) * k;
  const kernels::expert_lists_kernel<R> lists{a};
  const kernels::keep_rank_kernel<R> rank{a};
  const kernels::drop_totals_kernel totals{.keep = a.keep,
                                           .dropped = a.dropped,
                                           .topk = k,
                                           .num_experts = E,
                                           .first = first,
                                           .count = N,
                                           .totals = out.totals.data()};
  const kernels::kept_record_kernel record{.expert = in.experts.data(),
                                           .keep = a.keep + first * k,
                                           .pairs = own,
                                           .kept = out.kept.data(),
                                           .routed = a.routed,
                                           .dropped = a.dropped,
                                           .padded = a.padded,
                                           .num_experts = E,
                                           .dispatched = v.dispatched.data()};
  // In order, each after the previous one's success.
  if (auto st =
          launch(x, launch_grid{.blocks = capped_blocks<Exec>(E, lists.block_threads)}, lists);
      !st)
    return unexpected<error>(st.error());
  if (pairs > 0)
    if (auto st =
            launch(x, launch_grid{.blocks = capped_blocks<Exec>(pairs, rank.block_threads)}, rank);
        !st)
      return unexpected<error>(st.error());
  if (auto st = launch(x, launch_grid{.blocks = 1, .smem_bytes = totals.smem_bytes}, totals); !st)
    return unexpected<error>(st.error());
  if (auto st = launch(x,
                       launch_grid{.blocks = capped_blocks<Exec>(std::max<long long>(own, E),
                                                                 record.block_threads)},
                       record);
      !st)
    return unexpected<error>(st.error());
  if (full && own > 0)  // this rank's slice of the group's keep mask
    if (auto st =
            x.copy(row_view<const std::uint8_t, S>(v.keep.data() + first * k, N, k), out.keep);
        !st)
      return unexpected<error>(st.error());
  d.capacity = *cap;
  if (rule.pad) d.pad_rows = *cap;
  return d;
}

}  // namespace detail

//! The kept pairs' probabilities in the type Q they travel in to the experts: probs where kept
//! (kept[p] != -1, the record a policy wrote), 0 for a dropped pair; [N, k] each, contiguous.
template <class Exec, class P, class Q>
[[nodiscard]] status write_kept_probs(Exec& x,
                                      row_view<const int, typename Exec::memory_space> kept,
                                      row_view<const P, typename Exec::memory_space> probs,
                                      row_view<Q, typename Exec::memory_space> out) {
  if (!kept.contiguous() || !probs.contiguous() || !out.contiguous() ||
      kept.rows() != probs.rows() || kept.rows() != out.rows() || kept.width() != probs.width() ||
      kept.width() != out.width())
    return make_error(errc::shape_mismatch,
                      "write_kept_probs: kept, probs and out must be contiguous [N, k] each");
  const long long pairs = kept.extent();
  if (pairs == 0) return {};
  const kernels::kept_probs_kernel<P, Q> k{
      .kept = kept.data(), .probs = probs.data(), .pairs = pairs, .out = out.data()};
  return launch(x, launch_grid{.blocks = capped_blocks<Exec>(pairs, k.block_threads)}, k);
}

}  // namespace v0_1
}  // namespace moefold
