//! @file dispatcher_common.hpp
//! @brief What both token dispatchers share around their own four steps: views of workspace
//! spans in the dispatcher's memory space, the shape checks of the view forms, and the packed rows
//! in which probabilities travel with their token rows.
//!
//! A dispatcher D derives from dispatcher_common<D, T, Comm, Exec, P> and implements the one API,
//! views on a context: dispatch(x, dispatch_input, g, dispatch_workspace), combine(x, ...),
//! combine_backward(x, ...), dispatch_backward(x, ...), shape() and workspace_sizes(capacity).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "dispatch_args.hpp"
#include "dispatch_handle.hpp"
#include "splits.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {

//! Packed rows are a multiple of this many bytes: each starts 16-byte aligned in a 16-byte-aligned
//! buffer (the workspace's sub-buffers are 256-byte aligned), as 16-byte loads and stores want.
inline constexpr std::int64_t packed_row_alignment = 16;

//! Elements of a packed row holding `cols` values of T (H token elements, then the
//! probabilities), padded up to a multiple of 16 bytes: round_up(cols * sizeof(T), 16) /
//! sizeof(T).
template <class T>
[[nodiscard]] constexpr std::int64_t packed_width(std::int64_t cols) noexcept {
  static_assert(packed_row_alignment % static_cast<std::int64_t>(sizeof(T)) == 0,
                "packed rows: sizeof(T) must divide 16");
  constexpr auto e = static_cast<std::int64_t>(sizeof(T));
  return (cols * e + packed_row_alignment - 1) / packed_row_alignment * packed_row_alignment / e;
}

//! Where the probabilities sit in a packed row of T elements. A probability of type P takes
//! sizeof(P) / sizeof(T) columns (fp32 probabilities in bf16 rows: two), starting at the first
//! column at or after the token row (H) whose byte offset is a multiple of sizeof(P), so the
//! columns read as P values in place (the collectives move the row's bytes, whatever they hold).
template <class T, class P>
struct packed_layout {
  static_assert(sizeof(P) >= sizeof(T) && sizeof(P) % sizeof(T) == 0,
                "packed rows: the probability type P must be T or wider by a whole number of "
                "T's (fp32 probabilities with bf16 tokens, fp64 with fp32)");
  static_assert(packed_row_alignment % static_cast<std::int64_t>(sizeof(P)) == 0,
                "packed rows: sizeof(P) must divide 16");
  //! Columns of T one probability takes.
  static constexpr std::int64_t prob_cols = static_cast<std::int64_t>(sizeof(P) / sizeof(T));
  //! The first probability column of a row whose token part is `hidden` columns wide.
  [[nodiscard]] static constexpr std::int64_t probs_first(std::int64_t hidden) noexcept {
    return (hidden + prob_cols - 1) / prob_cols * prob_cols;
  }
  //! Elements of a packed row holding `hidden` token columns and `probs` probabilities.
  [[nodiscard]] static constexpr std::int64_t width(std::int64_t hidden,
                                                    std::int64_t probs) noexcept {
    return packed_width<T>(probs_first(hidden) + probs * prob_cols);
  }
};

//! A packed width must be a valid row width (below 2^31 elements).
[[nodiscard]] inline status check_packed_width(std::int64_t width, const char* what) {
  if (width > max_rows)
    return make_error(errc::overflow, std::string("dispatcher: a packed row (") + what + ") of " +
                                          to_decimal(width) + " elements reaches 2^31");
  return {};
}

//! The error of the fault slots the plan kernels left in a pad-mode plan's status row (INT_MAX:
//! none), for a dispatcher's device_status(): the lowest slot naming a bad id or an expert its
//! token named before, else the lowest beyond its expert's capacity.
[[nodiscard]] inline status pad_record_fault(int bad_slot, int over_slot, int topk, int experts,
                                             int capacity) {
  constexpr int none = 2147483647;
  const int k = topk > 0 ? topk : 1;
  if (bad_slot != none)
    return make_error(errc::invalid_argument,
                      "dispatch: token " + to_decimal(bad_slot / k) + " slot " +
                          to_decimal(bad_slot % k) + " of the routing record names an expert " +
                          "outside [-1, " + to_decimal(experts) +
                          ") or one its token named before (no rows were planned for the record)");
  if (over_slot != none)
    return make_error(errc::invalid_argument,
                      "dispatch: token " + to_decimal(over_slot / k) + " slot " +
                          to_decimal(over_slot % k) + " of the routing record is beyond its " +
                          "expert's capacity " + to_decimal(capacity) +
                          " (drop before padding; no rows were planned for it)");
  return {};
}

