//! @file host_memory_ops.hpp
//! @brief The row operations of the execution contexts whose memory is host memory (host_exec,
//! and cpu_exec until it runs the kernel bodies of kernels/): index gathers, a weighted gather-sum
//! in a fixed order, chunk copies, expert relabelling, elementwise add, scale and fill. The
//! dispatcher and the layer move rows only through these members of their context, so that one
//! dispatcher file serves host and GPU (cuda_exec implements the same members with kernels).
//!
//! Index arrays are row views of int in the context's space; -1 marks "no source" (a padding row,
//! a dropped pair) and produces zero. Every operation checks shapes and index ranges and returns
//! errc::shape_mismatch or errc::invalid_argument naming the operation; nothing is written then.
#pragma once

#include <string>
#include <type_traits>

// The pad-mode chunk table's entries (one formula for the host loop and the kernel).
#include <moefold/kernels/chunk_table.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "exec.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

[[nodiscard]] inline status op_shape_error(const char* ctx, const char* op, const char* what) {
  return make_error(errc::shape_mismatch, std::string(ctx) + "::" + op + ": " + what);
}

//! Every index in [-1, bound): otherwise an error naming the first bad one.
template <class S>
[[nodiscard]] status check_indices(row_view<const int, S> index, long long bound, const char* ctx,
                                   const char* op) {
  for (int r = 0; r < index.rows(); ++r) {
    const int* p = index.row_data(r);
    for (int c = 0; c < index.width(); ++c)
      if (p[c] < -1 || p[c] >= bound)
        return make_error(errc::invalid_argument, std::string(ctx) + "::" + op + ": index " +
                                                      to_decimal(p[c]) + " at (" + to_decimal(r) +
                                                      ", " + to_decimal(c) + ") outside [-1, " +
                                                      to_decimal(bound) + ")");
  }
  return {};
}

//! The shape rules of the row operations, one place for every context (host loops here, kernel
//! launches in exec/simt_memory_ops.hpp), each returning the error that names its operation.
template <class A, class B>
[[nodiscard]] status check_gather_rows(const char* ctx, const A& src, const B& index, int divisor,
                                       const A& dst) {
  if (index.width() != 1 || index.rows() != dst.rows() || src.width() != dst.width() || divisor < 1)
    return op_shape_error(ctx, "gather_rows",
                          "need index [M, 1], src [R, w], dst [M, w] and divisor >= 1");
  return {};
}
template <class A, class B, class W>
[[nodiscard]] status check_gather_sum_rows(const char* ctx, const A& src, const B& index,
                                           const W& weights, const A& dst) {
  const bool weighted = weights.rows() > 0;
  if (index.rows() != dst.rows() || src.width() != dst.width() ||
      (weighted && (weights.rows() != index.rows() || weights.width() != index.width())))
    return op_shape_error(ctx, "gather_sum_rows",
                          "need src [M, w], index [N, k], weights [N, k] or empty, dst [N, w]");
  return {};
}
//! The chunk table: one column each, one row per chunk; with `read_table` (the table is in
//! host-addressable memory) also sizes >= 0 tiling src and dst and every chunk inside both.
template <class A, class B>
[[nodiscard]] status check_copy_chunks(const char* ctx, const A& src, const B& sizes, const B& from,
                                       const B& to, const A& dst, bool read_table) {
  bool ok = sizes.width() == 1 && from.width() == 1 && to.width() == 1 &&
            from.rows() == sizes.rows() && to.rows() == sizes.rows() &&
            src.width() == dst.width() && src.rows() == dst.rows();
  if (read_table) {
    long long rows = 0;
    for (int c = 0; ok && c < sizes.rows(); ++c) {
      const int n = *sizes.row_data(c), f = *from.row_data(c), t = *to.row_data(c);
      ok = n >= 0 && f >= 0 && t >= 0 && static_cast<long long>(f) + n <= src.rows() &&
           static_cast<long long>(t) + n <= dst.rows();
      rows += n;
    }
    ok = ok && rows == dst.rows();
  }
  if (!ok)
    return op_shape_error(ctx, "copy_chunks",
                          "chunk sizes >= 0 must tile src and dst [sum(sizes), w], with one "
                          "source and one destination offset per chunk inside them");
  return {};
}
template <class A, class B>
[[nodiscard]] status check_relabel(const char* ctx, const A& ids, int count, const B& dst) {
  if (ids.rows() != dst.rows() || ids.width() != dst.width() || count < 0)
    return op_shape_error(ctx, "relabel", "ids and dst must have one shape, count >= 0");
  return {};
}
//! add, add_converted, convert: src and dst of one shape.
template <class A, class B>
[[nodiscard]] status check_same_shape(const char* ctx, const char* op, const A& src, const B& dst) {
  if (src.rows() != dst.rows() || src.width() != dst.width())
    return op_shape_error(ctx, op, "src and dst must have one shape");
  return {};
}

