//! @file permute.hpp
//! @brief The permutation plan of the token dispatcher and the host functions that apply it: rows
//! grouped by expert, token order kept inside an expert, and the inverse, weighted by the router
//! probabilities with a fixed summation order.
//!
//! The plan is data (counts, offsets, row-of-slot, slot-of-row: plain arrays in memory space
//! `Space` with MOEFOLD_HOST_DEVICE accessors and row views for the context operations). It is
//! filled by a builder per execution context, which validates the routing record once:
//! basic_permute_plan<host_space>::make() (alias permute_plan) for host spans, and
//! build_permute_plan(exec, plan_input, storage) (dispatch/plan_builders.hpp) for a dispatcher's
//! context, its record and storage in the context's memory. Moving rows by a plan is a context
//! operation (gather_rows, gather_sum_rows: exec/host_memory_ops.hpp); permute() and unpermute()
//! below are those operations on host_exec with the span shapes checked.
//!
//! A routing record is top-k form: `expert[t*k + j]` is the j-th expert of token t, or -1 when
//! that pair was dropped (or never routed). A token names each expert at most once.
#pragma once

#include <climits>
#include <cstddef>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

// The plan kernels' tile size sizes their scratch in the plan's workspace.
#include <moefold/kernels/permute_plan.hpp>

#include "../core/config.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/host_exec.hpp"
#include "pad_mode.hpp"

