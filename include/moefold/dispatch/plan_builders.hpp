//! @file plan_builders.hpp
//! @brief The dispatchers' bookkeeping operations on a routing record in a context's memory: the
//! permutation plan builder and the per-expert count of a record. On host_exec they run the host
//! logic on that memory; on a context that runs kernels (cpu_exec, cuda_exec) they launch
//! the plan kernels (kernels/permute_plan.hpp, kernels/histogram.hpp) and read nothing back
//! except through the context's counted copies: their results (counts, the record's faults) stay in
//! the context's memory, where a dispatcher brings them to the host together with what it needs
//! there anyway (one device-to-host copy per forward), or not at all (pad mode; see the
//! dispatchers' device_status()).
//!
//! Both validate the record: ids in [-1, E), each expert at most once per token, so a
//! dispatcher checks its routing record once, here, at the API boundary.
#pragma once

#include <algorithm>
#include <climits>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

// The plan kernels.
#include <moefold/kernels/permute_plan.hpp>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../exec/exec.hpp"
#include "../exec/host_memory_ops.hpp"
#include "permute.hpp"

namespace moefold {
inline namespace v0_1 {

//! Whether a context's operations are kernel launches (cpu_exec, cuda_exec): its bookkeeping
//! builders then launch kernels and read nothing back.
template <class X>
inline constexpr bool runs_kernels_v = requires {
  requires X::runs_kernels;
};

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
    if (!in.expert.contiguous() || in.expert.rows() != in.num_tokens ||
        (in.num_tokens > 0 && in.expert.width() != in.topk))
      return shape_error(in);
    const auto entries = static_cast<std::size_t>(in.expert.extent());
    return basic_permute_plan<S>::make_in_addressable_memory(a, in.expert.data(), entries, storage);
  }

  // The plan kernels (kernels/permute_plan.hpp) enqueued on an executor that runs kernels: no
  // result is read back. In pad mode the plan is complete (its sizes are the capacity's); else
  // its rows are bounded by N k until resolve() learns the counts. The record's faults stay in
  // the plan's status row.
  template <class Exec, class S>
  static expected<basic_permute_plan<S>> enqueue(Exec& x, const plan_input<S>& in,
                                                 std::span<std::byte> storage) {
    using plan = basic_permute_plan<S>;
    const permute_args a = args_of(in);
    if (!in.expert.contiguous() || in.expert.rows() != in.num_tokens ||
        (in.num_tokens > 0 && in.expert.width() != in.topk))
      return shape_error(in);
    const auto entries = static_cast<std::size_t>(in.expert.extent());
    if (auto st = plan::check_args(a, entries); !st) return unexpected<error>(st.error());
    const int upper = a.capacity ? plan::pad_rows(a) : a.num_tokens * a.topk;
    workspace_carver c(storage);
    plan p = plan::carve(c, a, upper);
    if (!c.fits()) return plan::workspace_error(c, storage);
    // The fault slots start at INT_MAX (a fill on the context); each source's first token comes
    // from the host, stored by a kernel carrying the values (store_host_values: no copy, no wait).
    if (auto st = x.template fill<int>(row_view<int, S>(p.fault_, 1, 2), INT_MAX); !st)
      return unexpected<error>(st.error());
    const int sources = a.num_sources;
    if (sources > 1) {
      std::vector<int> first(static_cast<std::size_t>(sources) + 1, 0);
      for (std::size_t i = 0; i < static_cast<std::size_t>(sources); ++i)
        first[i + 1] = first[i] + a.source_tokens[i];
      if (auto st =
              x.template store_host_values<int>(row_view<const int>(first.data(), 1, sources + 1),
                                                row_view<int, S>(p.source_first_, 1, sources + 1));
          !st)
        return unexpected<error>(st.error());
    }
    kernels::plan_args pa{.expert = in.expert.data(),
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
    const int tiles = capped_blocks<Exec>(pa.tiles(), 1);
    const int experts = capped_blocks<Exec>(a.num_experts, 256);
    const int row_blocks = capped_blocks<Exec>(upper, 256);
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
    if (auto st = launch(x, launch_grid{.blocks = row_blocks}, kernels::plan_offsets_kernel{pa});
        !st)
      return unexpected<error>(st.error());
    if (auto st = launch(
            x, launch_grid{.blocks = tiles, .smem_bytes = kernels::plan_rows_kernel::smem_bytes},
            kernels::plan_rows_kernel{pa});
        !st)
      return unexpected<error>(st.error());
    return p;
  }

  // An enqueued plan completed from its status row on the host ([E + 2]: counts, fault slots):
  // a fault becomes the host builder's error (the record is brought to the host for its words:
  // an error path may wait), else the rows are the routed pairs (pad mode: unchanged).
  template <class Exec, class S>
  static status resolve(Exec& x, const plan_input<S>& in, basic_permute_plan<S>& p,
                        std::span<const int> status_row) {
    using plan = basic_permute_plan<S>;
    const permute_args a = args_of(in);
    const auto E = static_cast<std::size_t>(a.num_experts);
    if (status_row.size() != E + 2)
      return make_error(errc::shape_mismatch, "permute: a plan's status row has E + 2 = " +
                                                  to_decimal(static_cast<long long>(E) + 2) +
                                                  " entries, not " + to_decimal(status_row.size()));
    const int bad = status_row[E], over = status_row[E + 1];
    if (bad != INT_MAX || over != INT_MAX) {
      std::vector<int> rec(static_cast<std::size_t>(in.expert.extent()));
      if (auto st =
              x.copy(in.expert, row_view<int>(rec.data(), in.expert.rows(), in.expert.width()));
          !st)
        return st;
      if (bad != INT_MAX) return plan::entry_error(a, rec.data(), bad);
      typename plan::overflow o{.expert = rec[static_cast<std::size_t>(over)], .source = 0};
      const int t = over / a.topk;
      for (int first = 0; o.source + 1 < a.num_sources; ++o.source) {
        first += a.source_tokens[static_cast<std::size_t>(o.source)];
        if (t < first) break;
      }
      return p.overflow_error(a, rec.data(), o);
    }
    if (!a.capacity) {
      long long routed = 0;
      for (std::size_t e = 0; e < E; ++e) routed += status_row[e];
      p.m_ = static_cast<int>(routed);
    }
    return {};
  }

  // The plan complete in one call: enqueue, the status row to the host (one device-to-host copy,
  // which waits for the kernels), resolve.
  template <class Exec, class S>
  static expected<basic_permute_plan<S>> build_with_kernels(Exec& x, const plan_input<S>& in,
                                                            std::span<std::byte> storage) {
    auto p = enqueue(x, in, storage);
    if (!p) return p;
    std::vector<int> st(static_cast<std::size_t>(in.num_experts) + 2);
    if (auto c = x.copy(p->status_row(), row_view<int>(st.data(), 1, in.num_experts + 2)); !c)
      return unexpected<error>(c.error());
    if (auto r = resolve(x, in, *p, st); !r) return unexpected<error>(r.error());
    return p;
  }

  template <class S>
  static unexpected<error> shape_error(const plan_input<S>& in) {
    return make_error(errc::shape_mismatch,
                      "permute: the routing record must be a contiguous [N, k] view (got [" +
                          to_decimal(in.expert.rows()) + ", " + to_decimal(in.expert.width()) +
                          "] for N = " + to_decimal(in.num_tokens) +
                          ", k = " + to_decimal(in.topk) + ")");
  }
};

}  // namespace detail

