//! @file communicator.hpp
//! @brief The communicator concept: what every backend (thread world, MPI, NCCL, device
//! loopback) offers the layers above it.
//!
//! A communicator is a value owned by the caller (no registry, no global "world"). Its collectives
//! take typed buffers and per-peer counts in elements, return a [[nodiscard]] moefold::status, and
//! are called by every rank of the communicator in the same order with consistent counts. Backends
//! check that rule at run time (a small header exchange before the data moves) and turn a
//! violation, a peer that fails, or a peer that never arrives into an error on every rank: never
//! a hang. Host backends complete the collective before returning; GPU backends enqueue on a
//! stream and never block the host (see their headers).
//!
//! The V-collectives' offsets and counts come from one place, comm/schedule.hpp, for all backends.
//!
//! Two forms of every collective:
//! - on row views (core/row_view.hpp) with an execution context (exec/exec.hpp): counts per peer
//!   in rows, the views' memory space the communicator's, the stream (if any) the context's.
//!   This is what the dispatcher and the layer call; `communicator_for<C, Exec, T>` states it.
//! - on spans with counts in elements (comm/span_collectives.hpp), for host code and tests; a span
//!   is a one-column row view in the communicator's memory space, run on its default context.
#pragma once

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <span>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../exec/exec.hpp"

namespace moefold {
inline namespace v0_1 {

//! The reductions of all_reduce and reduce_scatter_v.
enum class reduce_op { sum, max };

[[nodiscard]] constexpr const char* to_string(reduce_op op) noexcept {
  return op == reduce_op::sum ? "sum" : "max";
}

namespace detail {

//! The span forms that move elements of type T, with T deduced and with T explicit.
template <class C, class T>
concept span_transfers_of = requires(C& c, std::span<const T> s, std::span<T> r,
                                     std::span<const int> n) {
  { c.all_gather(s, r) } -> std::same_as<status>;
  { c.template all_gather<T>(s, r) } -> std::same_as<status>;
  { c.all_gather_v(s, r, n) } -> std::same_as<status>;
  { c.template all_gather_v<T>(s, r, n) } -> std::same_as<status>;
  { c.all_to_all_v(s, n, r, n) } -> std::same_as<status>;
  { c.template all_to_all_v<T>(s, n, r, n) } -> std::same_as<status>;
  { c.broadcast(r, 0) } -> std::same_as<status>;
  { c.template broadcast<T>(r, 0) } -> std::same_as<status>;
};

//! Every span form of T: the moves and the reductions, with T deduced and with T explicit.
template <class C, class T>
concept span_collectives_of = span_transfers_of<C, T> &&
    requires(C& c, std::span<const T> s, std::span<T> r, std::span<const int> n) {
  { c.all_reduce(r, reduce_op::sum) } -> std::same_as<status>;
  { c.template all_reduce<T>(r, reduce_op::sum) } -> std::same_as<status>;
  { c.reduce_scatter_v(s, n, r, reduce_op::sum) } -> std::same_as<status>;
  { c.template reduce_scatter_v<T>(s, n, r, reduce_op::sum) } -> std::same_as<status>;
};

}  // namespace detail

//! Host-buffer collectives. Counts are in elements, one per peer (size() of them).
//!
//! - all_reduce(buf, op): in place, every rank ends with the element-wise reduction.
//! - all_gather(s, r): r.size() >= size() * s.size(); rank i's s lands at r[i * s.size()].
//! - all_gather_v(s, r, n): rank i sends its first n[i] elements; they land in r at the exclusive
//!   prefix sum of n at i; n is the same on every rank.
//! - all_to_all_v(s, sn, r, rn): sn[j] elements (taken in peer order) go to rank j; rn[j]
//!   elements come from rank j (stored in peer order); my sn[j] must equal rank j's rn[me].
//! - reduce_scatter_v(s, n, r, op): s holds sum(n) elements; rank i receives in r the reduction
//!   over ranks of their n[i]-element chunk i. Sums run in rank order (deterministic); bf16/fp16
//!   accumulate in fp32. n is the same on every rank.
//! - broadcast(buf, root): root's buf is copied to every rank's buf.
//! - barrier(): returns when every rank has entered it.
//!
//! Buffers may be larger than the counts require; the rest is left untouched.
//!
//! The concept checks every call form the library makes, so that a communicator lacking one is
//! rejected here rather than inside a layer. Each collective is a member template over the
//! element type T, callable with T deduced from the spans, `c.all_gather(s, r)`, and with T
//! explicit, `c.template all_gather<T>(s, r)` (shared_expert, moe_layer::reduce_gradients and
//! all_reduce_each name it), with s a std::span<const T>, r a std::span<T>, counts a
//! std::span<const int>, returning moefold::status:
//! - T = int and std::int64_t (counts, headers, expert ids, sequence keys): all_gather,
//!   all_gather_v, all_to_all_v, broadcast (detail::span_transfers_of);
//! - T = float, double, moefold::bfloat16 and moefold::float16 (core/dtype.hpp; the values a
//!   layer of element type T moves and the statistics it sums): those, all_reduce and
//!   reduce_scatter_v (detail::span_collectives_of);
//! - and rank(), size() (int, on a const communicator) and barrier().
//! The backends take any transferable type (reducible for the reductions).
template <class C>
concept communicator = std::movable<C> && detail::span_transfers_of<C, int> &&
    detail::span_transfers_of<C, std::int64_t> && detail::span_collectives_of<C, float> &&
    detail::span_collectives_of<C, double> && detail::span_collectives_of<C, bfloat16> &&
    detail::span_collectives_of<C, float16> && requires(C& c, const C& cc) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { c.barrier() } -> std::same_as<status>;
};

//! A communicator that states where its buffers live: `C::memory_space` is host_space (thread
//! world, MPI), device_space (NCCL, the device loopback, MPI with device buffers) or
//! cpu_device_space (the thread world over the CPU executor's memory).
template <class C>
concept has_memory_space = memory_space<typename C::memory_space>;

//! C runs its collectives on row views of T in the memory space of execution context Exec, with
//! the context passed in every call. Rules of the row-view form (every backend):
//! - views are contiguous (stride == width); send and receive views have the same width, and
//!   every rank uses the same width (a different width shows as a count mismatch);
//! - counts are rows per peer (int); a row count or a total of 2^31 rows or more is
//!   errc::overflow, as is a count beyond a backend's own limit; element and byte offsets are
//!   64-bit;
//! - all_to_all_v(x, s, sn, r, rn), all_gather_v(x, s, r, n), all_gather(x, s, r) (every rank
//!   sends s.rows() rows), reduce_scatter_v(x, s, n, r, op), all_reduce(x, buf, op) (in place,
//!   every element), broadcast(x, buf, root), barrier(x): as the span forms above, in rows.
//!
//! The constraint of every dispatcher and layer: a communicator of another memory space than the
//! context (NCCL with host_exec, the host thread world with cpu_exec) is rejected here, naming
//! both types.
//! The row forms the library calls are the dispatchers': of their T (tokens, probabilities and
//! their gradients) and of int (counts, expert ids); they require both (the layer its T).
template <class C, class Exec, class T = float>
concept communicator_for = copy_context<Exec> && has_memory_space<C> &&
    std::same_as<typename C::memory_space, typename Exec::memory_space> &&
    requires(C& c, const C& cc, Exec& x, row_view<const T, typename Exec::memory_space> s,
             row_view<T, typename Exec::memory_space> r, std::span<const int> n) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { c.all_to_all_v(x, s, n, r, n) } -> std::same_as<status>;
  { c.all_gather_v(x, s, r, n) } -> std::same_as<status>;
  { c.all_gather(x, s, r) } -> std::same_as<status>;
  { c.reduce_scatter_v(x, s, n, r, reduce_op::sum) } -> std::same_as<status>;
  { c.all_reduce(x, r, reduce_op::sum) } -> std::same_as<status>;
  { c.broadcast(x, r, 0) } -> std::same_as<status>;
  { c.barrier(x) } -> std::same_as<status>;
};

