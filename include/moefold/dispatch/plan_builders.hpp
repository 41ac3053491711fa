//! @file plan_builders.hpp
//! @brief The dispatchers' bookkeeping operations on a routing record in a context's memory, for
//! the contexts whose memory the host can address: the permutation plan builder and the
//! per-expert count of a record. On host_exec they run the host logic on that memory; on
//! cpu_exec (which runs kernels) they launch the kernels a GPU would run (kernels/permute_plan.hpp,
//! kernels/histogram.hpp), reading their small results back directly.
//!
//! Both validate the record: ids in [-1, E), each expert at most once per token (the plan), so a
//! dispatcher checks its routing record once, here, at the API boundary.
#pragma once

#include <algorithm>
#include <climits>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>

// The plan kernels: <moefold/kernels/...> where kernels/ is installed under the include tree (or
// linked there by the build), else from the source tree.
#if __has_include(<moefold/kernels/permute_plan.hpp>)
#include <moefold/kernels/permute_plan.hpp>
#else
#include "../../../kernels/permute_plan.hpp"
#endif

#include "../core/exec.hpp"
#include "../core/expected.hpp"
#include "../core/host_memory_ops.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "permute.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

struct plan_builder_access {
  // The plan's arguments (not the record) from a builder's input.
  template <class S>
  static permute_args args_of(const plan_input<S>& in) {
    return {.num_tokens = in.num_tokens,
            .topk = in.topk,
            .num_experts = in.num_experts,
            .capacity = in.capacity,
            .num_sources = in.num_sources,
            .source_tokens = in.source_tokens};
  }

  template <class S>
  static expected<basic_permute_plan<S>> build(const plan_input<S>& in,
                                               std::span<std::byte> storage) {
    const permute_args a = args_of(in);
    const std::size_t entries =
        in.expert.contiguous() ? static_cast<std::size_t>(in.expert.extent()) : std::size_t{0};
    if (!in.expert.contiguous() || in.expert.rows() != in.num_tokens ||
        (in.num_tokens > 0 && in.expert.width() != in.topk))
      return make_error(errc::shape_mismatch,
                        "permute: the routing record must be a contiguous [N, k] view (got [" +
                            to_decimal(in.expert.rows()) + ", " + to_decimal(in.expert.width()) +
                            "] for N = " + to_decimal(in.num_tokens) +
                            ", k = " + to_decimal(in.topk) + ")");
    return basic_permute_plan<S>::make_in_addressable_memory(a, in.expert.data(), entries, storage);
  }

  // The same plan from the plan kernels (kernels/permute_plan.hpp) on an executor that runs
  // kernels over memory the host can address (cpu_exec): the counts are read back directly to
  // size the rows; the errors are the host builder's, for the lowest offending pair.
  template <class Exec, class S>
  static expected<basic_permute_plan<S>> build_with_kernels(Exec& x, const plan_input<S>& in,
                                                            std::span<std::byte> storage) {
    using plan = basic_permute_plan<S>;
    const permute_args a = args_of(in);
    if (!in.expert.contiguous() || in.expert.rows() != in.num_tokens ||
        (in.num_tokens > 0 && in.expert.width() != in.topk))
      return build(in, storage);  // the host builder names the shape error
    const auto entries = static_cast<std::size_t>(in.expert.extent());
    if (auto st = plan::check_args(a, entries); !st) return unexpected<error>(st.error());
    const int* ex = in.expert.data();
    const int upper = a.capacity ? plan::pad_rows(a) : a.num_tokens * a.topk;
    workspace_carver c(storage);
    plan p = plan::carve(c, a, upper);
    if (!c.fits()) return plan::workspace_error(c, storage);
    // Host-written bookkeeping in the workspace (the executor's memory is the host's here).
    const int sources = a.num_sources;
    if (sources > 1) {
      p.source_first_[0] = 0;
      for (int i = 0; i < sources; ++i)
        p.source_first_[i + 1] = p.source_first_[i] + a.source_tokens[static_cast<std::size_t>(i)];
    }
    p.fault_[0] = p.fault_[1] = INT_MAX;
    kernels::plan_args pa{.expert = ex,
                          .num_tokens = a.num_tokens,
                          .topk = a.topk,
                          .num_experts = a.num_experts,
                          .capacity = a.capacity.value_or(-1),
                          .num_sources = a.num_sources,
                          .source_first = sources > 1 ? p.source_first_ : nullptr,
                          .rows = upper,
                          .tile_counts = p.tile_counts_,
                          .counts = p.real_,
                          .offsets = p.offsets_,
                          .row_slot = p.row_slot_,
                          .slot_row = p.slot_row_,
                          .fault = p.fault_};
    const int tiles = static_cast<int>(std::clamp<long long>(pa.tiles(), 1, Exec::max_grid_blocks));
    const int experts = static_cast<int>(
        std::clamp<long long>((a.num_experts + 255) / 256, 1, Exec::max_grid_blocks));
    if (auto st = launch(
            x,
            launch_grid{.blocks = tiles,
                        .smem_bytes = kernels::plan_tile_counts_kernel::smem_bytes(a.num_experts)},
            kernels::plan_tile_counts_kernel{pa});
        !st)
      return unexpected<error>(st.error());
    if (auto st = launch(x, launch_grid{.blocks = experts}, kernels::plan_tile_scan_kernel{pa});
        !st)
      return unexpected<error>(st.error());
    if (p.fault_[0] != INT_MAX) return plan::entry_error(a, ex, p.fault_[0]);
    if (!a.capacity) {
      long long routed = 0;
      for (int e = 0; e < a.num_experts; ++e) routed += p.real_[e];
      p.m_ = pa.rows = static_cast<int>(routed);
    }
    const int row_blocks =
        static_cast<int>(std::clamp<long long>((pa.rows + 255) / 256, 1, Exec::max_grid_blocks));
    if (auto st = launch(x, launch_grid{.blocks = row_blocks}, kernels::plan_offsets_kernel{pa});
        !st)
      return unexpected<error>(st.error());
    if (auto st = launch(
            x, launch_grid{.blocks = tiles, .smem_bytes = kernels::plan_rows_kernel::smem_bytes},
            kernels::plan_rows_kernel{pa});
        !st)
      return unexpected<error>(st.error());
    if (const int s = p.fault_[1]; s != INT_MAX) {
      typename plan::overflow o{.expert = ex[s], .source = 0};
      const int t = s / a.topk;
      while (o.source + 1 < sources && t >= p.source_first_[o.source + 1]) ++o.source;
      return p.overflow_error(a, ex, o);
    }
    return p;
  }
};

}  // namespace detail