//! Builds the permutation plan of `in` (its record in x's memory) in `storage` (x's memory, of
//! basic_permute_plan::workspace_bytes bytes), validating the record. The plan's sizes
//! (num_rows()) are known on the host when it returns.
template <host_addressable_context Exec>
requires(!runs_kernels_v<Exec>)
    [[nodiscard]] expected<basic_permute_plan<typename Exec::memory_space>> build_permute_plan(
        Exec&, const plan_input<typename Exec::memory_space>& in, std::span<std::byte> storage) {
  return detail::plan_builder_access::build(in, storage);
}
//! The same on an executor that runs kernels (cpu_exec): the plan kernels
//! (kernels/permute_plan.hpp), the plan entry for entry the host builder's, then its status row
//! to the host (one device-to-host copy: the host waits for the kernels).
template <execution_context Exec>
requires(runs_kernels_v<Exec>)
    [[nodiscard]] expected<basic_permute_plan<typename Exec::memory_space>> build_permute_plan(
        Exec& x, const plan_input<typename Exec::memory_space>& in, std::span<std::byte> storage) {
  return detail::plan_builder_access::build_with_kernels(x, in, storage);
}

//! The plan without waiting for it, for a caller that brings its status row
//! (plan.status_row(): counts and fault slots) to the host with data of its own (the All-to-All
//! dispatcher gathers it with every rank's) and then calls resolve_permute_plan. On a context
//! whose builder is host code the plan is complete and validated at once (a bad record is
//! reported here); on one that runs kernels nothing is read back: in pad mode the plan is
//! complete but unvalidated (a faulty record gets no rows), otherwise num_rows() is the bound
//! N k until resolved.
template <execution_context Exec>
requires(runs_kernels_v<Exec> || host_addressable_context<Exec>)
    [[nodiscard]] expected<basic_permute_plan<typename Exec::memory_space>> enqueue_permute_plan(
        Exec& x, const plan_input<typename Exec::memory_space>& in, std::span<std::byte> storage) {
  if constexpr (runs_kernels_v<Exec>)
    return detail::plan_builder_access::enqueue(x, in, storage);
  else
    return build_permute_plan(x, in, storage);
}

