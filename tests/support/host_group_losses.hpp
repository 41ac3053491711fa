//! @file host_group_losses.hpp
//! @brief The tests' host reference: The auxiliary losses and the z-loss of ranks that each hold a
//! piece of the batch: statistics that Megatron-Core sums across TP x CP (or TP x DP x CP for the
//! global loss) are summed through a moefold communicator, so the partial losses of the group add
//! up to the formula on the full batch. Generic over the communicator concept.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <moefold/comm/communicator.hpp>
#include <moefold/core/error.hpp>
#include <moefold/core/expected.hpp>
#include "host_aux_loss.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {
template <communicator C>
[[nodiscard]] status sum_counts(C& group, std::span<double> counts) {
  if (group.size() == 1) return {};
  return group.all_reduce(counts, reduce_op::sum);
}
// T of the formula from the summed counts under a padding mask (valid tokens of the group).
[[nodiscard]] inline double valid_tokens(std::span<const double> counts, double per_token) {
  double total = 0;
  for (double c : counts) total += c;
  return total / per_token;
}
}  // namespace detail

//! Micro-batch load-balancing loss (`aux_loss`): counts summed over `tp_cp`, T = N * |tp_cp|
//! (or, with a padding mask, the group's valid tokens). Writes this rank's partial loss into
//! `out`, reusing its vectors (no allocation once grown).
template <communicator C, class T>
[[nodiscard]] status load_balancing_loss(C& tp_cp, const aux_scores<T>& a, double coeff,
                                         aux_loss_term<T>& out) {
  const auto E = static_cast<std::size_t>(a.num_experts);
  out.counts.resize(E);
  column_counts(std::span<const std::uint8_t>(a.map), std::span<double>(out.counts));
  if (auto s = detail::sum_counts(tp_cp, std::span<double>(out.counts)); !s) return s;
  const double total = a.has_padding_mask ? detail::valid_tokens(out.counts, a.topk)
                                          : static_cast<double>(a.num_tokens) * tp_cp.size();
  switch_load_balancing_into(std::span<const T>(a.scores), E, total, a.topk, a.num_experts, coeff,
                             1.0, out);
  return {};
}
template <communicator C, class T>
[[nodiscard]] expected<aux_loss_term<T>> load_balancing_loss(C& tp_cp, const aux_scores<T>& a,
                                                             double coeff) {
  aux_loss_term<T> out;
  if (auto s = load_balancing_loss(tp_cp, a, coeff, out); !s) return unexpected<error>(s.error());
  return out;
}

//! Per-sequence load-balancing loss (`seq_aux_loss`, DeepSeek-V2/V3): token n = s*B + b belongs
//! to sequence b; counts per (sequence, expert) summed over `tp_cp`; T = S (the full sequence
//! length); the result is the mean over the B sequences of each sequence's loss.
template <communicator C, class T>
[[nodiscard]] status seq_load_balancing_loss(C& tp_cp, const aux_scores<T>& a, int batch,
                                             double coeff, aux_loss_term<T>& out) {
  if (batch < 1 || a.num_tokens % batch != 0)
    return make_error(errc::shape_mismatch,
                      "seq aux loss: num_tokens=" + detail::to_decimal(a.num_tokens) +
                          " is not a multiple of the batch size " + detail::to_decimal(batch));
  const auto cols = static_cast<std::size_t>(batch) * static_cast<std::size_t>(a.num_experts);
  out.counts.resize(cols);
  column_counts(std::span<const std::uint8_t>(a.map), std::span<double>(out.counts));
  if (auto s = detail::sum_counts(tp_cp, std::span<double>(out.counts)); !s) return s;
  const double total = a.has_padding_mask
                           ? detail::valid_tokens(out.counts, static_cast<double>(a.topk) * batch)
                           : static_cast<double>(a.num_tokens / batch) * tp_cp.size();
  switch_load_balancing_into(std::span<const T>(a.scores), cols, total, a.topk, a.num_experts,
                             coeff, static_cast<double>(batch), out);
  return {};
}
template <communicator C, class T>
[[nodiscard]] expected<aux_loss_term<T>> seq_load_balancing_loss(C& tp_cp, const aux_scores<T>& a,
                                                                 int batch, double coeff) {
  aux_loss_term<T> out;
  if (auto s = seq_load_balancing_loss(tp_cp, a, batch, coeff, out); !s)
    return unexpected<error>(s.error());
  return out;
}