//! The error of a dispatch that took dispatch_input::every_pair_routed on trust, read from its
//! plan's status row [E + 2] (host): the fault slot (a bad id or a repeat: no rows were planned
//! for the record), then the routed pairs against N k (a slot holding -1: its pair got no row).
[[nodiscard]] inline status routed_record_fault(std::span<const int> row, int experts, int topk,
                                                long long num_tokens) {
  if (auto st = pad_record_fault(row[uz(experts)], 2147483647, topk, experts, 0); !st) return st;
  // The counts [E] add up to at most N k (the plan kernels counted the record): an int sum.
  const long long routed = dispatch::split_total(row.first(uz(experts)));
  const long long pairs = num_tokens * topk;
  if (routed != pairs)
    return make_error(errc::invalid_argument,
                      "dispatch: the input vouched that every pair is routed "
                      "(every_pair_routed), but the record routes " +
                          to_decimal(routed) + " of its N k = " + to_decimal(pairs) +
                          " pairs (a slot holds -1); the pairs it names got their rows, the "
                          "others none");
  return {};
}

}  // namespace detail

template <class D, class T, class Comm, class Exec, class P = T>
class dispatcher_common {
 public:
  using handle_type = dispatch_handle<D>;
  using space = typename Exec::memory_space;
  using view = row_view<T, space>;
  using const_view = row_view<const T, space>;
  using prob_view = row_view<P, space>;
  using const_prob_view = row_view<const P, space>;
  //! Probabilities travel in the rows of their tokens (one collective instead of two) wherever
  //! the collective only copies. A reduction of packed rows sums every column as T, so it is
  //! packed only when the probabilities are T values and T is at least 32 bits wide (fp32, fp64:
  //! then it is the same sum as a separate reduction in T). Otherwise the probability gradients
  //! keep their own reduction in P: for 16-bit P the host communicators accumulate it in fp32
  //! (accumulator_t), so it is never summed in 16 bits, and a wider P (fp32 with bf16 tokens) is
  //! summed as P. Both paths are compiled for every T; this selects one at run time.
  static constexpr bool pack_reductions = sizeof(T) >= 4 && std::same_as<T, P>;