namespace moefold {
inline namespace v0_1 {

//! What a permutation is planned from.
struct permute_args {
  int num_tokens = 0;             //!< N
  int topk = 1;                   //!< k
  int num_experts = 1;            //!< E
  std::span<const int> expert{};  //!< [N*k] expert of each (token, slot) pair, -1 = dropped
  std::optional<int> capacity{};  //!< pad mode when set: every expert gets exactly this many rows
  //! Pad mode over the concatenated tokens of several sources (the AllGather dispatcher's gathered
  //! group): each expert gets exactly `capacity` rows from each source, so the rows of expert e
  //! are num_sources blocks of capacity rows. `source_tokens` [num_sources] are the sources' token
  //! counts in order (make() needs them; workspace_bytes() only num_sources).
  int num_sources = 1;
  std::span<const int> source_tokens{};
};

//! What a context's plan builder plans from (dispatch/plan_builders.hpp): permute_args with the
//! routing record as a view in the context's memory space.
template <memory_space Space>
struct plan_input {
  int num_tokens = 0;                    //!< N
  int topk = 1;                          //!< k
  int num_experts = 1;                   //!< E
  row_view<const int, Space> expert{};   //!< [N, k] contiguous, -1 = dropped
  std::optional<int> capacity{};         //!< pad mode when set
  int num_sources = 1;                   //!< as permute_args
  std::span<const int> source_tokens{};  //!< [num_sources], host memory
};

namespace detail {
struct plan_builder_access;
}

//! Where every row of the permuted buffer comes from and goes to, its arrays in memory space
//! Space. A view into the caller's storage: valid while the storage is. Host element access
//! (counts(), offsets(), ...) only in host memory; row views of the arrays in every space.
template <memory_space Space = host_space>
class basic_permute_plan {
 public:
  //! Bytes of workspace a plan for `a` needs.
  [[nodiscard]] static std::size_t workspace_bytes(const permute_args& a) noexcept {
    workspace_carver c;
    const long long pad_rows = static_cast<long long>(detail::pad_or_off(a.capacity)) *
                               a.num_experts * (a.num_sources > 1 ? a.num_sources : 1);
    (void)carve(c, a, pad_rows >= 0 ? static_cast<int>(pad_rows) : a.num_tokens * a.topk);
    return c.required();
  }

  //! Checks the routing record and builds the plan in `workspace` (host memory).
  [[nodiscard]] static expected<basic_permute_plan> make(
      const permute_args& a, std::span<std::byte> workspace) requires host_accessible_v<Space> {
    return make_in_addressable_memory(a, a.expert.data(), a.expert.size(), workspace);
  }

  [[nodiscard]] MOEFOLD_HOST_DEVICE int num_tokens() const noexcept { return n_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int topk() const noexcept { return k_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int num_experts() const noexcept { return e_; }
  //! Rows of the permuted buffer (routed pairs, or capacity * E * num_sources in pad mode).
  [[nodiscard]] MOEFOLD_HOST_DEVICE int num_rows() const noexcept { return m_; }
  //! Routed pairs of expert e (excludes padding rows).
  [[nodiscard]] MOEFOLD_HOST_DEVICE int count(int e) const noexcept { return real_[e]; }
  //! First row of expert e, e in [0, E] (in pad mode expert e starts at e * capacity * sources).
  [[nodiscard]] MOEFOLD_HOST_DEVICE int offset(int e) const noexcept { return offsets_[e]; }
  //! The (token, slot) pair t*k+j of row r; -1 for a padding row.
  [[nodiscard]] MOEFOLD_HOST_DEVICE int row_slot(int r) const noexcept { return row_slot_[r]; }
  //! The row of pair s = t*k+j; -1 for a dropped pair.
  [[nodiscard]] MOEFOLD_HOST_DEVICE int slot_row(int s) const noexcept { return slot_row_[s]; }

  //! Routed pairs per expert [E] (excludes padding rows).
  [[nodiscard]] std::span<const int> counts() const noexcept requires host_accessible_v<Space> {
    return {real_, detail::uz(e_)};
  }
  //! First row of each expert [E+1].
  [[nodiscard]] std::span<const int> offsets() const noexcept requires host_accessible_v<Space> {
    return {offsets_, detail::uz(e_) + 1};
  }
  //! The pair of each row [M]; -1 for a padding row.
  [[nodiscard]] std::span<const int> row_slot() const noexcept requires host_accessible_v<Space> {
    return {row_slot_, detail::uz(m_)};
  }
  //! The row of each pair [N*k]; -1 for a dropped pair.
  [[nodiscard]] std::span<const int> slot_row() const noexcept requires host_accessible_v<Space> {
    return {slot_row_, detail::uz(n_) * detail::uz(k_)};
  }
  //! row_slot as the index of a gather [M, 1]: with divisor k it names each row's token.
  [[nodiscard]] row_view<const int, Space> row_slots() const noexcept { return {row_slot_, m_, 1}; }
  //! slot_row as the index of a gather-sum [N, k]: the rows of each token's pairs, slot order.
  [[nodiscard]] row_view<const int, Space> token_rows() const noexcept {
    return {slot_row_, n_, k_};
  }
  //! slot_row as the index of a gather [N*k, 1]: the row of each pair.
  [[nodiscard]] row_view<const int, Space> slot_rows() const noexcept {
    return {slot_row_, n_ * k_, 1};
  }
  //! The routed pairs per expert as one row [1, E].
  [[nodiscard]] row_view<const int, Space> count_row() const noexcept { return {real_, 1, e_}; }
  //! The first row of each expert as one row [1, E + 1].
  [[nodiscard]] row_view<const int, Space> offset_row() const noexcept {
    return {offsets_, 1, e_ + 1};
  }
  //! The counts and the record's two fault slots [1, E + 2] (what the All-to-All dispatcher
  //! gathers): columns E and E + 1 hold the lowest slot naming a bad id or a repeated expert,
  //! and in pad mode the lowest slot beyond its expert's capacity; INT_MAX for none.
  [[nodiscard]] row_view<const int, Space> status_row() const noexcept {
    return {real_, 1, e_ + 2};
  }

 private:
  friend struct detail::plan_builder_access;

  // The host builder over memory the host can address (host memory, or the CPU executor's):
  // the record at `ex` (expert_size entries), the plan's arrays carved from `workspace`.
  [[nodiscard]] static expected<basic_permute_plan> make_in_addressable_memory(
      const permute_args& a, const int* ex, std::size_t expert_size,
      std::span<std::byte> workspace) {
    using detail::to_decimal;
    if (auto st = check_args(a, expert_size); !st) return unexpected<error>(st.error());
    // Counts first (validating every entry), so that the row buffer can be sized exactly.
    int routed = 0;
    for (int s = 0; s < a.num_tokens * a.topk; ++s) {
      if (bad_entry(a, ex, s)) return entry_error(a, ex, s);
      routed += ex[s] >= 0 ? 1 : 0;
    }
    workspace_carver c(workspace);
    basic_permute_plan p = carve(c, a, a.capacity ? pad_rows(a) : routed);
    if (!c.fits()) return workspace_error(c, workspace);
    p.fault_[0] = p.fault_[1] = INT_MAX;  // a plan it returns is valid: no fault in its status row
    if (const overflow o = p.build(a, ex); o.expert >= 0) return p.overflow_error(a, ex, o);
    return p;
  }

  // Rows of the permuted buffer in pad mode: capacity per expert and source.
  static int pad_rows(const permute_args& a) noexcept {
    return static_cast<int>(static_cast<long long>(*a.capacity) * a.num_experts *
                            (a.num_sources > 1 ? a.num_sources : 1));
  }
  // Pair s names an id outside [-1, E), or an expert its token named before.
  static bool bad_entry(const permute_args& a, const int* ex, int s) noexcept {
    return kernels::bad_record_pair(ex, s, a.topk, a.num_experts);
  }
  // The error of bad pair s (bad_entry), naming its token, slot and expert.
  static unexpected<error> entry_error(const permute_args& a, const int* ex, int s) {
    using detail::to_decimal;
    const int t = s / a.topk, j = s % a.topk, e = ex[s];
    if (e < -1 || e >= a.num_experts)
      return make_error(errc::invalid_argument,
                        "permute: token " + to_decimal(t) + " slot " + to_decimal(j) +
                            " names expert " + to_decimal(e) + ", outside [0, " +
                            to_decimal(a.num_experts) + ") (use -1 for a dropped pair)");
    return make_error(errc::invalid_argument, "permute: token " + to_decimal(t) + " names expert " +
                                                  to_decimal(e) + " twice");
  }
  static unexpected<error> workspace_error(const workspace_carver& c,
                                           std::span<std::byte> workspace) {
    using detail::to_decimal;
    return make_error(errc::workspace_too_small,
                      "permute: the workspace has " + to_decimal(workspace.size()) +
                          " bytes but the plan needs " + to_decimal(c.required()));
  }

  // The shape rules of permute_args and the record's size (every builder's, before any entry is
  // read).
  [[nodiscard]] static status check_args(const permute_args& a, std::size_t expert_size) {
    using detail::to_decimal;
    if (a.num_tokens < 0 || a.topk < 1 || a.num_experts < 1)
      return make_error(errc::invalid_size,
                        "permute: need num_tokens >= 0, topk >= 1 and "
                        "num_experts >= 1 (got " +
                            to_decimal(a.num_tokens) + ", " + to_decimal(a.topk) + ", " +
                            to_decimal(a.num_experts) + ")");
    const long long slots = static_cast<long long>(a.num_tokens) * a.topk;
    if (a.capacity && *a.capacity < 0)
      return make_error(errc::invalid_argument,
                        "permute: capacity = " + to_decimal(*a.capacity) +
                            " (pad mode takes a capacity >= 0; leave it unset for no padding)");
    if (a.num_sources < 1 || (a.num_sources > 1 && !a.capacity))
      return make_error(errc::invalid_argument,
                        "permute: num_sources must be >= 1, and several sources need pad mode "
                        "(a capacity)");
    const long long sources = a.num_sources;
    if (slots > max_rows ||
        (a.capacity && static_cast<long long>(*a.capacity) * a.num_experts * sources > max_rows))
      return make_error(errc::overflow, "permute: N*k or capacity*E*sources exceeds 2^31-1");
    if (a.num_sources > 1) {
      long long total = 0;
      bool ok = a.source_tokens.size() == static_cast<std::size_t>(a.num_sources);
      for (int v : a.source_tokens) {
        ok = ok && v >= 0;
        total += v;
      }
      if (!ok || total != a.num_tokens)
        return make_error(
            errc::shape_mismatch,
            "permute: source_tokens must hold num_sources = " + to_decimal(a.num_sources) +
                " counts >= 0 that sum to num_tokens = " + to_decimal(a.num_tokens));
    }
    if (static_cast<long long>(expert_size) != slots)
      return make_error(errc::shape_mismatch, "permute: the routing record has " +
                                                  to_decimal(expert_size) +
                                                  " entries but N*k = " + to_decimal(slots));
    return {};
  }

  static basic_permute_plan carve(workspace_carver& c, const permute_args& a, int rows) {
    basic_permute_plan p;
    p.n_ = a.num_tokens;
    p.k_ = a.topk;
    p.e_ = a.num_experts;
    p.m_ = rows;
    // The counts and the kernels' two fault slots side by side: the status row [1, E + 2] a
    // dispatcher brings to the host (or gathers) in one piece.
    p.real_ = c.take<int>(static_cast<std::size_t>(a.num_experts) + 2).data();
    p.fault_ = p.real_ == nullptr ? nullptr : p.real_ + a.num_experts;
    p.offsets_ = c.take<int>(static_cast<std::size_t>(a.num_experts) + 1).data();
    p.row_slot_ = c.take<int>(static_cast<std::size_t>(rows)).data();
    p.slot_row_ = c.take<int>(static_cast<std::size_t>(a.num_tokens) * a.topk).data();
    p.cursor_ = c.take<int>(static_cast<std::size_t>(a.num_experts)).data();
    // The plan kernels' scratch (kernels/permute_plan.hpp): per-tile counts, each source's first
    // token.
    const auto tiles = static_cast<std::size_t>(
        kernels::plan_args::tiles_of(static_cast<long long>(a.num_tokens) * a.topk));
    p.tile_counts_ = c.take<int>(tiles * static_cast<std::size_t>(a.num_experts)).data();
    p.source_first_ =
        c.take<int>(static_cast<std::size_t>(a.num_sources > 1 ? a.num_sources : 0) + 1).data();
    return p;
  }

  // The first (expert, source) over capacity in pad mode, if any.
  struct overflow {
    int expert = -1, source = 0;
  };

  unexpected<error> overflow_error(const permute_args& a, const int* ex, overflow o) const {
    using detail::to_decimal;
    return make_error(
        errc::invalid_argument,
        "permute: expert " + to_decimal(o.expert) + " has " + to_decimal(pairs_from(a, ex, o)) +
            " routed pairs" + (a.num_sources > 1 ? " from source " + to_decimal(o.source) : "") +
            ", more than the capacity " + to_decimal(*a.capacity) + " (drop before padding)");
  }

  // Pairs routed to o.expert from source o.source (for the error message).
  int pairs_from(const permute_args& a, const int* ex, overflow o) const {
    int first = 0;
    for (int s = 0; s < o.source; ++s) first += a.source_tokens[static_cast<std::size_t>(s)];
    const int last =
        a.num_sources > 1 ? first + a.source_tokens[static_cast<std::size_t>(o.source)] : n_;
    int n = 0;
    for (int t = first; t < last; ++t)
      for (int j = 0; j < k_; ++j) n += ex[static_cast<std::size_t>(t * k_ + j)] == o.expert;
    return n;
  }

  // A counting sort by expert; visiting pairs in token order keeps tokens ascending inside each
  // expert (the stable sort of the reference, without sorting). In pad mode expert e owns rows
  // [e*S*C, (e+1)*S*C), source s's block starting at e*S*C + s*C; the rows a block does not fill
  // stay padding (row_slot -1).
  overflow build(const permute_args& a, const int* ex) {
    const int E = a.num_experts, S = a.num_sources > 1 ? a.num_sources : 1;
    const bool pad = a.capacity.has_value();
    const int cap = detail::pad_or_off(a.capacity);
    const std::span<int> real(real_, detail::uz(E)), cursor(cursor_, detail::uz(E)),
        row_slot(row_slot_, detail::uz(m_));
    for (auto& v : real) v = 0;
    for (long long s = 0; s < static_cast<long long>(n_) * k_; ++s)
      if (ex[s] >= 0) ++real[static_cast<std::size_t>(ex[s])];
    offsets_[0] = 0;
    for (int e = 0; e < E; ++e) offsets_[e + 1] = offsets_[e] + (pad ? cap * S : real_[e]);
    for (auto& v : row_slot) v = -1;
    overflow first;
    for (auto& v : cursor) v = 0;  // rows taken by each expert inside the current source
    int source = 0, source_end = S > 1 ? a.source_tokens[0] : n_;
    for (int t = 0; t < n_; ++t) {
      while (S > 1 && t >= source_end) {  // the next non-empty source
        for (auto& v : cursor) v = 0;
        ++source;
        source_end += a.source_tokens[static_cast<std::size_t>(source)];
      }
      for (int j = 0; j < k_; ++j) {
        const int s = t * k_ + j;
        const int e = ex[static_cast<std::size_t>(s)];
        slot_row_[s] = -1;
        if (e < 0) continue;             // a dropped pair
        if (pad && cursor_[e] >= cap) {  // over capacity: make() rejects the plan
          if (first.expert < 0) first = {e, source};
          continue;
        }
        const int row = offsets_[e] + (pad ? source * cap : 0) + cursor_[e]++;
        row_slot_[row] = s;
        slot_row_[s] = row;
      }
    }
    return first;
  }

  // Plain data: sizes and arrays in the caller's workspace.
  int n_ = 0, k_ = 1, e_ = 0, m_ = 0;
  int *real_ = nullptr, *offsets_ = nullptr, *row_slot_ = nullptr, *slot_row_ = nullptr,
      *cursor_ = nullptr, *tile_counts_ = nullptr, *fault_ = nullptr, *source_first_ = nullptr;
};

//! The plan over host memory (tests, host code).
using permute_plan = basic_permute_plan<host_space>;

namespace dispatch {

//! Rows of each expert in the permuted buffer, padding included: offset(e+1) - offset(e).  [E]
inline void rows_per_expert(const permute_plan& p, std::span<int> out) noexcept {
  const auto o = p.offsets();
  std::adjacent_difference(o.begin() + 1, o.end(), out.begin());
  if (!out.empty()) out[0] = o[1] - o[0];
}

}  // namespace dispatch

namespace detail {
template <class T>
std::span<const T> row(std::span<const T> x, int r, int hidden) {
  return x.subspan(static_cast<std::size_t>(r) * static_cast<std::size_t>(hidden),
                   static_cast<std::size_t>(hidden));
}
template <class T>
std::span<T> row(std::span<T> x, int r, int hidden) {
  return x.subspan(static_cast<std::size_t>(r) * static_cast<std::size_t>(hidden),
                   static_cast<std::size_t>(hidden));
}
inline status check_rows(const char* what, std::size_t have, long long rows, int hidden) {
  if (hidden < 0 || static_cast<long long>(have) != rows * hidden)
    return make_error(errc::shape_mismatch, std::string(what) + " has " + to_decimal(have) +
                                                " elements, expected " + to_decimal(rows) + " x " +
                                                to_decimal(hidden));
  return {};
}
}  // namespace detail

namespace dispatch {

//! permuted[r] = x[token of row r]; padding rows are zero.      x [N,H] -> out [M,H]
template <class T>
[[nodiscard]] status permute(const permute_plan& p, std::span<const T> x, int hidden,
                             std::span<T> out) {
  if (auto s = detail::check_rows("permute: x", x.size(), p.num_tokens(), hidden); !s) return s;
  if (auto s = detail::check_rows("permute: out", out.size(), p.num_rows(), hidden); !s) return s;
  return host_exec{}.gather_rows<T>(row_view<const T>(x.data(), p.num_tokens(), hidden),
                                    p.row_slots(), p.topk(),
                                    row_view<T>(out.data(), p.num_rows(), hidden));
}

//! The probability of each row: out[r] = probs[slot of r]; padding rows get 0.  [N*k] -> [M]
template <class P>
[[nodiscard]] status permute_probs(const permute_plan& p, std::span<const P> probs,
                                   std::span<P> out) {
  if (auto s = detail::check_rows("permute_probs: probs", probs.size(),
                                  static_cast<long long>(p.num_tokens()) * p.topk(), 1);
      !s)
    return s;
  if (auto s = detail::check_rows("permute_probs: out", out.size(), p.num_rows(), 1); !s) return s;
  return host_exec{}.gather_rows<P>(row_view<const P>(probs.data(), p.num_tokens() * p.topk(), 1),
                                    p.row_slots(), 1, row_view<P>(out.data(), p.num_rows(), 1));
}

//! out[t] = sum over the token's slots j = 0..k-1 (in this order) of w * y[row(t, j)], with
//! w = probs[t*k+j], or 1 when `probs` is empty. Dropped pairs contribute 0; a token with no
//! routed pair gets 0. A gather per token: no atomics, the same sum every run.  y [M,H] -> [N,H]
//! With empty probs this is also the backward of permute (dx from dpermuted).
template <class T, class P = T, class Acc = T>
[[nodiscard]] status unpermute(const permute_plan& p, std::span<const T> y, int hidden,
                               std::type_identity_t<std::span<const P>> probs, std::span<T> out) {
  if (auto s = detail::check_rows("unpermute: y", y.size(), p.num_rows(), hidden); !s) return s;
  if (auto s = detail::check_rows("unpermute: out", out.size(), p.num_tokens(), hidden); !s)
    return s;
  if (!probs.empty())
    if (auto s = detail::check_rows("unpermute: probs", probs.size(),
                                    static_cast<long long>(p.num_tokens()) * p.topk(), 1);
        !s)
      return s;
  const row_view<const P> w(probs.data(), probs.empty() ? 0 : p.num_tokens(), p.topk());
  return host_exec{}.gather_sum_rows<T, P, Acc>(row_view<const T>(y.data(), p.num_rows(), hidden),
                                                p.token_rows(), w,
                                                row_view<T>(out.data(), p.num_tokens(), hidden));
}

//! Backward of unpermute with probs: dy[row(t,j)] = p[t,j] * dout[t] and
//! dprobs[t,j] = <dout[t], y[row(t,j)]> (0 for dropped pairs); padding rows of dy are 0.
//! dout [N,H], y [M,H], probs [N*k] -> dy [M,H], dprobs [N*k]
template <class T, class P = T, class Acc = T>
[[nodiscard]] status unpermute_backward(const permute_plan& p, std::span<const T> dout,
                                        std::span<const T> y, int hidden,
                                        std::type_identity_t<std::span<const P>> probs,
                                        std::span<T> dy,
                                        std::type_identity_t<std::span<P>> dprobs) {
  const long long slots = static_cast<long long>(p.num_tokens()) * p.topk();
  if (auto s = detail::check_rows("unpermute_backward: dout", dout.size(), p.num_tokens(), hidden);
      !s)
    return s;
  if (auto s = detail::check_rows("unpermute_backward: y", y.size(), p.num_rows(), hidden); !s)
    return s;
  if (auto s = detail::check_rows("unpermute_backward: dy", dy.size(), p.num_rows(), hidden); !s)
    return s;
  if (auto s = detail::check_rows("unpermute_backward: probs", probs.size(), slots, 1); !s)
    return s;
  if (auto s = detail::check_rows("unpermute_backward: dprobs", dprobs.size(), slots, 1); !s)
    return s;
  for (int r = 0; r < p.num_rows(); ++r) {
    const int slot = p.row_slot()[static_cast<std::size_t>(r)];
    auto d = detail::row(dy, r, hidden);
    if (slot < 0) {
      for (auto& v : d) v = T(0);
      continue;
    }
    const auto g = detail::row(dout, slot / p.topk(), hidden);
    const auto w = static_cast<Acc>(probs[static_cast<std::size_t>(slot)]);
    for (int h = 0; h < hidden; ++h)
      d[static_cast<std::size_t>(h)] =
          static_cast<T>(w * static_cast<Acc>(g[static_cast<std::size_t>(h)]));
  }
  for (long long s = 0; s < slots; ++s) {
    const int r = p.slot_row()[static_cast<std::size_t>(s)];
    Acc acc = Acc(0);
    if (r >= 0) {
      const auto g = detail::row(dout, static_cast<int>(s / p.topk()), hidden);
      const auto v = detail::row(y, r, hidden);
      for (int h = 0; h < hidden; ++h)
        acc += static_cast<Acc>(g[static_cast<std::size_t>(h)]) *
               static_cast<Acc>(v[static_cast<std::size_t>(h)]);
    }
    dprobs[static_cast<std::size_t>(s)] = static_cast<P>(acc);
  }
  return {};
}

}  // namespace dispatch

}  // namespace v0_1
}  // namespace moefold
