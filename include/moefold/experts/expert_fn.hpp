//! @file expert_fn.hpp
//! @brief The expert functor concept: the dispatcher hands an expert functor all rows routed to
//! this rank's local experts, grouped by local expert, and gets back their (partial) outputs; the
//! backward gives input and probability gradients and accumulates the functor's weight gradients.
#pragma once

#include <concepts>
#include <span>

#include "../core/expected.hpp"
#include "../dispatch/expert_batch.hpp"

namespace moefold {
inline namespace v0_1 {

//! What an expert functor provides. `forward` writes y [M, H]; under expert tensor parallelism
//! it is this shard's partial sum, which the dispatcher's ReduceScatter completes. `backward`
//! takes dy [M, H] and writes dx [M, H] and dprobs [M] (partials under ETP, summed by the
//! dispatcher), and adds the weight gradients into the functor's own gradient buffers. P is the
//! probabilities' element type (the batch's probs and the backward's dprobs [M]).
template <class E, class T, class P = T>
concept expert_fn = requires(E& e, const E& ce, const expert_batch<T, P>& b, std::span<T> out,
                             std::span<const T> in, std::span<P> dprobs) {
  { ce.num_local_experts() } -> std::same_as<int>;
  { ce.hidden() } -> std::same_as<int>;
  { e.forward(b, out) } -> std::same_as<status>;
  { e.backward(b, in, out, dprobs) } -> std::same_as<status>;
};

//! Checks a batch against an expert functor's shape: L counts >= 0, x [M, H], probs [M], and
//! outputs of the same sizes. Functors call it first, so every implementation rejects bad input
//! the same way.
template <class T, class P>
[[nodiscard]] status check_expert_batch(const expert_batch<T, P>& b, int local_experts, int hidden,
                                        std::span<const std::size_t> output_sizes_in_rows_h,
                                        std::span<const std::size_t> output_sizes_in_rows) {
  using detail::to_decimal;
  if (b.hidden != hidden)
    return make_error(errc::shape_mismatch, "experts: batch hidden size " + to_decimal(b.hidden) +
                                                " but the experts have " + to_decimal(hidden));
  if (static_cast<int>(b.counts.size()) != local_experts)
    return make_error(errc::shape_mismatch, "experts: " + to_decimal(b.counts.size()) +
                                                " counts for " + to_decimal(local_experts) +
                                                " local experts");
  long long m = 0;
  for (int c : b.counts) {
    if (c < 0) return make_error(errc::invalid_argument, "experts: a negative row count");
    m += c;
  }
  const auto rows = static_cast<std::size_t>(m);
  const auto h = static_cast<std::size_t>(hidden);
  bool ok = b.x.size() == rows * h && b.probs.size() == rows;
  for (std::size_t s : output_sizes_in_rows_h) ok = ok && s == rows * h;
  for (std::size_t s : output_sizes_in_rows) ok = ok && s == rows;
  if (!ok)
    return make_error(errc::shape_mismatch,
                      "experts: buffers do not match sum(counts) = " + to_decimal(m) +
                          " rows of hidden size " + to_decimal(hidden) +
                          " (x and outputs [M, H], probs and dprobs [M])");
  return {};
}

}  // namespace v0_1
}  // namespace moefold