 protected:
  //! Elements from one row of the experts' batch to the next: H padded to 16 bytes in a
  //! context's memory (the row kernels' 16-byte path; experts there take strided rows), H where
  //! the host reads the batch as one span (expert_batch).
  static constexpr int batch_stride(int hidden) noexcept {
    if (host_accessible_v<space>) return hidden;
    return static_cast<int>(detail::packed_width<T>(hidden));
  }
  //! The first m rows of a batch buffer (m x batch_stride(H) elements) as [m, H].
  static row_view<T, space> batch_rows_of(std::span<T> buf, int m, int hidden) noexcept {
    return row_view<T, space>(buf.data(), m, hidden, batch_stride(hidden));
  }
  //! The forward permutation: each plan row r takes the token row and the probability of slot
  //! row_slots[r].                    x [N, H], probs [N, k] -> rows [M, H], probs_out [M, 1]
  static status permute_by_slot(Exec& x, const dispatch_input<T, space, P>& in,
                                row_view<const int, space> row_slots, int topk,
                                row_view<T, space> rows, row_view<P, space> probs_out) {
    if (auto st = x.template gather_rows<T>(in.x, row_slots, topk, rows); !st) return st;
    const row_view<const P, space> by_slot(in.probs.data(), in.num_tokens * topk, 1);  // [N*k, 1]
    return x.template gather_rows<P>(by_slot, row_slots, 1, probs_out);
  }
  //! device_status() of a dispatch that took every_pair_routed on trust: the plan's status row
  //! [1, E + 2] to the host (one copy, a wait), then detail::routed_record_fault.
  static status routed_record_status(Exec& x, row_view<const int, space> status_row, int experts,
                                     int topk, int num_tokens) {
    std::vector<int> row(detail::uz(experts) + 2);
    if (auto st = x.copy(status_row, row_view<int>(row.data(), 1, experts + 2)); !st) return st;
    return detail::routed_record_fault(row, experts, topk, num_tokens);
  }
  //! [v.size() / width, width] in the dispatcher's memory space.
  template <class U>
  static row_view<U, typename Exec::memory_space> rows_of(std::span<U> v, int width) noexcept {
    return row_view<U, typename Exec::memory_space>(
        v.data(), width > 0 ? static_cast<int>(v.size() / detail::uz(width)) : 0, width);
  }
  //! Columns [first, first + width) of packed rows [packed.size() / stride, stride]: the token
  //! part ([rows, H]) or the probabilities ([rows, 1] or [rows, k]) as a strided view.
  template <class U>
  static row_view<U, typename Exec::memory_space> columns_of(std::span<U> packed, int stride,
                                                             int first, int width) noexcept {
    const int rows = stride > 0 ? static_cast<int>(packed.size() / detail::uz(stride)) : 0;
    return row_view<U, typename Exec::memory_space>(
        rows > 0 ? packed.data() + first : packed.data(), rows, width, stride);
  }
  //! Columns of T a probability takes in a packed row (detail::packed_layout).
  static constexpr int prob_cols = static_cast<int>(detail::packed_layout<T, P>::prob_cols);
  //! Probabilities [first, first + count) of packed rows [packed.size() / stride, stride] as a
  //! strided view of P: `first` is a probability column (detail::packed_layout::probs_first), so
  //! the values are P-aligned.
  template <class U>
  static auto probs_of(std::span<U> packed, int stride, int first, int count) noexcept {
    using Q = std::conditional_t<std::is_const_v<U>, const P, P>;
    const int rows = stride > 0 ? static_cast<int>(packed.size() / detail::uz(stride)) : 0;
    U* const base = rows > 0 ? packed.data() + first : packed.data();
    // The packed buffer is raw storage carved for T rows; these columns hold P values written
    // and read only as P (what the collectives do in between is byte copies).
    return row_view<Q, typename Exec::memory_space>(reinterpret_cast<Q*>(base), rows, count,
                                                    stride / prob_cols);
  }
  //! A buffer of T elements as m rows of `width` T's followed by m P values (P-aligned): the
  //! plain layouts of the separate reductions, inside a packed buffer (W >= probs_first(H) +
  //! prob_cols columns per row leaves room for both).
  static std::pair<std::span<T>, std::span<P>> rows_then_probs(std::span<T> buf, int m,
                                                               int width) noexcept {
    const auto mz = detail::uz(m), first = mz * detail::uz(width);
    const auto probs_at = (first + detail::uz(prob_cols) - 1) / detail::uz(prob_cols) *
                          detail::uz(prob_cols);  // in T's, a multiple of sizeof(P) bytes
    return {buf.first(first), std::span<P>(reinterpret_cast<P*>(buf.data() + probs_at), mz)};
  }
  //! Zeros in columns [from, to) of packed rows (the gap before the probabilities and the
  //! padding), so that no uninitialised byte travels in a collective.
  static status zero_columns(Exec& x, std::span<T> packed, int stride, int from, int to) {
    if (from >= to) return {};
    return x.template fill<T>(columns_of(packed, stride, from, to - from), T(0));
  }

  //! The shape checks of the view forms: rows x width as expected (message names the call).
  static status check_rows(const char* what, const auto& v, long long rows, int width) {
    if (v.rows() != rows || (rows > 0 && v.width() != width))
      return make_error(errc::shape_mismatch,
                        std::string(what) + " is [" + detail::to_decimal(v.rows()) + ", " +
                            detail::to_decimal(v.width()) + "], expected [" +
                            detail::to_decimal(rows) + ", " + detail::to_decimal(width) + "]");
    return {};
  }

  //! The buffers of dispatch_backward: dx_rows [M, H], dprob_rows [M, 1], dx [N, H] and
  //! dprobs [N, k], the last two contiguous (both paths write them as flat rows).
  status check_backward_shapes(const handle_type& h, const_view dx_rows, const_prob_view dprob_rows,
                               view dx, prob_view dprobs) const {
    if (auto st = check_rows("dispatch_backward: dx_rows", dx_rows, h.num_rows(), hidden()); !st)
      return st;
    if (auto st = check_rows("dispatch_backward: dprob_rows", dprob_rows, h.num_rows(), 1); !st)
      return st;
    if (auto st = check_rows("dispatch_backward: dx", dx, h.num_tokens(), hidden()); !st) return st;
    if (auto st = check_rows("dispatch_backward: dprobs", dprobs, h.num_tokens(), topk()); !st)
      return st;
    if (!dx.contiguous() || !dprobs.contiguous())
      return make_error(errc::shape_mismatch,
                        "dispatch_backward: dx and dprobs must be contiguous");
    return {};
  }

 private:
  int hidden() const noexcept { return self().shape().hidden; }
  int topk() const noexcept { return self().shape().topk; }
  D& self() noexcept { return static_cast<D&>(*this); }
  const D& self() const noexcept { return static_cast<const D&>(*this); }
};

}  // namespace v0_1
}  // namespace moefold
