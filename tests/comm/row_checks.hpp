// The row-view collectives (counts in rows of `width` elements) against the element references of
// collective_reference.hpp: rows of width W with row counts C are the elements of counts C * W.
// Written once for any communicator and execution context: host views (thread world, MPI) and
// device views of the CPU executor (thread world over cpu_exec), whose inputs go in and results
// come out through the context's copies only. Returns "" or what failed (ranks run on threads,
// where doctest's assertions are not safe).
#pragma once

#include <moefold/core/row_view.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/host_exec.hpp>

#include <random>
#include <string>
#include <vector>

#include "collective_reference.hpp"

namespace moefold::test {

inline std::vector<int> times(std::vector<int> v, int w) {
  for (auto& x : v) x *= w;
  return v;
}

// A buffer of `rows` x `width` in the context's space, holding `host` (or poisoned/zeros).
template <class T, class Exec>
struct staged_rows {
  exec_buffer<T, Exec> dev;
  row_view<T, typename Exec::memory_space> v;
  staged_rows(Exec& x, const std::vector<T>& host, int rows, int width) {
    auto b = exec_buffer<T, Exec>::make(x, rows, width);
    if (b) dev = std::move(*b);
    v = dev.view();
    if (!host.empty()) static_cast<void>(x.copy(row_view<const T>(host.data(), rows, width), v));
  }
};

template <class T, class Exec>
std::vector<T> to_host(Exec& x, row_view<T, typename Exec::memory_space> v) {
  std::vector<T> h(static_cast<std::size_t>(v.rows()) * static_cast<std::size_t>(v.width()));
  if (auto st = x.copy(row_view<const T, typename Exec::memory_space>(v),
                       row_view<T>(h.data(), v.rows(), v.width()));
      !st)
    h.clear();
  return h;
}

inline int sum(const std::vector<int>& v) {
  int s = 0;
  for (int x : v) s += x;
  return s;
}

template <class T, class Comm, class Exec>
std::string check_row_collectives(Comm& c, Exec& x, int width, unsigned seed) {
  const int me = c.rank(), n = c.size(), W = width;
  std::mt19937 g(seed * 977u + static_cast<unsigned>(n));  // the same on every rank
  std::string why;
  auto expect = [&](bool ok, const char* what) {
    if (!ok && why.empty()) why = what;
  };
  {  // all_to_all_v
    const auto C = random_matrix(g, n, 5);
    std::vector<std::vector<int>> CE = C;
    for (auto& r : CE) r = times(r, W);
    const auto sr = row(C, me), rr = column(C, me);
    staged_rows<T, Exec> send(x, a2a_send<T>(CE, me), sum(sr), W), recv(x, {}, sum(rr), W);
    auto st =
        c.all_to_all_v(x, row_view<const T, typename Exec::memory_space>(send.v), sr, recv.v, rr);
    expect(st.has_value(), "all_to_all_v failed");
    expect(same_bits(to_host(x, recv.v), a2a_want<T>(CE, me)), "all_to_all_v rows differ");
  }
  {  // all_gather_v
    const auto counts = random_counts(g, n, 4);
    const auto ce = times(counts, W);
    staged_rows<T, Exec> send(x, agv_send<T>(ce, me), counts[static_cast<std::size_t>(me)], W),
        recv(x, {}, sum(counts), W);
    auto st =
        c.all_gather_v(x, row_view<const T, typename Exec::memory_space>(send.v), recv.v, counts);
    expect(st.has_value(), "all_gather_v failed");
    expect(same_bits(to_host(x, recv.v), agv_want<T>(ce)), "all_gather_v rows differ");
  }
  {  // all_gather: two rows from every rank
    std::vector<T> mine;
    for (int k = 0; k < 2 * W; ++k) mine.push_back(value_of<T>(me, 1, k));
    staged_rows<T, Exec> send(x, mine, 2, W), recv(x, {}, 2 * n, W);
    auto st = c.all_gather(x, row_view<const T, typename Exec::memory_space>(send.v), recv.v);
    expect(st.has_value(), "all_gather failed");
    std::vector<T> want;
    for (int i = 0; i < n; ++i)
      for (int k = 0; k < 2 * W; ++k) want.push_back(value_of<T>(i, 1, k));
    expect(same_bits(to_host(x, recv.v), want), "all_gather rows differ");
  }
  for (bool max : {false, true}) {  // reduce_scatter_v
    const auto counts = random_counts(g, n, 4);
    const auto ce = times(counts, W);
    staged_rows<T, Exec> send(x, rsv_send<T>(ce, me), sum(counts), W),
        recv(x, {}, counts[static_cast<std::size_t>(me)], W);
    auto st = c.reduce_scatter_v(x, row_view<const T, typename Exec::memory_space>(send.v), counts,
                                 recv.v, max ? reduce_op::max : reduce_op::sum);
    expect(st.has_value(), "reduce_scatter_v failed");
    expect(same_bits(to_host(x, recv.v), rsv_want<T>(ce, me, max)), "reduce_scatter_v differs");
  }
  {  // all_reduce (every element of the view) and broadcast
    std::vector<int> c0(static_cast<std::size_t>(n), 0);
    c0[0] = 3 * W;
    staged_rows<T, Exec> buf(x, rsv_send<T>(c0, me), 3, W);
    expect(c.all_reduce(x, buf.v, reduce_op::sum).has_value(), "all_reduce failed");
    expect(same_bits(to_host(x, buf.v), rsv_want<T>(c0, 0, false)), "all_reduce differs");
    std::vector<T> mine;
    for (int k = 0; k < W; ++k) mine.push_back(value_of<T>(me, 4, k));
    staged_rows<T, Exec> b(x, mine, 1, W);
    const int root = n - 1;
    expect(c.broadcast(x, b.v, root).has_value(), "broadcast failed");
    std::vector<T> want;
    for (int k = 0; k < W; ++k) want.push_back(value_of<T>(root, 4, k));
    expect(same_bits(to_host(x, b.v), want), "broadcast differs");
    expect(c.barrier(x).has_value(), "barrier failed");
  }
  return why;
}

}  // namespace moefold::test
