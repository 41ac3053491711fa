//! @file span_collectives.hpp
//! @brief The span form of the V-collectives and all_gather, written once for every backend: a
//! span is a one-column row view (counts in elements = rows of width 1) in the backend's memory
//! space, run on the backend's default execution context. A backend derives from
//! span_collectives<Backend, its memory space>, provides the row-view forms and `default_exec()`,
//! and brings these in with using-declarations (its own row-view overloads would hide them
//! otherwise).
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "communicator.hpp"
#include "schedule.hpp"

namespace moefold {
inline namespace v0_1 {

template <class Backend, memory_space Space>
class span_collectives {
 public:
  template <transferable T>
  [[nodiscard]] status all_gather(std::span<const std::type_identity_t<T>> send,
                                  std::span<T> recv) {
    auto x = self().default_exec();
    return self().all_gather(x, column(send), column(recv));
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<T> recv, std::span<const int> counts) {
    auto x = self().default_exec();
    return self().all_gather_v(x, column(send), column(recv), counts);
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<const int> send_counts, std::span<T> recv,
                                    std::span<const int> recv_counts) {
    auto x = self().default_exec();
    return self().all_to_all_v(x, column(send), send_counts, column(recv), recv_counts);
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(std::span<const std::type_identity_t<T>> send,
                                        std::span<const int> counts, std::span<T> recv,
                                        reduce_op op) {
    auto x = self().default_exec();
    return self().reduce_scatter_v(x, column(send), counts, column(recv), op);
  }

 protected:
  // A span as [n, 1] in the backend's space. Views hold fewer than 2^31 rows: a longer span is
  // cut there, and counts that need more are errc::overflow in the schedule (reported by every
  // rank, so no peer waits).
  template <class T>
  static row_view<T, Space> column(std::span<T> s) noexcept {
    const std::size_t n = s.size() > static_cast<std::size_t>(max_rows)
                              ? static_cast<std::size_t>(max_rows)
                              : s.size();
    return row_view<T, Space>(s.data(), static_cast<int>(n), 1);
  }

 private:
  Backend& self() noexcept { return static_cast<Backend&>(*this); }
};

namespace detail {

//! The checks every backend's row-view form makes before building a schedule: contiguous views
//! of one width. An error here is posted as the rank's rejected arguments (peers fail at once).
template <class U, class T, class S>
[[nodiscard]] status check_row_views(const char* op, const row_view<U, S>& send,
                                     const row_view<T, S>& recv) {
  if (!send.contiguous() || !recv.contiguous())
    return make_error(
        errc::invalid_argument,
        std::string(op) + ": collectives take contiguous row views (stride == width)");
  if (send.width() != recv.width() && !send.empty() && !recv.empty())
    return make_error(errc::shape_mismatch,
                      std::string(op) + ": send rows of " + to_decimal(send.width()) +
                          " elements, receive rows of " + to_decimal(recv.width()));
  return {};
}

//! The width both views agree on (the non-empty one's).
template <class U, class T, class S>
[[nodiscard]] int row_width(const row_view<U, S>& send, const row_view<T, S>& recv) noexcept {
  return send.width() > recv.width() ? send.width() : recv.width();
}

//! The schedule of a row-view collective, `build(width)`, or the rank's rejected arguments (which
//! the backend posts, so its peers fail at once).
template <class U, class T, class S, class Build>
[[nodiscard]] expected<collective_schedule> rows_schedule(const char* op,
                                                          const row_view<U, S>& send,
                                                          const row_view<T, S>& recv,
                                                          Build&& build) {
  if (auto ok = check_row_views(op, send, recv); !ok) return unexpected<error>(ok.error());
  return build(row_width(send, recv));
}

//! A contiguous view as the span of its elements (empty when strided), for the backends'
//! element-wise forms (all_reduce, broadcast) and engines that take a pointer and a count.
template <class T, class S>
[[nodiscard]] std::span<T> flat(const row_view<T, S>& v) noexcept {
  return {v.data(), static_cast<std::size_t>(v.contiguous() ? v.extent() : 0)};
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
