//! @file permute.hpp
//! @brief Permutation primitives of the token dispatcher (host reference; the GPU path reuses the
//! plan): rows grouped by expert, token order kept inside an expert, and the inverse, weighted by
//! the router probabilities with a fixed summation order.
//!
//! A routing record is top-k form: `expert[t*k + j]` is the j-th expert of token t, or -1 when
//! that pair was dropped (or never routed). A token names each expert at most once.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"

namespace moefold {

//! What a permutation is planned from.
struct permute_args {
  int num_tokens = 0;             //!< N
  int topk = 1;                   //!< k
  int num_experts = 1;            //!< E
  std::span<const int> expert{};  //!< [N*k] expert of each (token, slot) pair, -1 = dropped
  int capacity = -1;              //!< pad mode when >= 0: every expert gets exactly this many rows
  //! Pad mode over the concatenated tokens of several sources (the AllGather dispatcher's gathered
  //! group): each expert gets exactly `capacity` rows from each source, so the rows of expert e
  //! are num_sources blocks of capacity rows. `source_tokens` [num_sources] are the sources' token
  //! counts in order (make() needs them; workspace_bytes() only num_sources).
  int num_sources = 1;
  std::span<const int> source_tokens{};
};

//! Where every row of the permuted buffer comes from and goes to. A view into the caller's
//! workspace: valid while the workspace is.
class permute_plan {
 public:
  //! Bytes of workspace a plan for `a` needs.
  [[nodiscard]] static std::size_t workspace_bytes(const permute_args& a) noexcept {
    workspace_carver c;
    const long long pad_rows = static_cast<long long>(a.capacity) * a.num_experts *
                               (a.num_sources > 1 ? a.num_sources : 1);
    (void)carve(c, a, a.capacity >= 0 ? static_cast<int>(pad_rows) : a.num_tokens * a.topk);
    return c.required();
  }

  //! Checks the routing record and builds the plan in `workspace`.
  [[nodiscard]] static expected<permute_plan> make(const permute_args& a,
                                                   std::span<std::byte> workspace) {
    using detail::to_decimal;
    if (a.num_tokens < 0 || a.topk < 1 || a.num_experts < 1)
      return make_error(errc::invalid_size,
                        "permute: need num_tokens >= 0, topk >= 1 and "
                        "num_experts >= 1 (got " +
                            to_decimal(a.num_tokens) + ", " + to_decimal(a.topk) + ", " +
                            to_decimal(a.num_experts) + ")");
    const long long slots = static_cast<long long>(a.num_tokens) * a.topk;
    if (a.num_sources < 1 || (a.num_sources > 1 && a.capacity < 0))
      return make_error(errc::invalid_argument,
                        "permute: num_sources must be >= 1, and several sources need pad mode "
                        "(capacity >= 0)");
    const long long sources = a.num_sources;
    if (slots > max_rows ||
        (a.capacity >= 0 &&
         static_cast<long long>(a.capacity) * a.num_experts * sources > max_rows))
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
    if (static_cast<long long>(a.expert.size()) != slots)
      return make_error(errc::shape_mismatch, "permute: the routing record has " +
                                                  to_decimal(a.expert.size()) +
                                                  " entries but N*k = " + to_decimal(slots));
    // Counts first (validating every entry), so that the row buffer can be sized exactly.
    int routed = 0;
    for (int t = 0; t < a.num_tokens; ++t)
      for (int j = 0; j < a.topk; ++j) {
        const int e = a.expert[static_cast<std::size_t>(t * a.topk + j)];
        if (e < -1 || e >= a.num_experts)
          return make_error(errc::invalid_argument,
                            "permute: token " + to_decimal(t) + " slot " + to_decimal(j) +
                                " names expert " + to_decimal(e) + ", outside [0, " +
                                to_decimal(a.num_experts) + ") (use -1 for a dropped pair)");
        for (int i = 0; i < j && e >= 0; ++i)
          if (a.expert[static_cast<std::size_t>(t * a.topk + i)] == e)
            return make_error(
                errc::invalid_argument,
                "permute: token " + to_decimal(t) + " names expert " + to_decimal(e) + " twice");
        routed += e >= 0 ? 1 : 0;
      }
    const int rows =
        a.capacity >= 0 ? static_cast<int>(a.capacity * a.num_experts * sources) : routed;
    workspace_carver c(workspace);
    permute_plan p = carve(c, a, rows);
    if (!c.fits())
      return make_error(errc::workspace_too_small,
                        "permute: the workspace has " + to_decimal(workspace.size()) +
                            " bytes but the plan needs " + to_decimal(c.required()));
    if (const overflow o = p.build(a); o.expert >= 0)
      return make_error(
          errc::invalid_argument,
          "permute: expert " + to_decimal(o.expert) + " has " + to_decimal(p.pairs_from(a, o)) +
              " routed pairs" + (a.num_sources > 1 ? " from source " + to_decimal(o.source) : "") +
              ", more than the capacity " + to_decimal(a.capacity) + " (drop before padding)");
    return p;
  }

