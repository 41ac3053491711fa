//! @file simt_memory_ops.hpp
//! @brief The row operations of an executor that runs kernels (exec/host_memory_ops.hpp says what
//! each one computes): the same members, with the same checks and messages, each one launch of a
//! portable kernel body from kernels/ (permute.hpp, unpermute.hpp, chunk_copy.hpp,
//! elementwise.hpp) through `launch(derived, grid, kernel)`. cpu_exec uses it, so the dispatcher
//! and the layer on the CPU executor run the kernels a GPU runs.
//!
//! Index checks: the kernels themselves count indices outside their range (a device error flag,
//! which a GPU executor reads at its next status call) and treat them as "no source". An executor
//! whose memory the host can address also checks them before the launch (Derived::
//! check_indices_first), so that a bad index is reported with its position and nothing is written.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>

// The kernel bodies each row operation launches.
#include <moefold/kernels/chunk_copy.hpp>
#include <moefold/kernels/chunk_table.hpp>
#include <moefold/kernels/elementwise.hpp>
#include <moefold/kernels/histogram.hpp>
#include <moefold/kernels/permute.hpp>
#include <moefold/kernels/scan.hpp>
#include <moefold/kernels/simt/row_copy.hpp>
#include <moefold/kernels/store_values.hpp>
#include <moefold/kernels/unpermute.hpp>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "exec.hpp"
#include "host_memory_ops.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! Blocks for `rows` rows (row kernels: a block per row at a time), at most `cap`.
[[nodiscard]] inline int row_grid(long long rows, int cap) noexcept {
  return static_cast<int>(std::min<long long>(rows, cap));
}
//! Blocks for `n` elements at `threads` per block, at most `cap`.
[[nodiscard]] inline int element_grid(long long n, int threads, int cap) noexcept {
  return static_cast<int>(std::min<long long>((n + threads - 1) / threads, cap));
}

//! The row operations over memory space S as kernel launches on the executor Derived, which
//! provides `launch(const Derived&, launch_grid, kernel)`, `max_grid_blocks` and
//! `check_indices_first` (true: a synchronous executor over host-addressable memory, cpu_exec;
//! false: a GPU executor with `fault_word()`, exec/cuda/cuda_exec.cuh).
template <class Derived, class S>
struct simt_memory_ops {
  //! dst[r] = src[index[r] / divisor] (0 where index[r] == -1).
  //! src [R, w], index [M, 1], dst [M, w]; divisor >= 1.
  template <class T>
  [[nodiscard]] status gather_rows(std::type_identity_t<row_view<const T, S>> src,
                                   row_view<const int, S> index, int divisor,
                                   row_view<T, S> dst) const {
    if (auto st = check_gather_rows(Derived::name, src, index, divisor, row_view<const T, S>(dst));
        !st)
      return st;
    if constexpr (Derived::check_indices_first)
      if (auto st = check_indices(index, static_cast<long long>(src.rows()) * divisor,
                                  Derived::name, "gather_rows");
          !st)
        return st;
    if (dst.empty()) return {};
    const bool vec16 = kernels::simt::rows_vec16<T>(src.data(), src.width(), src.stride()) &&
                       kernels::simt::rows_vec16<T>(dst.data(), dst.width(), dst.stride());
    return run("gather_rows", row_grid(dst.rows(), Derived::max_grid_blocks),
               kernels::gather_rows_kernel<T>{
                   .src = src.data(),
                   .src_stride = src.stride(),
                   .src_rows = src.rows(),
                   .index = index.data(),
                   .index_stride = index.stride(),
                   .divisor = divisor,
                   .dst = dst.data(),
                   .dst_stride = dst.stride(),
                   .rows = dst.rows(),
                   .width = dst.width(),
                   .vec16 = vec16,
               });
  }

