//! @file plan_builders.hpp
//! @brief The dispatchers' bookkeeping operations on a routing record in a context's memory, for
//! the contexts whose memory the host can address (host_exec, and cpu_exec until it runs the
//! kernel bodies): the permutation plan builder and the per-expert count of a record. They run
//! today's host logic directly on that memory, as those contexts' row operations do; cuda_exec's
//! builders are kernels (dispatch/cuda/, with the routing kernels).
//!
//! Both validate the record: ids in [-1, E), each expert at most once per token (the plan), so a
//! dispatcher checks its routing record once, here, at the API boundary.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string>

#include "../core/exec.hpp"
#include "../core/expected.hpp"
#include "../core/host_memory_ops.hpp"
#include "../core/row_view.hpp"
#include "permute.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

struct plan_builder_access {
  template <class S>
  static expected<basic_permute_plan<S>> build(const plan_input<S>& in,
                                               std::span<std::byte> storage) {
    const permute_args a{.num_tokens = in.num_tokens,
                         .topk = in.topk,
                         .num_experts = in.num_experts,
                         .capacity = in.capacity,
                         .num_sources = in.num_sources,
                         .source_tokens = in.source_tokens};
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