//! uniform_chunk_table: a table [3, chunks] for a fold of rows >= 0.
template <class B>
[[nodiscard]] status check_uniform_chunk_table(const char* ctx, const B& table,
                                               const kernels::uniform_chunks& u) {
  if (u.etp < 1 || u.ep < 1 || u.local_experts < 1 || u.rows < 0)
    return op_shape_error(ctx, "uniform_chunk_table",
                          "need etp, ep, local_experts >= 1 and rows >= 0");
  if (table.rows() != 3 || static_cast<long long>(table.width()) !=
                               static_cast<long long>(u.etp) * u.ep * u.local_experts)
    return op_shape_error(ctx, "uniform_chunk_table",
                          "the table must be [3, etp * ep * local_experts]");
  return {};
}

//! The row operations over memory space S, for a context Derived whose memory host code can
//! address (S is host memory or the CPU executor's host-backed device memory).
template <class Derived, class S>
struct host_memory_ops {
  //! The host can address this context's memory (its bookkeeping builders run as host code).
  static constexpr bool host_addressable_memory = true;

  //! dst[r] = src[index[r] / divisor] (0 where index[r] == -1).
  //! src [R, w], index [M, 1], dst [M, w]; divisor >= 1 (k turns a slot into its token).
  template <class T>
  [[nodiscard]] status gather_rows(std::type_identity_t<row_view<const T, S>> src,
                                   row_view<const int, S> index, int divisor,
                                   row_view<T, S> dst) const {
    if (auto st = check_gather_rows(Derived::name, row_view<const T, S>(src), index, divisor,
                                    row_view<const T, S>(dst));
        !st)
      return st;
    if (auto st = check_indices(index, static_cast<long long>(src.rows()) * divisor, Derived::name,
                                "gather_rows");
        !st)
      return st;
    for (int r = 0; r < dst.rows(); ++r) {
      const int i = *index.row_data(r);
      T* d = dst.row_data(r);
      if (i < 0) {
        for (int c = 0; c < dst.width(); ++c) d[c] = T(0);
        continue;
      }
      const T* s = src.row_data(i / divisor);
      for (int c = 0; c < dst.width(); ++c) d[c] = s[c];
    }
    return {};
  }

  //! dst[t] = sum over j = 0..k-1, in this order, of weight[t, j] * src[index[t, j]] (weight 1
  //! when `weights` is empty; index -1 contributes nothing; a row with no source is 0), summed in
  //! Acc. A gather per output row: no atomics, the same sum every run.
  //! src [M, w], index [N, k], weights [N, k] or empty, dst [N, w]
  template <class T, class P = T, class Acc = T>
  [[nodiscard]] status gather_sum_rows(std::type_identity_t<row_view<const T, S>> src,
                                       row_view<const int, S> index,
                                       std::type_identity_t<row_view<const P, S>> weights,
                                       row_view<T, S> dst) const {
    const bool weighted = weights.rows() > 0;
    if (auto st = check_gather_sum_rows(Derived::name, row_view<const T, S>(src), index, weights,
                                        row_view<const T, S>(dst));
        !st)
      return st;
    if (auto st = check_indices(index, src.rows(), Derived::name, "gather_sum_rows"); !st)
      return st;
    for (int t = 0; t < dst.rows(); ++t) {
      const int* idx = index.row_data(t);
      const P* wt = weighted ? weights.row_data(t) : nullptr;
      T* d = dst.row_data(t);
      for (int c = 0; c < dst.width(); ++c) {
        Acc acc = Acc(0);
        for (int j = 0; j < index.width(); ++j) {
          if (idx[j] < 0) continue;
          const Acc v = static_cast<Acc>(src.row_data(idx[j])[c]);
          acc += weighted ? static_cast<Acc>(wt[j]) * v : v;
        }
        d[c] = static_cast<T>(acc);
      }
    }
    return {};
  }

  //! dst rows [to[c], to[c] + sizes[c]) = src rows [from[c], from[c] + sizes[c]) for every chunk
  //! c: one chunk copy does a chunk sort or, with from and to swapped, its inverse, in O(rows).
  //! Checked: sizes >= 0 adding up to the rows of both buffers, every chunk inside both; that the
  //! chunks do not overlap is the planner's (chunk_offsets).
  //! src, dst [sum(sizes), w]; sizes, from, to [C, 1]
  template <class T>
  [[nodiscard]] status copy_chunks(std::type_identity_t<row_view<const T, S>> src,
                                   row_view<const int, S> sizes, row_view<const int, S> from,
                                   row_view<const int, S> to, row_view<T, S> dst) const {
    if (auto st = check_copy_chunks(Derived::name, row_view<const T, S>(src), sizes, from, to,
                                    row_view<const T, S>(dst), true);
        !st)
      return st;
    for (int c = 0; c < sizes.rows(); ++c) {
      const int n = *sizes.row_data(c), f = *from.row_data(c), t = *to.row_data(c);
      host_copy_rows(src.subrows(f, n), dst.subrows(t, n));
    }
    return {};
  }