//! Completes an enqueued plan from its status row on the host ([E + 2]): a fault the kernels
//! found becomes the host builder's error for the same record (which is then read from x's
//! memory: an error path may wait); otherwise the plan's rows become the routed pairs.
template <execution_context Exec>
requires(runs_kernels_v<Exec> || host_addressable_context<Exec>) [[nodiscard]] status
    resolve_permute_plan(Exec& x, const plan_input<typename Exec::memory_space>& in,
                         basic_permute_plan<typename Exec::memory_space>& plan,
                         std::span<const int> status_row) {
  return detail::plan_builder_access::resolve(x, in, plan, status_row);
}

//! counts[0, e] = pairs of `expert` [n, k] naming expert e, for e in [0, E); fault [1, 2] =
//! {slot, id} of the first bad entry (an id outside [-1, E), or an expert its token named in an
//! earlier slot), {-1, 0} when there is none (counts then unspecified). All three in x's memory.
template <host_addressable_context Exec>
requires(!runs_kernels_v<Exec>) [[nodiscard]] status
    count_routed_pairs(Exec&, row_view<const int, typename Exec::memory_space> expert,
                       row_view<int, typename Exec::memory_space> counts,
                       row_view<int, typename Exec::memory_space> fault) {
  if (!expert.contiguous() || counts.rows() != 1 || fault.rows() != 1 || fault.width() != 2)
    return make_error(errc::shape_mismatch,
                      "count_routed_pairs: need a contiguous record [n, k], counts [1, E] and "
                      "fault [1, 2]");
  const int E = counts.width(), k = expert.width() > 0 ? expert.width() : 1;
  int* c = counts.data();
  for (int e = 0; e < E; ++e) c[e] = 0;
  const int* ex = expert.data();
  const long long entries = expert.extent();
  fault.data()[0] = -1;
  fault.data()[1] = 0;
  for (long long s = 0; s < entries; ++s) {
    const int e = ex[s];
    if (kernels::bad_record_pair(ex, s, k, E)) {
      fault.data()[0] = static_cast<int>(s);
      fault.data()[1] = e;
      return {};
    }
    if (e >= 0) ++c[e];
  }
  return {};
}

//! The same on an executor that runs kernels (cpu_exec): the per-expert histogram kernel and
//! the fault's (kernels/histogram.hpp: integer atomics, the lowest bad slot by an atomic min),
//! all written in x's memory, nothing read back.
template <execution_context Exec>
requires(runs_kernels_v<Exec>) [[nodiscard]] status
    count_routed_pairs(Exec& x, row_view<const int, typename Exec::memory_space> expert,
                       row_view<int, typename Exec::memory_space> counts,
                       row_view<int, typename Exec::memory_space> fault) {
  if (!expert.contiguous() || counts.rows() != 1 || fault.rows() != 1 || fault.width() != 2)
    return make_error(errc::shape_mismatch,
                      "count_routed_pairs: need a contiguous record [n, k], counts [1, E] and "
                      "fault [1, 2]");
  return x.expert_histogram(expert, counts, fault);
}

//! A context a dispatcher can run on: an execution context with the plan builders above and the
//! row operations (exec/host_memory_ops.hpp; cuda_exec gains both with its kernels).
template <class X>
concept dispatch_context = execution_context<X> &&
    requires(X& x, const plan_input<typename X::memory_space>& in, std::span<std::byte> storage,
             row_view<const int, typename X::memory_space> ids,
             row_view<int, typename X::memory_space> out,
             row_view<const float, typename X::memory_space> src,
             row_view<float, typename X::memory_space> dst) {
  {build_permute_plan(x, in, storage)};
  {enqueue_permute_plan(x, in, storage)};
  {count_routed_pairs(x, ids, out, out)};
  { x.template gather_rows<float>(src, ids, 1, dst) } -> std::same_as<status>;
  { x.template gather_sum_rows<float>(src, ids, src, dst) } -> std::same_as<status>;
  { x.template copy_chunks<float>(src, ids, ids, ids, dst) } -> std::same_as<status>;
  { x.relabel(ids, 0, 1, out) } -> std::same_as<status>;
  { x.uniform_chunk_table(out, kernels::uniform_chunks{}) } -> std::same_as<status>;
  { x.template store_host_values<int>(row_view<const int>{}, out) } -> std::same_as<status>;
  { x.template fill<float>(dst, 0.f) } -> std::same_as<status>;
};

}  // namespace v0_1
}  // namespace moefold