  [[nodiscard]] int num_tokens() const noexcept { return n_; }
  [[nodiscard]] int topk() const noexcept { return k_; }
  [[nodiscard]] int num_experts() const noexcept { return static_cast<int>(real_.size()); }
  //! Rows of the permuted buffer (routed pairs, or capacity * E * num_sources in pad mode).
  [[nodiscard]] int num_rows() const noexcept { return static_cast<int>(row_slot_.size()); }
  //! Routed pairs per expert [E] (excludes padding rows).
  [[nodiscard]] std::span<const int> counts() const noexcept { return real_; }
  //! First row of each expert [E+1] (in pad mode expert e starts at e * capacity * num_sources).
  [[nodiscard]] std::span<const int> offsets() const noexcept { return offsets_; }
  //! The (token, slot) pair t*k+j of each row [M]; -1 for a padding row.
  [[nodiscard]] std::span<const int> row_slot() const noexcept { return row_slot_; }
  //! The row of each (token, slot) pair [N*k]; -1 for a dropped pair.
  [[nodiscard]] std::span<const int> slot_row() const noexcept { return slot_row_; }

 private:
  static permute_plan carve(workspace_carver& c, const permute_args& a, int rows) {
    permute_plan p;
    p.n_ = a.num_tokens;
    p.k_ = a.topk;
    p.real_ = c.take<int>(static_cast<std::size_t>(a.num_experts));
    p.offsets_ = c.take<int>(static_cast<std::size_t>(a.num_experts) + 1);
    p.row_slot_ = c.take<int>(static_cast<std::size_t>(rows));
    p.slot_row_ = c.take<int>(static_cast<std::size_t>(a.num_tokens) * a.topk);
    p.cursor_ = c.take<int>(static_cast<std::size_t>(a.num_experts));
    return p;
  }

  // The first (expert, source) over capacity in pad mode, if any.
  struct overflow {
    int expert = -1, source = 0;
  };

  // Pairs routed to o.expert from source o.source (for the error message).
  int pairs_from(const permute_args& a, overflow o) const {
    int first = 0;
    for (int s = 0; s < o.source; ++s) first += a.source_tokens[static_cast<std::size_t>(s)];
    const int last =
        a.num_sources > 1 ? first + a.source_tokens[static_cast<std::size_t>(o.source)] : n_;
    int n = 0;
    for (int t = first; t < last; ++t)
      for (int j = 0; j < k_; ++j) n += a.expert[static_cast<std::size_t>(t * k_ + j)] == o.expert;
    return n;
  }