//! A communicator that derives sub-communicators: split(color, key) is collective over this
//! communicator; ranks with the same color form a new communicator ordered by (key, old rank).
//! A rank passing split_no_color takes part but joins none (it gets an error value back).
template <class C>
concept splittable_communicator = communicator<C> && requires(C& c) {
  { c.split(0, 0) } -> std::same_as<expected<C>>;
};

//! The color of a rank that takes part in a split but joins no new communicator.
inline constexpr int split_no_color = -1;

//! all_reduce of each buffer in turn (a parameter list: the experts' fc1 and fc2 gradients, ...);
//! stops at the first error. Every rank must pass the same list.
template <class T, communicator C>
[[nodiscard]] status all_reduce_each(C& c, std::initializer_list<std::span<T>> buffers,
                                     reduce_op op) {
  for (std::span<T> b : buffers)
    if (auto st = c.template all_reduce<T>(b, op); !st) return st;
  return {};
}

//! The same over row views on an execution context (communicator_for Exec and T).
template <class T, class C, class Exec>
[[nodiscard]] status all_reduce_each(
    C& c, Exec& x, std::initializer_list<row_view<T, typename Exec::memory_space>> buffers,
    reduce_op op) {
  for (const auto& b : buffers)
    if (auto st = c.all_reduce(x, b, op); !st) return st;
  return {};
}

}  // namespace v0_1
}  // namespace moefold