  //! dst = ids - first where first <= ids < first + count, else -1 (global expert ids to this
  //! rank's local ones; -1 stays -1).   ids, dst [n, k]
  [[nodiscard]] status relabel(row_view<const int, S> ids, int first, int count,
                               row_view<int, S> dst) const {
    if (auto st = check_relabel(Derived::name, ids, count, dst); !st) return st;
    for (int r = 0; r < dst.rows(); ++r) {
      const int* s = ids.row_data(r);
      int* d = dst.row_data(r);
      for (int c = 0; c < dst.width(); ++c)
        d[c] = (s[c] >= first && s[c] - first < count) ? s[c] - first : -1;
    }
    return {};
  }

  //! The chunk table of a pad-mode dispatch (kernels/chunk_table.hpp): sizes, offsets before
  //! and after the expert-major sort, from the fold alone.   table [3, etp * ep * L]
  [[nodiscard]] status uniform_chunk_table(row_view<int, S> table,
                                           const kernels::uniform_chunks& u) const {
    if (auto st = check_uniform_chunk_table(Derived::name, table, u); !st) return st;
    for (int c = 0; c < table.width(); ++c) {
      const kernels::uniform_chunk_entry e = kernels::uniform_chunk(u, c);
      table.row_data(0)[c] = e.size;
      table.row_data(1)[c] = e.from;
      table.row_data(2)[c] = e.to;
    }
    return {};
  }

  //! dst = src: host values (the hot path's bookkeeping: row ranges, chunk tables, a few hundred
  //! values) written into the context's memory. A context that runs kernels writes them with
  //! kernels carrying them in their parameters (kernels/store_values.hpp), never with a
  //! host-to-device copy, so a CUDA graph captures them and `src` may be rewritten as soon as the
  //! call returns; here, a copy.   src, dst [n, w]
  template <class V>
  [[nodiscard]] status store_host_values(std::type_identity_t<row_view<const V, host_space>> src,
                                         row_view<V, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "store_host_values", src, dst); !st) return st;
    host_copy_rows(src, dst);
    return {};
  }

  //! dst += src, element by element (16-bit T: the sum in fp32, as add_converted).
  //! src, dst [n, w]
  template <class T>
  [[nodiscard]] status add(std::type_identity_t<row_view<const T, S>> src,
                           row_view<T, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "add", src, dst); !st) return st;
    return add_converted<T, T>(src, dst);
  }

  //! dst += src converted to T, element by element: the sum formed in accumulator_t<T> (fp32 for
  //! 16-bit T) and rounded to T once (an R-typed gradient added into a T-typed one).
  //! src [n, w] of U, dst [n, w] of T
  template <class T, class U>
  [[nodiscard]] status add_converted(std::type_identity_t<row_view<const U, S>> src,
                                     row_view<T, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "add_converted", src, dst); !st) return st;
    for (int r = 0; r < dst.rows(); ++r) {
      const U* s = src.row_data(r);
      T* d = dst.row_data(r);
      for (int c = 0; c < dst.width(); ++c)
        d[c] = detail::narrow<T>(detail::widen(d[c]) +
                                 static_cast<accumulator_t<T>>(detail::widen(s[c])));
    }
    return {};
  }

  //! dst = src converted to T (widened, or rounded to nearest once).   src [n, w] of U
  template <class T, class U>
  [[nodiscard]] status convert(std::type_identity_t<row_view<const U, S>> src,
                               row_view<T, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "convert", src, dst); !st) return st;
    for (int r = 0; r < dst.rows(); ++r) {
      const U* s = src.row_data(r);
      T* d = dst.row_data(r);
      for (int c = 0; c < dst.width(); ++c) d[c] = static_cast<T>(detail::widen(s[c]));
    }
    return {};
  }

  //! dst *= s, element by element.
  template <class T>
  [[nodiscard]] status scale(row_view<T, S> dst, std::type_identity_t<T> s) const {
    for (int r = 0; r < dst.rows(); ++r) {
      T* d = dst.row_data(r);
      for (int c = 0; c < dst.width(); ++c)
        d[c] = detail::narrow<T>(detail::widen(d[c]) * detail::widen(s));
    }
    return {};
  }

  //! Every element of dst = v.
  template <class T>
  [[nodiscard]] status fill(row_view<T, S> dst, std::type_identity_t<T> v) const {
    for (int r = 0; r < dst.rows(); ++r) {
      T* d = dst.row_data(r);
      for (int c = 0; c < dst.width(); ++c) d[c] = v;
    }
    return {};
  }
};

}  // namespace detail

//! A context whose memory host code can address (host_exec, cpu_exec): its plan builders
//! (dispatch/plan_builders.hpp) run as host code on that memory.
template <class X>
concept host_addressable_context = requires {
  requires X::host_addressable_memory;
};

}  // namespace v0_1
}  // namespace moefold