//! The running counts of the global load-balancing loss: summed over micro-batches of one global
//! batch, reset when it ends (Megatron-Core `global_tokens_per_expert`, `ga_steps`).
struct global_aux_state {
  std::vector<double> tokens_per_expert{};  // [E]
  int steps = 0;
  //! Call at the end of every global batch.
  void reset() noexcept {
    for (double& c : tokens_per_expert) c = 0;
    steps = 0;
  }
};

//! Global load-balancing loss (`global_aux_loss`): this micro-batch's counts summed over
//! `tp_dp_cp` are added to `state`; the loss uses the running average state / steps (out.counts)
//! and T = N * |tp_dp_cp| of this micro-batch.
template <communicator C, class T>
[[nodiscard]] status global_load_balancing_loss(C& tp_dp_cp, const aux_scores<T>& a, double coeff,
                                                global_aux_state& state, aux_loss_term<T>& out) {
  const auto E = static_cast<std::size_t>(a.num_experts);
  if (state.tokens_per_expert.empty()) state.tokens_per_expert.assign(E, 0.0);
  if (state.tokens_per_expert.size() != E)
    return make_error(
        errc::shape_mismatch,
        "global aux loss: the state has " +
            detail::to_decimal(static_cast<long long>(state.tokens_per_expert.size())) +
            " experts, the scores " + detail::to_decimal(a.num_experts));
  out.counts.resize(E);
  column_counts(std::span<const std::uint8_t>(a.map), std::span<double>(out.counts));
  if (auto s = detail::sum_counts(tp_dp_cp, std::span<double>(out.counts)); !s) return s;
  const double total = a.has_padding_mask ? detail::valid_tokens(out.counts, a.topk)
                                          : static_cast<double>(a.num_tokens) * tp_dp_cp.size();
  state.steps += 1;
  for (std::size_t e = 0; e < E; ++e) {
    state.tokens_per_expert[e] += out.counts[e];
    out.counts[e] = state.tokens_per_expert[e] / state.steps;  // the running average used
  }
  switch_load_balancing_into(std::span<const T>(a.scores), E, total, a.topk, a.num_experts, coeff,
                             1.0, out);
  return {};
}
template <communicator C, class T>
[[nodiscard]] expected<aux_loss_term<T>> global_load_balancing_loss(C& tp_dp_cp,
                                                                    const aux_scores<T>& a,
                                                                    double coeff,
                                                                    global_aux_state& state) {
  aux_loss_term<T> out;
  if (auto s = global_load_balancing_loss(tp_dp_cp, a, coeff, state, out); !s)
    return unexpected<error>(s.error());
  return out;
}

//! z-loss of this rank's tokens with the coefficient divided by |tp_cp|: the partials of the group
//! sum to the mean over the group (when every rank holds the same number of tokens, as under
//! sequence and context parallelism). No collective is needed.
template <communicator C, class T>
[[nodiscard]] expected<T> group_z_loss(const C& tp_cp, std::span<const T> logits, int num_experts,
                                       double coeff, std::span<const std::uint8_t> padding = {}) {
  return z_loss(logits, num_experts, coeff / tp_cp.size(), padding);
}

//! Gradient of group_z_loss (adds to dlogits).
template <communicator C, class T>
[[nodiscard]] status add_group_z_loss_gradient(const C& tp_cp, std::span<const T> logits,
                                               int num_experts, double coeff,
                                               std::span<const std::uint8_t> padding, T seed,
                                               std::span<T> dlogits) {
  return add_z_loss_gradient(logits, num_experts, coeff / tp_cp.size(), padding, seed, dlogits);
}
//! The same with the caller's scratch of E elements.
template <communicator C, class T>
[[nodiscard]] status add_group_z_loss_gradient(const C& tp_cp, std::span<const T> logits,
                                               int num_experts, double coeff,
                                               std::span<const std::uint8_t> padding, T seed,
                                               std::span<T> dlogits, std::span<T> scratch) {
  return add_z_loss_gradient(logits, num_experts, coeff / tp_cp.size(), padding, seed, dlogits,
                             scratch);
}

}  // namespace v0_1
}  // namespace moefold