  //! dst[t] = sum over j, in order, of weight[t, j] * src[index[t, j]], in Acc.
  //! src [M, w], index [N, k], weights [N, k] or empty, dst [N, w]
  template <class T, class P = T, class Acc = T>
  [[nodiscard]] status gather_sum_rows(std::type_identity_t<row_view<const T, S>> src,
                                       row_view<const int, S> index,
                                       std::type_identity_t<row_view<const P, S>> weights,
                                       row_view<T, S> dst) const {
    const bool weighted = weights.rows() > 0;
    if (auto st =
            check_gather_sum_rows(Derived::name, src, index, weights, row_view<const T, S>(dst));
        !st)
      return st;
    if constexpr (Derived::check_indices_first)
      if (auto st = check_indices(index, src.rows(), Derived::name, "gather_sum_rows"); !st)
        return st;
    if (dst.empty()) return {};
    const bool vec16 = kernels::simt::rows_vec16<T>(src.data(), src.width(), src.stride()) &&
                       kernels::simt::rows_vec16<T>(dst.data(), dst.width(), dst.stride());
    return run("gather_sum_rows", row_grid(dst.rows(), Derived::max_grid_blocks),
               kernels::gather_sum_rows_kernel<T, P, Acc>{
                   .src = src.data(),
                   .src_stride = src.stride(),
                   .src_rows = src.rows(),
                   .index = index.data(),
                   .index_stride = index.stride(),
                   .k = index.width(),
                   .weights = weighted ? weights.data() : nullptr,
                   .weight_stride = weighted ? weights.stride() : 0,
                   .dst = dst.data(),
                   .dst_stride = dst.stride(),
                   .rows = dst.rows(),
                   .width = dst.width(),
                   .vec16 = vec16,
               });
  }

  //! Chunk copies (a chunk sort or its inverse).   src, dst [sum(sizes), w]; sizes, from, to [C, 1]
  //! The chunk table is checked on the host: it is host-built bookkeeping in host-addressable
  //! memory (check_indices_first); a GPU executor takes it as given (the planner's).
  template <class T>
  [[nodiscard]] status copy_chunks(std::type_identity_t<row_view<const T, S>> src,
                                   row_view<const int, S> sizes, row_view<const int, S> from,
                                   row_view<const int, S> to, row_view<T, S> dst) const {
    if (auto st = check_copy_chunks(Derived::name, src, sizes, from, to, row_view<const T, S>(dst),
                                    Derived::check_indices_first);
        !st)
      return st;
    if (dst.empty() || sizes.rows() == 0) return {};
    const bool vec16 = kernels::simt::rows_vec16<T>(src.data(), src.width(), src.stride()) &&
                       kernels::simt::rows_vec16<T>(dst.data(), dst.width(), dst.stride());
    return run("copy_chunks", row_grid(dst.rows(), Derived::max_grid_blocks),
               kernels::copy_chunks_kernel<T>{
                   .src = src.data(),
                   .src_stride = src.stride(),
                   .sizes = sizes.data(),
                   .from = from.data(),
                   .to = to.data(),
                   .sizes_stride = sizes.stride(),
                   .from_stride = from.stride(),
                   .to_stride = to.stride(),
                   .chunks = sizes.rows(),
                   .dst = dst.data(),
                   .dst_stride = dst.stride(),
                   .width = dst.width(),
                   .vec16 = vec16,
               });
  }

  //! The chunk table of a pad-mode dispatch, written by a kernel (nothing copied from the
  //! host).   table [3, etp * ep * L]
  [[nodiscard]] status uniform_chunk_table(row_view<int, S> table,
                                           const kernels::uniform_chunks& u) const {
    if (auto st = check_uniform_chunk_table(Derived::name, table, u); !st) return st;
    if (table.width() == 0) return {};
    return run("uniform_chunk_table",
               element_grid(table.width(), kernels::uniform_chunk_table_kernel::block_threads,
                            Derived::max_grid_blocks),
               kernels::uniform_chunk_table_kernel{
                   .u = u, .table = table.data(), .stride = table.stride()});
  }

