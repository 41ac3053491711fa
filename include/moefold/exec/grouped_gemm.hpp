//! @file grouped_gemm.hpp
//! @brief The grouped-GEMM operation: the one seam every GEMM of the library goes through (router
//! logits and its gradients, the experts' fc1/fc2 forward, data and weight gradients, the shared
//! expert). Its arguments are plain data, so that backends are interchangeable: `simt_gemm`
//! (exec/simt_gemm.hpp, the portable kernel on any context), `host_gemm` (exec/host_gemm.hpp, a
//! cache-blocked loop on host_exec), later cuBLAS and CUTLASS in exec/cuda/. A caller writes the
//! arguments once and picks the backend by type.
//!
//! The protocol (CUTLASS's device adapter plus CUB's workspace query):
//! @code
//! const grouped_gemm_args<T, T, float> args{.grouping = ..., .groups = L, ...};
//! if (auto st = G::can_implement(args); !st) return st;     // every rule, named in the message
//! const std::size_t bytes = G::workspace_bytes(args);
//! auto ws = exec_buffer<std::byte, Exec>::make(x, 1, bytes);  // in the context's memory
//! G gemm;                                                  // what run() needs, no allocation
//! if (auto st = gemm.initialize(x, args, {ws->view().data(), bytes}); !st) return st;
//! if (auto st = gemm.run(x); !st) return st;                // enqueued; may run again
//! @endcode
//!
//! Shapes (kernels/grouped_gemm.hpp gives the addressing): group g holds the rows
//! [off_g, off_g+1) of the grouped dimension.
//! - rows_are_m (forward, data gradients; groups split M):
//!   C [off_g + i, j] (=|+=) sum_q A [off_g + i, q] B_g [q, j];  A [M, k], B [groups, k, n],
//!   C [M, n], M = off_groups. `m` is not read.
//! - rows_are_k (weight gradients; groups split K, C is per group):
//!   C_g [i, j] (=|+=) sum_q A [i, off_g + q] B [off_g + q, j];  A [m, K], B [K, n],
//!   C [groups, m, n], K = off_groups. `k` is not read.
//!
//! Empty groups and an empty inner dimension: every output whose sum has no term (rows_are_k: a
//! group with no rows; rows_are_m: k = 0) is 0 with accumulate = false and keeps its value with
//! accumulate = true, never garbage from a previous use of the buffer (simt_gemm adds 0 to it,
//! which keeps every value but turns -0 into +0; host_gemm does not write it). An empty group of
//! rows_are_m has no outputs. Elements of C that no output names (padding between rows or groups)
//! are never written.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <moefold/kernels/grouped_gemm.hpp>

#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "exec.hpp"

