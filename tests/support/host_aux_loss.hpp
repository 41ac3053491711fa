//! @file host_aux_loss.hpp
//! @brief The tests' host reference: The local pieces of the auxiliary losses: the scores and map
//! they use, the Switch/GShard load-balancing formula on a rank's own tokens given the (already
//! reduced) counts, the z-loss, and the gradients of each with respect to the logits. The
//! reductions over TP x CP (or TP x DP x CP) live in group_losses.hpp; everything here needs no
//! communication.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <moefold/core/error.hpp>
#include <moefold/core/expected.hpp>
#include "host_score_function.hpp"
#include "host_topk.hpp"
#include "host_topk_router.hpp"

namespace moefold {
inline namespace v0_1 {

//! What the aux losses see (Megatron-Core `compute_routing_scores_for_aux_loss`): scores over all
//! experts (softmax; sigmoid and sqrt-softplus renormalised over E) and their plain top-k map,
//! without expert bias, group limit or dropping. Padding tokens get zero scores and no map entry.
template <class T>
struct aux_scores {
  int num_tokens = 0;
  int num_experts = 0;
  int topk = 0;
  int valid_tokens = 0;             //!< tokens that are not padding
  bool has_padding_mask = false;    //!< token totals then come from the counts, as in Megatron
  std::vector<T> scores{};          // [N, E]
  std::vector<std::uint8_t> map{};  // [N, E]
  std::vector<int>
      topk_scratch{};  // compute_aux_scores' work rows, reused (no allocation once grown)
  std::vector<int> order_scratch{};
};

namespace detail {
template <class T>
[[nodiscard]] status check_padding(std::span<const std::uint8_t> padding, std::size_t n) {
  if (!padding.empty() && padding.size() != n)
    return make_error(
        errc::shape_mismatch,
        "padding mask must be empty or have num_tokens=" + to_decimal(static_cast<long long>(n)) +
            " entries (got " + to_decimal(static_cast<long long>(padding.size())) + ")");
  return {};
}
template <class T>
[[nodiscard]] bool is_padding(std::span<const std::uint8_t> padding, std::size_t t) {
  return !padding.empty() && padding[t] != 0;
}
// The aux scores of one row (before padding): softmax, or f(x) / (sum f + 1e-20).
template <class T>
void aux_row_scores(score_function f, std::span<const T> row, std::span<T> out) {
  if (f == score_function::softmax) {
    softmax(row, out);
    return;
  }
  T sum = 0;
  for (std::size_t e = 0; e < row.size(); ++e) {
    out[e] = elementwise_score(f, row[e]);
    sum += out[e];
  }
  for (std::size_t e = 0; e < row.size(); ++e) out[e] = out[e] / (sum + T(1e-20));
}
}  // namespace detail

//! logits [N, E] -> aux scores and map. padding [N] (1 = padding token) may be empty.
template <class T>
[[nodiscard]] status compute_aux_scores(score_function f, int topk, int num_experts,
                                        std::span<const T> logits,
                                        std::span<const std::uint8_t> padding, aux_scores<T>& out) {
  if (num_experts < 1 || topk < 1 || topk > num_experts)
    return make_error(
        errc::invalid_argument,
        "aux scores: need 1 <= topk <= num_experts (topk=" + detail::to_decimal(topk) +
            ", num_experts=" + detail::to_decimal(num_experts) + ")");
  if (logits.size() % static_cast<std::size_t>(num_experts) != 0)
    return make_error(errc::shape_mismatch, "aux scores: logits size is not a multiple of E");
  const std::size_t E = static_cast<std::size_t>(num_experts), N = logits.size() / E;
  if (auto s = detail::check_padding<T>(padding, N); !s) return s;
  if (auto s = detail::check_finite(logits, "aux-loss logits"); !s) return s;
  out.num_tokens = static_cast<int>(N);
  out.num_experts = num_experts;
  out.topk = topk;
  out.has_padding_mask = !padding.empty();
  out.valid_tokens = 0;
  out.scores.assign(N * E, T(0));
  out.map.assign(N * E, 0);
  std::vector<int>&idx = out.topk_scratch, &scratch = out.order_scratch;
  idx.resize(static_cast<std::size_t>(topk));
  for (std::size_t t = 0; t < N; ++t) {
    if (detail::is_padding<T>(padding, t)) continue;
    ++out.valid_tokens;
    const std::span<T> s(out.scores.data() + t * E, E);
    detail::aux_row_scores(f, logits.subspan(t * E, E), s);
    topk_indices(std::span<const T>(s), topk, std::span<int>(idx), scratch);
    for (int e : idx) out.map[t * E + static_cast<std::size_t>(e)] = 1;
  }
  return {};
}

//! Column sums of `map` viewed as [rows, columns] (columns = E for the batch and global losses,
//! B*E for the per-sequence loss, whose token n = s*B + b sits in row s, column b*E + e).
inline void column_counts(std::span<const std::uint8_t> map, std::span<double> out) {
  std::fill(out.begin(), out.end(), 0.0);
  for (std::size_t i = 0; i < map.size(); ++i) out[i % out.size()] += map[i];
}
[[nodiscard]] inline std::vector<double> column_counts(std::span<const std::uint8_t> map,
                                                       std::size_t columns) {
  std::vector<double> c(columns, 0.0);
  column_counts(map, std::span<double>(c));
  return c;
}

//! One rank's part of a load-balancing loss and its gradient with respect to the aux scores.
template <class T>
struct aux_loss_term {
  T loss = 0;                    //!< this rank's partial loss; the partials sum to the full loss
  std::size_t columns = 0;       //!< E, or B*E for the per-sequence loss
  std::vector<T> dscores{};      //!< d loss / d scores[row, col] (the same for every row) [columns]
  std::vector<double> counts{};  //!< the reduced counts used (for logging and tests) [columns]
  double total_tokens = 0;       //!< T of the formula
};

//! Switch/GShard load balancing (Megatron-Core `switch_load_balancing_loss_func`) on local scores
//! viewed as [rows, columns]:
//!   loss = coeff * E / (k * T^2) * sum_col (sum_rows scores[row, col]) * counts[col] / divide_by
//! `counts` are the counts of the statistics group, `total_tokens` its T. Evaluated in T as
//! Megatron does in fp32: per-column sums first, then the dot product, then the factor.
//! Into `r`, reusing its vectors; the counts are r.counts [columns] (set them first).
template <class T>
void switch_load_balancing_into(std::span<const T> scores, std::size_t columns, double total_tokens,
                                int topk, int num_experts, double coeff, double divide_by,
                                aux_loss_term<T>& r) {
  r.loss = T(0);
  r.columns = columns;
  r.total_tokens = total_tokens;
  r.dscores.assign(columns, T(0));
  if (total_tokens <= 0) return;  // no valid token anywhere: the loss is 0, not 0/0
  // Per-column sums first (in dscores, overwritten below), then the dot product.
  std::vector<T>& agg = r.dscores;
  for (std::size_t i = 0; i < scores.size(); ++i) agg[i % columns] += scores[i];
  const T factor = static_cast<T>(num_experts * coeff / (topk * total_tokens * total_tokens));
  T dot = 0;
  for (std::size_t c = 0; c < columns; ++c) dot += agg[c] * static_cast<T>(r.counts[c]);
  r.loss = dot * factor / static_cast<T>(divide_by);
  for (std::size_t c = 0; c < columns; ++c)
    r.dscores[c] = static_cast<T>(r.counts[c]) * factor / static_cast<T>(divide_by);
}
template <class T>
[[nodiscard]] aux_loss_term<T> switch_load_balancing(std::span<const T> scores, std::size_t columns,
                                                     std::span<const double> counts,
                                                     double total_tokens, int topk, int num_experts,
                                                     double coeff, double divide_by = 1.0) {
  aux_loss_term<T> r;
  r.counts.assign(counts.begin(), counts.end());
  switch_load_balancing_into(scores, columns, total_tokens, topk, num_experts, coeff, divide_by, r);
  return r;
}

//! Adds seed * d(term)/d logits to dlogits [N, E]: the aux-loss gradient chained through the aux
//! scores (softmax Jacobian, or the renormalised sigmoid / sqrt-softplus). `seed` is the gradient
//! of the training loss with respect to this aux loss (Megatron's main_loss_backward_scale).
//! `scratch` holds 3 * E elements (the caller's, so a step allocates nothing).
template <class T>
[[nodiscard]] status add_aux_loss_gradient(score_function f, std::span<const T> logits,
                                           int num_experts, std::span<const std::uint8_t> padding,
                                           const aux_loss_term<T>& term, T seed,
                                           std::span<T> dlogits, std::span<T> scratch) {
  const std::size_t E = static_cast<std::size_t>(num_experts);
  if (E == 0 || logits.size() % E != 0 || dlogits.size() != logits.size() || term.columns == 0 ||
      (logits.size() % term.columns) != 0 || term.dscores.size() != term.columns)
    return make_error(errc::shape_mismatch,
                      "aux-loss gradient: logits, dlogits [N*E] and the term's columns do not fit");
  if (scratch.size() < 3 * E)
    return make_error(errc::workspace_too_small, "aux-loss gradient: scratch needs 3 * E elements");
  const std::size_t N = logits.size() / E;
  if (auto s = detail::check_padding<T>(padding, N); !s) return s;
  const std::span<T> s = scratch.first(E), ds = scratch.subspan(E, E),
                     dl = scratch.subspan(2 * E, E);
  for (std::size_t t = 0; t < N; ++t) {
    if (detail::is_padding<T>(padding, t)) continue;  // masked scores: no gradient
    const auto row = logits.subspan(t * E, E);
    for (std::size_t e = 0; e < E; ++e) ds[e] = seed * term.dscores[(t * E + e) % term.columns];
    if (f == score_function::softmax) {
      detail::softmax(row, std::span<T>(s));
      detail::softmax_backward(std::span<const T>(s), std::span<const T>(ds), std::span<T>(dl));
    } else {
      T sum = 0;
      for (std::size_t e = 0; e < E; ++e) {
        s[e] = detail::elementwise_score(f, row[e]);
        sum += s[e];
      }
      const T D = sum + T(1e-20);
      T gs = 0;
      for (std::size_t e = 0; e < E; ++e) gs += ds[e] * s[e];
      for (std::size_t e = 0; e < E; ++e)
        dl[e] = (ds[e] / D - gs / (D * D)) * detail::elementwise_score_grad(f, row[e], s[e]);
    }
    for (std::size_t e = 0; e < E; ++e) dlogits[t * E + e] += dl[e];
  }
  return {};
}

template <class T>
[[nodiscard]] status add_aux_loss_gradient(score_function f, std::span<const T> logits,
                                           int num_experts, std::span<const std::uint8_t> padding,
                                           const aux_loss_term<T>& term, T seed,
                                           std::span<T> dlogits) {
  std::vector<T> scratch(3 * static_cast<std::size_t>(num_experts < 0 ? 0 : num_experts));
  return add_aux_loss_gradient(f, logits, num_experts, padding, term, seed, dlogits,
                               std::span<T>(scratch));
}

//! z-loss (ST-MoE, Megatron-Core `z_loss_func`): coeff * mean over valid tokens of
//! logsumexp(logits[t])^2. Pass coeff already divided by |TP x CP| (group_losses.hpp does) so
//! that the partials of the group sum to the mean over the full sequence. 0 without valid tokens.
template <class T>
[[nodiscard]] expected<T> z_loss(std::span<const T> logits, int num_experts, double coeff,
                                 std::span<const std::uint8_t> padding = {}) {
  const std::size_t E = static_cast<std::size_t>(num_experts);
  if (E == 0 || logits.size() % E != 0)
    return make_error(errc::shape_mismatch, "z-loss: logits size is not a multiple of E");
  const std::size_t N = logits.size() / E;
  if (auto s = detail::check_padding<T>(padding, N); !s) return unexpected<error>(s.error());
  if (auto s = detail::check_finite(logits, "z-loss logits"); !s)
    return unexpected<error>(s.error());
  T sum = 0;
  std::size_t valid = 0;
  for (std::size_t t = 0; t < N; ++t) {
    if (detail::is_padding<T>(padding, t)) continue;
    const T l = detail::logsumexp(logits.subspan(t * E, E));
    sum += l * l;
    ++valid;
  }
  if (valid == 0) return T(0);
  return sum / static_cast<T>(valid) * static_cast<T>(coeff);
}

//! Adds seed * d z_loss / d logits to dlogits: seed * coeff * 2 lse_t softmax(logits[t]) / valid.
//! `scratch` holds E elements.
template <class T>
[[nodiscard]] status add_z_loss_gradient(std::span<const T> logits, int num_experts, double coeff,
                                         std::span<const std::uint8_t> padding, T seed,
                                         std::span<T> dlogits, std::span<T> scratch) {
  const std::size_t E = static_cast<std::size_t>(num_experts);
  if (E == 0 || logits.size() % E != 0 || dlogits.size() != logits.size())
    return make_error(errc::shape_mismatch, "z-loss gradient: logits and dlogits must be [N*E]");
  if (scratch.size() < E)
    return make_error(errc::workspace_too_small, "z-loss gradient: scratch needs E elements");
  const std::size_t N = logits.size() / E;
  if (auto s = detail::check_padding<T>(padding, N); !s) return s;
  std::size_t valid = 0;
  for (std::size_t t = 0; t < N; ++t) valid += detail::is_padding<T>(padding, t) ? 0 : 1;
  if (valid == 0) return {};
  const std::span<T> s = scratch.first(E);
  for (std::size_t t = 0; t < N; ++t) {
    if (detail::is_padding<T>(padding, t)) continue;
    const auto row = logits.subspan(t * E, E);
    const T l = detail::logsumexp(row);
    detail::softmax(row, std::span<T>(s));
    const T c = seed * static_cast<T>(coeff) * T(2) * l / static_cast<T>(valid);
    for (std::size_t e = 0; e < E; ++e) dlogits[t * E + e] += c * s[e];
  }
  return {};
}

template <class T>
[[nodiscard]] status add_z_loss_gradient(std::span<const T> logits, int num_experts, double coeff,
                                         std::span<const std::uint8_t> padding, T seed,
                                         std::span<T> dlogits) {
  std::vector<T> scratch(static_cast<std::size_t>(num_experts < 0 ? 0 : num_experts));
  return add_z_loss_gradient(logits, num_experts, coeff, padding, seed, dlogits,
                             std::span<T>(scratch));
}

}  // namespace v0_1
}  // namespace moefold