  // A counting sort by expert; visiting pairs in token order keeps tokens ascending inside each
  // expert (the stable sort of the reference, without sorting). In pad mode expert e owns rows
  // [e*S*C, (e+1)*S*C), source s's block starting at e*S*C + s*C; the rows a block does not fill
  // stay padding (row_slot -1).
  overflow build(const permute_args& a) {
    const int E = a.num_experts, S = a.num_sources > 1 ? a.num_sources : 1;
    const bool pad = a.capacity >= 0;
    for (auto& v : real_) v = 0;
    for (int e : a.expert)
      if (e >= 0) ++real_[static_cast<std::size_t>(e)];
    offsets_[0] = 0;
    for (int e = 0; e < E; ++e)
      offsets_[static_cast<std::size_t>(e) + 1] =
          offsets_[static_cast<std::size_t>(e)] +
          (pad ? a.capacity * S : real_[static_cast<std::size_t>(e)]);
    for (auto& v : row_slot_) v = -1;
    overflow first;
    for (auto& v : cursor_) v = 0;  // rows taken by each expert inside the current source
    int source = 0, source_end = S > 1 ? a.source_tokens[0] : n_;
    for (int t = 0; t < n_; ++t) {
      while (S > 1 && t >= source_end) {  // the next non-empty source
        for (auto& v : cursor_) v = 0;
        ++source;
        source_end += a.source_tokens[static_cast<std::size_t>(source)];
      }
      for (int j = 0; j < k_; ++j) {
        const int s = t * k_ + j;
        const int e = a.expert[static_cast<std::size_t>(s)];
        slot_row_[static_cast<std::size_t>(s)] = -1;
        if (e < 0) continue;  // a dropped pair
        const auto ue = static_cast<std::size_t>(e);
        if (pad && cursor_[ue] >= a.capacity) {  // over capacity: make() rejects the plan
          if (first.expert < 0) first = {e, source};
          continue;
        }
        const int row = offsets_[ue] + (pad ? source * a.capacity : 0) + cursor_[ue]++;
        row_slot_[static_cast<std::size_t>(row)] = s;
        slot_row_[static_cast<std::size_t>(s)] = row;
      }
    }
    return first;
  }

  int n_ = 0, k_ = 1;
  std::span<int> real_, offsets_, row_slot_, slot_row_, cursor_;
};

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

//! permuted[r] = x[token of row r]; padding rows are zero.      x [N,H] -> out [M,H]
template <class T>
[[nodiscard]] status permute(const permute_plan& p, std::span<const T> x, int hidden,
                             std::span<T> out) {
  if (auto s = detail::check_rows("permute: x", x.size(), p.num_tokens(), hidden); !s) return s;
  if (auto s = detail::check_rows("permute: out", out.size(), p.num_rows(), hidden); !s) return s;
  for (int r = 0; r < p.num_rows(); ++r) {
    const int slot = p.row_slot()[static_cast<std::size_t>(r)];
    auto dst = detail::row(out, r, hidden);
    if (slot < 0) {
      for (auto& v : dst) v = T(0);
    } else {
      auto src = detail::row(x, slot / p.topk(), hidden);
      for (int h = 0; h < hidden; ++h)
        dst[static_cast<std::size_t>(h)] = src[static_cast<std::size_t>(h)];
    }
  }
  return {};
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
  for (int r = 0; r < p.num_rows(); ++r) {
    const int slot = p.row_slot()[static_cast<std::size_t>(r)];
    out[static_cast<std::size_t>(r)] = slot < 0 ? P(0) : probs[static_cast<std::size_t>(slot)];
  }
  return {};
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
  for (int t = 0; t < p.num_tokens(); ++t) {
    auto dst = detail::row(out, t, hidden);
    for (int h = 0; h < hidden; ++h) {
      Acc acc = Acc(0);
      for (int j = 0; j < p.topk(); ++j) {
        const int slot = t * p.topk() + j;
        const int r = p.slot_row()[static_cast<std::size_t>(slot)];
        if (r < 0) continue;
        const Acc v =
            static_cast<Acc>(y[static_cast<std::size_t>(r) * static_cast<std::size_t>(hidden) +
                               static_cast<std::size_t>(h)]);
        acc += probs.empty() ? v : static_cast<Acc>(probs[static_cast<std::size_t>(slot)]) * v;
      }
      dst[static_cast<std::size_t>(h)] = static_cast<T>(acc);
    }
  }
  return {};
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

}  // namespace moefold