namespace moefold {
inline namespace v0_1 {

//! The plain-data arguments of one grouped GEMM, for every backend (designated initializers).
//! Pointers of operands and of `offsets` are in the execution context's memory space; they and
//! `host_offsets` must stay valid and unchanged until the last run() on them has completed.
template <class TA, class TB, class TC>
struct grouped_gemm_args {
  using a_type = TA;
  using b_type = TB;
  using c_type = TC;

  kernels::gemm_grouping grouping = kernels::gemm_grouping::rows_are_m;
  int groups = 0;           //!< L >= 1
  int m = 0, n = 0, k = 0;  //!< the fixed sizes (the grouped one comes from the row ranges)
  //! The row ranges on the host: [groups + 1], 0 first, non-decreasing. Give these OR `offsets`.
  std::span<const long long> host_offsets{};
  //! The row ranges on the context: [groups + 1] in its memory (same rules, not checked on the
  //! host: nothing is read back), with `row_bound` >= offsets[groups], which sizes the grid.
  const long long* offsets = nullptr;
  long long row_bound = 0;
  kernels::gemm_operand<const TA> a{};
  kernels::gemm_operand<const TB> b{};
  kernels::gemm_operand<TC> c{};
  bool accumulate = false;  //!< beta = 1: C += A B (weight gradients into fp32 main gradients)
};

namespace detail {

template <class T>
inline constexpr bool is_grouped_gemm_args_v = false;
template <class TA, class TB, class TC>
inline constexpr bool is_grouped_gemm_args_v<grouped_gemm_args<TA, TB, TC>> = true;

//! The rules every backend checks in can_implement, each in its own message prefixed with the
//! backend's name `who`: sizes, where the row ranges are, and operands present when used.
template <class TA, class TB, class TC>
[[nodiscard]] status check_grouped_gemm_args(const grouped_gemm_args<TA, TB, TC>& a,
                                             const char* who) {
  const auto fail = [&](errc code, const std::string& what) {
    return status(make_error(code, std::string(who) + ": " + what));
  };
  const auto got = [](long long v) { return " (got " + to_decimal(v) + ")"; };
  const bool by_m = a.grouping == kernels::gemm_grouping::rows_are_m;
  if (!by_m && a.grouping != kernels::gemm_grouping::rows_are_k)
    return fail(errc::invalid_argument, "grouping must be rows_are_m or rows_are_k" +
                                            got(static_cast<long long>(a.grouping)));
  if (a.groups < 1) return fail(errc::invalid_size, "groups must be >= 1" + got(a.groups));
  if (!by_m && a.m < 0)
    return fail(errc::invalid_size, "m must be >= 0 (rows_are_k: m is fixed)" + got(a.m));
  if (a.n < 0) return fail(errc::invalid_size, "n must be >= 0" + got(a.n));
  if (by_m && a.k < 0)
    return fail(errc::invalid_size, "k must be >= 0 (rows_are_m: k is fixed)" + got(a.k));
  const bool on_host = !a.host_offsets.empty(), on_context = a.offsets != nullptr;
  if (on_host == on_context)
    return fail(errc::invalid_argument,
                std::string("give exactly one of host_offsets and offsets (got ") +
                    (on_host ? "both" : "neither") + ")");
  long long rows = a.row_bound;  // the grouped dimension's total, or a bound of it
  if (on_host) {
    const auto& h = a.host_offsets;
    if (h.size() != static_cast<std::size_t>(a.groups) + 1)
      return fail(errc::shape_mismatch, "host_offsets must hold groups + 1 = " +
                                            to_decimal(static_cast<long long>(a.groups) + 1) +
                                            " entries" + got(static_cast<long long>(h.size())));
    if (h[0] != 0) return fail(errc::invalid_argument, "host_offsets must start at 0" + got(h[0]));
    for (std::size_t g = 0; g + 1 < h.size(); ++g)
      if (h[g + 1] < h[g])
        return fail(errc::invalid_argument, "host_offsets must be non-decreasing (host_offsets[" +
                                                to_decimal(static_cast<long long>(g) + 1) +
                                                "] = " + to_decimal(h[g + 1]) + " < host_offsets[" +
                                                to_decimal(static_cast<long long>(g)) +
                                                "] = " + to_decimal(h[g]) + ")");
    rows = h[a.groups];
  } else if (a.row_bound < 0) {
    return fail(errc::invalid_size, "row_bound must be >= 0" + got(a.row_bound));
  }
  // Outputs exist when C is non-empty; A and B are read when, besides, the sums have terms.
  const bool outputs = by_m ? rows > 0 && a.n > 0 : a.m > 0 && a.n > 0;
  const bool terms = outputs && (by_m ? a.k > 0 : rows > 0);
  if (outputs && a.c.data == nullptr)
    return fail(errc::invalid_argument, "c.data is null and C has elements");
  if (terms && a.a.data == nullptr)
    return fail(errc::invalid_argument, "a.data is null and the product has terms");
  if (terms && a.b.data == nullptr)
    return fail(errc::invalid_argument, "b.data is null and the product has terms");
  return {};
}

//! A backend's workspace smaller than its workspace_bytes(): the error every backend returns.
[[nodiscard]] inline status workspace_too_small(const char* who, std::size_t have,
                                                std::size_t need) {
  return make_error(errc::workspace_too_small, std::string(who) + ": the workspace holds " +
                                                   to_decimal(static_cast<long long>(have)) +
                                                   " bytes, workspace_bytes() asks for " +
                                                   to_decimal(static_cast<long long>(need)));
}

//! run() before a successful initialize(): the error every backend returns.
[[nodiscard]] inline status not_initialized(const char* who) {
  return make_error(errc::invalid_argument,
                    std::string(who) + ": run() before a successful initialize()");
}

//! Writes `a`'s host row ranges into `to` ([groups + 1] in x's memory), for a backend whose
//! kernels read the row ranges on the context: with the context's store_host_values (kernels
//! carrying the values, so that a CUDA graph captures the operation; exec/host_memory_ops.hpp),
//! or a copy on a context without it. Waits for nothing.
template <class Exec, class TA, class TB, class TC>
[[nodiscard]] status copy_host_offsets(Exec& x, const grouped_gemm_args<TA, TB, TC>& a,
                                       std::span<long long> to) {
  using space = typename Exec::memory_space;
  const int entries = a.groups + 1;
  const row_view<const long long, host_space> src(a.host_offsets.data(), 1, entries);
  const row_view<long long, space> dst(to.data(), 1, entries);
  if constexpr (requires { x.template store_host_values<long long>(src, dst); })
    return x.template store_host_values<long long>(src, dst);
  else
    return x.copy(src, dst);
}

//! A distinct address per context type: what a backend remembers of the context initialize() ran
//! on, so that run() on another kind of context is refused instead of misreading its memory.
template <class Exec>
inline constexpr char exec_tag = 0;

}  // namespace detail

//! A grouped-GEMM backend G on execution context Exec: the operation's host protocol.
//! - `G::args_type`, a grouped_gemm_args; `G::name` for messages;
//! - `G::runs_on<Exec>`: true where G can run on Exec (host_gemm: host memory only);
//! - `static status can_implement(const args_type&)`: every rule of the arguments, and the
//!   backend's own limits, named in the message;
//! - `static std::size_t workspace_bytes(const args_type&)`: bytes of the context's memory that
//!   initialize() carves (0: none needed, an empty span will do);
//! - `status initialize(Exec&, const args_type&, std::span<std::byte> workspace)`: checks, keeps
//!   what run() needs, may enqueue copies on the context, never waits for the device;
//! - `status run(Exec&)`: the GEMM, enqueued on the context; again and again on the same
//!   arguments (accumulate = true then adds A B once per run).
template <class G, class Exec>
concept grouped_gemm_backend = execution_context<Exec> &&
    detail::is_grouped_gemm_args_v<typename G::args_type> && std::default_initializable<G> &&
    G::template runs_on<Exec>&& requires(G& g, Exec& x, const typename G::args_type& args,
                                         std::span<std::byte> ws) {
  { G::name } -> std::convertible_to<const char*>;
  { G::can_implement(args) } -> std::same_as<status>;
  { G::workspace_bytes(args) } -> std::same_as<std::size_t>;
  { g.initialize(x, args, ws) } -> std::same_as<status>;
  { g.run(x) } -> std::same_as<status>;
};

}  // namespace v0_1
}  // namespace moefold