  //! dst = src, host values carried in the parameters of store_values kernels (one launch per
  //! 2 KiB of values), not copied: a CUDA graph captures them by value and `src` may be rewritten
  //! when the call returns.   src, dst [n, w]
  template <class V>
  [[nodiscard]] status store_host_values(std::type_identity_t<row_view<const V, host_space>> src,
                                         row_view<V, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "store_host_values", src, dst); !st) return st;
    using K = kernels::store_values_kernel<V>;
    const long long n = static_cast<long long>(dst.rows()) * dst.width();
    for (long long first = 0; first < n; first += K::capacity) {
      K k{};
      k.count = static_cast<int>(std::min<long long>(K::capacity, n - first));
      for (int i = 0; i < k.count; ++i) {
        const long long flat = first + i;
        k.values[i] = src.row_data(static_cast<int>(flat / dst.width()))[flat % dst.width()];
      }
      k.dst = dst.data();
      k.stride = dst.stride();
      k.width = dst.width();
      k.first = first;
      if (auto st = run("store_host_values",
                        element_grid(k.count, K::block_threads, Derived::max_grid_blocks), k);
          !st)
        return st;
    }
    return {};
  }

  //! dst = ids - first where first <= ids < first + count, else -1.   ids, dst [n, k]
  [[nodiscard]] status relabel(row_view<const int, S> ids, int first, int count,
                               row_view<int, S> dst) const {
    if (auto st = check_relabel(Derived::name, ids, count, dst); !st) return st;
    return run_elementwise("relabel", dst,
                           kernels::relabel_kernel{.ids = {ids.data(), ids.stride()},
                                                   .first = first,
                                                   .count = count,
                                                   .dst = {dst.data(), dst.stride()},
                                                   .rows = dst.rows(),
                                                   .width = dst.width()});
  }

  //! dst += src (16-bit T: the sum in fp32).   src, dst [n, w]
  template <class T>
  [[nodiscard]] status add(std::type_identity_t<row_view<const T, S>> src,
                           row_view<T, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "add", src, dst); !st) return st;
    return add_converted<T, T>(src, dst);
  }

  //! dst += src converted to T, summed in accumulator_t<T>, rounded once.
  template <class T, class U>
  [[nodiscard]] status add_converted(std::type_identity_t<row_view<const U, S>> src,
                                     row_view<T, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "add_converted", src, dst); !st) return st;
    return run_elementwise("add_converted", dst,
                           kernels::add_converted_kernel<T, U>{.src = {src.data(), src.stride()},
                                                               .dst = {dst.data(), dst.stride()},
                                                               .rows = dst.rows(),
                                                               .width = dst.width()});
  }

  //! dst = src converted to T.   src [n, w] of U
  template <class T, class U>
  [[nodiscard]] status convert(std::type_identity_t<row_view<const U, S>> src,
                               row_view<T, S> dst) const {
    if (auto st = check_same_shape(Derived::name, "convert", src, dst); !st) return st;
    return run_elementwise("convert", dst,
                           kernels::convert_kernel<T, U>{.src = {src.data(), src.stride()},
                                                         .dst = {dst.data(), dst.stride()},
                                                         .rows = dst.rows(),
                                                         .width = dst.width()});
  }

  //! dst *= s.
  template <class T>
  [[nodiscard]] status scale(row_view<T, S> dst, std::type_identity_t<T> s) const {
    return run_elementwise(
        "scale", dst,
        kernels::scale_kernel<T>{
            .dst = {dst.data(), dst.stride()}, .s = s, .rows = dst.rows(), .width = dst.width()});
  }

  //! Every element of dst = v.
  template <class T>
  [[nodiscard]] status fill(row_view<T, S> dst, std::type_identity_t<T> v) const {
    return run_elementwise(
        "fill", dst,
        kernels::fill_kernel<T>{
            .dst = {dst.data(), dst.stride()}, .v = v, .rows = dst.rows(), .width = dst.width()});
  }

  //! Integers the scratch of exclusive_scan over n elements holds (one per tile of the scan).
  [[nodiscard]] static constexpr long long exclusive_scan_scratch(long long n) noexcept {
    return (n + kernels::scan_tiles_kernel::tile - 1) / kernels::scan_tiles_kernel::tile;
  }

  //! out[i] = in[0] + ... + in[i-1], total[0, 0] = the sum of all: three launches (tiles, their
  //! sums, the offsets; kernels/scan.hpp), exact. in, out [1, n] contiguous; total [1, 1];
  //! scratch [1, >= exclusive_scan_scratch(n)], all in this executor's memory.
  [[nodiscard]] status exclusive_scan(row_view<const int, S> in, row_view<int, S> out,
                                      row_view<int, S> total, row_view<int, S> scratch) const {
    const long long n = in.extent();
    const long long tiles = exclusive_scan_scratch(n);
    if (in.rows() != 1 || out.rows() != 1 || out.width() != in.width() || total.rows() != 1 ||
        total.width() != 1 || scratch.rows() != 1 || scratch.width() < tiles)
      return op_shape_error(Derived::name, "exclusive_scan",
                            "need in, out [1, n], total [1, 1] and scratch [1, >= tiles]");
    constexpr auto smem = sizeof(int) * static_cast<std::size_t>(
                                            kernels::simt::block_scan_scratch<cpu_ctx_shape<256>>);
    if (tiles > 0) {
      if (auto st = launch(
              self(),
              launch_grid{.blocks = row_grid(tiles, Derived::max_grid_blocks), .smem_bytes = smem},
              kernels::scan_tiles_kernel{
                  .in = in.data(), .out = out.data(), .n = n, .tile_sums = scratch.data()});
          !st)
        return st;
    }
    if (auto st = launch(self(), launch_grid{.blocks = 1, .smem_bytes = smem},
                         kernels::scan_tile_sums_kernel{
                             .tile_sums = scratch.data(), .tiles = tiles, .total = total.data()});
        !st)
      return st;
    if (tiles == 0) return {};
    return launch(self(), launch_grid{.blocks = element_grid(n, 256, Derived::max_grid_blocks)},
                  kernels::add_tile_offsets_kernel{
                      .out = out.data(), .n = n, .tile_offsets = scratch.data()});
  }

  //! counts[0, e] = entries of the contiguous record `ids` [N, k] naming expert e
  //! (E = counts.width()); `fault` [1, 2] gets {slot, id} of the lowest bad entry (an id outside
  //! [-1, E), or an expert its token named in an earlier slot), or {-1, 0}: written on the
  //! device, nothing read back.
  [[nodiscard]] status expert_histogram(row_view<const int, S> ids, row_view<int, S> counts,
                                        row_view<int, S> fault) const {
    if (!ids.contiguous() || counts.rows() != 1 || fault.rows() != 1 || fault.width() != 2)
      return op_shape_error(Derived::name, "expert_histogram",
                            "need a contiguous record [n, k], counts [1, E] and fault [1, 2]");
    if (auto st = fill<int>(counts, 0); !st) return st;
    if (auto st = fill<int>(fault, 2147483647); !st) return st;
    const int E = counts.width();
    if (ids.extent() > 0)
      if (auto st = launch(
              self(),
              launch_grid{.blocks = element_grid(ids.extent(), 256, Derived::max_grid_blocks),
                          .smem_bytes = kernels::expert_histogram_kernel::smem_bytes(E)},
              kernels::expert_histogram_kernel{.ids = ids.data(),
                                               .n = ids.extent(),
                                               .num_experts = E,
                                               .counts = counts.data(),
                                               .first_bad = fault.data(),
                                               .topk = ids.width() > 0 ? ids.width() : 1});
          !st)
        return st;
    return launch(self(), launch_grid{.blocks = 1},
                  kernels::record_fault_kernel{.ids = ids.data(), .fault = fault.data()});
  }

 private:
  //! The team a block scan's scratch is sized by: the kernel's block in warps of 32, the most any
  //! context gives it (a host context's team of one needs less).
  template <int Threads>
  struct cpu_ctx_shape {
    static constexpr int block_threads = Threads;
    static constexpr int warp_threads = 32;
  };
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  //! One launch. A kernel with a fault counter gets, on an executor whose memory the host can
  //! address (check_indices_first), one here, read back after the launch (that executor is
  //! synchronous: launch returns when the kernel is done); on a GPU executor its device error
  //! word (Derived::fault_word()), which its next host-side status call reads.
  template <class K>
  [[nodiscard]] status run(const char* op, int blocks, K kernel) const {
    int faults = 0;
    if constexpr (requires { kernel.fault; }) {
      if constexpr (Derived::check_indices_first)
        kernel.fault = &faults;
      else
        kernel.fault = self().fault_word();
    }
    if (auto st = launch(self(), launch_grid{.blocks = blocks}, kernel); !st) return st;
    if (faults != 0)
      return make_error(errc::invalid_argument, std::string(Derived::name) + "::" + op + ": " +
                                                    to_decimal(faults) +
                                                    " indices outside their range");
    return {};
  }
  template <class T, class K>
  [[nodiscard]] status run_elementwise(const char* op, const row_view<T, S>& dst,
                                       const K& kernel) const {
    if (dst.empty()) return {};
    const long long n = static_cast<long long>(dst.rows()) * dst.width();
    return run(op, element_grid(n, K::block_threads, Derived::max_grid_blocks), kernel);
  }
};

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