//! A bad entry of a routing record: the first pair naming an expert outside [-1, E).
struct routing_fault {
  int slot = -1;   //!< t*k + j; -1: none
  int expert = 0;  //!< the id it names
};

//! Builds the permutation plan of `in` (its record in x's memory) in `storage` (x's memory, of
//! basic_permute_plan::workspace_bytes bytes), validating the record. The plan's sizes
//! (num_rows()) are known on the host when it returns.
template <host_addressable_context Exec>
[[nodiscard]] expected<basic_permute_plan<typename Exec::memory_space>> build_permute_plan(
    Exec&, const plan_input<typename Exec::memory_space>& in, std::span<std::byte> storage) {
  return detail::plan_builder_access::build(in, storage);
}
//! The same on an executor that runs kernels (cpu_exec): the plan kernels
//! (kernels/permute_plan.hpp), the plan entry for entry the host builder's.
template <host_addressable_context Exec>
requires(Exec::runs_kernels)
    [[nodiscard]] expected<basic_permute_plan<typename Exec::memory_space>> build_permute_plan(
        Exec& x, const plan_input<typename Exec::memory_space>& in, std::span<std::byte> storage) {
  return detail::plan_builder_access::build_with_kernels(x, in, storage);
}

//! counts[0, e] = pairs of `expert` [n, k] naming expert e, for e in [0, E); the first entry
//! outside [-1, E) is returned (its count is not taken), with counts then unspecified.
//! expert [n, k] contiguous, counts [1, E]; both in x's memory.
template <host_addressable_context Exec>
[[nodiscard]] expected<routing_fault> count_routed_pairs(
    Exec&, row_view<const int, typename Exec::memory_space> expert,
    row_view<int, typename Exec::memory_space> counts) {
  if (!expert.contiguous() || counts.rows() != 1)
    return make_error(errc::shape_mismatch,
                      "count_routed_pairs: need a contiguous record [n, k] and counts [1, E]");
  const int E = counts.width();
  int* c = counts.data();
  for (int e = 0; e < E; ++e) c[e] = 0;
  const int* ex = expert.data();
  const long long entries = expert.extent();
  for (long long s = 0; s < entries; ++s) {
    const int e = ex[s];
    if (e < -1 || e >= E) return routing_fault{static_cast<int>(s), e};
    if (e >= 0) ++c[e];
  }
  return routing_fault{};
}

//! The same on an executor that runs kernels (cpu_exec): the per-expert histogram kernel
//! (kernels/histogram.hpp: integer atomics, the lowest bad slot by an atomic min). Its memory is
//! host memory, so the fault's slot is read back directly.
template <host_addressable_context Exec>
requires(Exec::runs_kernels) [[nodiscard]] expected<routing_fault> count_routed_pairs(
    Exec& x, row_view<const int, typename Exec::memory_space> expert,
    row_view<int, typename Exec::memory_space> counts) {
  if (!expert.contiguous() || counts.rows() != 1)
    return make_error(errc::shape_mismatch,
                      "count_routed_pairs: need a contiguous record [n, k] and counts [1, E]");
  int first_bad = 0;
  if (auto st = x.expert_histogram(expert, counts,
                                   row_view<int, typename Exec::memory_space>(&first_bad, 1, 1));
      !st)
    return unexpected<error>(st.error());
  if (first_bad != 2147483647) return routing_fault{first_bad, expert.data()[first_bad]};
  return routing_fault{};
}

//! A context a dispatcher can run on: an execution context with the plan builders above and the
//! row operations (core/host_memory_ops.hpp; cuda_exec gains both with its kernels).
template <class X>
concept dispatch_context = execution_context<X> &&
    requires(X& x, const plan_input<typename X::memory_space>& in, std::span<std::byte> storage,
             row_view<const int, typename X::memory_space> ids,
             row_view<int, typename X::memory_space> out,
             row_view<const float, typename X::memory_space> src,
             row_view<float, typename X::memory_space> dst) {
  {build_permute_plan(x, in, storage)};
  {count_routed_pairs(x, ids, out)};
  { x.template gather_rows<float>(src, ids, 1, dst) } -> std::same_as<status>;
  { x.template gather_sum_rows<float>(src, ids, src, dst) } -> std::same_as<status>;
  { x.template copy_chunks<float>(src, ids, ids, ids, dst) } -> std::same_as<status>;
  { x.relabel(ids, 0, 1, out) } -> std::same_as<status>;
  { x.template fill<float>(dst, 0.f) } -> std::same_as<status>;
};

}  // namespace v0_1
}  // namespace moefold
