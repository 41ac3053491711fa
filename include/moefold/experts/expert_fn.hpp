//! @file expert_fn.hpp
//! @brief The expert functor concept, one for every execution context: the dispatcher hands an
//! expert functor all rows routed to this rank's local experts, grouped by local expert
//! (dispatch/expert_batch.hpp, in the context's memory), and gets back their (partial) outputs;
//! the backward gives input and probability gradients and accumulates the functor's weight
//! gradients. mlp_experts (experts/mlp_experts.hpp) is moefold's; a user type plugs into a layer
//! by modelling the same concept.
//!
//! The context is passed to every call and the scratch comes from the caller (a workspace in the
//! context's memory, sized by the functor's `workspace_bytes(rows)`), so that one functor serves
//! forwards in flight on several streams and never allocates behind the caller's back.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../dispatch/expert_batch.hpp"
#include "../exec/exec.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {
// A functor that keeps part of its forward for its backward says so by declaring saved_bytes:
// the one test the protocol, the layer's calls and the storage's sizing share.
template <class E>
concept declares_saved_bytes = requires(const E& ce, int rows) {
  { ce.saved_bytes(rows) } -> std::convertible_to<std::size_t>;
};
}  // namespace detail

//! What an expert functor E provides on execution context Exec for rows of T and probabilities
//! of P (S = Exec's memory space):
//! - `num_local_experts()`, `hidden()`: L and H, which the layer checks against its options;
//! - `forward(exec, batch, y, workspace)`: writes y [M, H]; under expert tensor parallelism this
//!   shard's partial sum, which the dispatcher's ReduceScatter completes;
//! - `backward(exec, batch, dy, dx, dprobs, workspace)`: from dy [M, H] writes dx [M, H] and
//!   dprobs [M, 1] (partials under ETP, summed by the dispatcher) and adds (beta = 1) the weight
//!   gradients into the functor's gradient buffers;
//!   (y, dy and dx may have a row stride above H, rows 16 bytes apart: read them through
//!   row_data/stride, not flat());
//! - or, for a functor that keeps part of its forward for its backward (keeps_activations below:
//!   mlp_experts keeps fc1's output), `saved_bytes(rows)` and the same two calls with a `saved`
//!   span before the workspace, which the caller gives the forward and, untouched, its backward;
//! - optionally `workspace_bytes(rows)`: the bytes of the context's memory either call takes as
//!   its workspace for a batch of at most `rows` rows (none when absent:
//!   expert_workspace_bytes()).
//! Every call returns a status, an error naming the rule broken for a bad batch.
template <class E, class Exec, class T, class P = T>
concept expert_fn = execution_context<Exec> && requires(const E& ce) {
  { ce.num_local_experts() } -> std::same_as<int>;
  { ce.hidden() } -> std::same_as<int>;
} &&(requires(E& e, Exec& x, const expert_batch<T, P, typename Exec::memory_space>& b,
              row_view<T, typename Exec::memory_space> out,
              row_view<const T, typename Exec::memory_space> in,
              row_view<P, typename Exec::memory_space> dprobs, std::span<std::byte> ws) {
  { e.forward(x, b, out, ws) } -> std::same_as<status>;
  { e.backward(x, b, in, out, dprobs, ws) } -> std::same_as<status>;
} || (detail::declares_saved_bytes<E> &&
      requires(E & e, Exec& x, const expert_batch<T, P, typename Exec::memory_space>& b,
               row_view<T, typename Exec::memory_space> out,
               row_view<const T, typename Exec::memory_space> in,
               row_view<P, typename Exec::memory_space> dprobs, std::span<std::byte> saved,
               std::span<std::byte> ws) {
        { e.forward(x, b, out, saved, ws) } -> std::same_as<status>;
        { e.backward(x, b, in, out, dprobs, saved, ws) } -> std::same_as<status>;
      }));

//! An expert functor whose forward leaves `saved_bytes(rows)` bytes of the context's memory for
//! its backward (in storage the caller owns, one per forward in flight), so that the backward
//! need not recompute them.
template <class E, class Exec, class T, class P = T>
concept keeps_activations = expert_fn<E, Exec, T, P> && detail::declares_saved_bytes<E>;

//! Experts that expose their gradient buffers as views of G in memory space S (mlp_experts and
//! reference_mlp: `grads().fc1`, `grads().fc2`), which a layer then reduces over EDP without a
//! list from the caller.
template <class E, class G, class S>
concept exposes_expert_grads = requires(const E& e) {
  { e.grads().fc1 } -> std::convertible_to<row_view<G, S>>;
  { e.grads().fc2 } -> std::convertible_to<row_view<G, S>>;
};

//! The workspace an expert functor's calls take for batches of at most `rows` rows: its
//! `workspace_bytes(rows)`, or 0 for a functor that declares none.
template <class E>
[[nodiscard]] std::size_t expert_workspace_bytes(const E& e, int rows) {
  if constexpr (requires {
                  { e.workspace_bytes(rows) } -> std::convertible_to<std::size_t>;
                })
    return e.workspace_bytes(rows);
  else
    return 0;
}

//! The bytes a forward of an expert functor keeps for its backward for batches of at most `rows`
//! rows: its `saved_bytes(rows)`, or 0 for a functor that keeps nothing.
template <class E>
[[nodiscard]] std::size_t expert_saved_bytes(const E& e, int rows) {
  if constexpr (detail::declares_saved_bytes<E>)
    return e.saved_bytes(rows);
  else
    return 0;
}

namespace detail {
// The forward and backward of either form: a functor that keeps activations gets `saved` (the
// same span for a forward and its backward), one that keeps none does not.
template <class E, class Exec, class B, class Y>
[[nodiscard]] status expert_forward(E& e, Exec& x, const B& b, Y y, std::span<std::byte> saved,
                                    std::span<std::byte> ws) {
  if constexpr (declares_saved_bytes<E>)
    return e.forward(x, b, y, saved, ws);
  else
    return e.forward(x, b, y, ws);
}
template <class E, class Exec, class B, class DY, class DX, class DP>
[[nodiscard]] status expert_backward(E& e, Exec& x, const B& b, DY dy, DX dx, DP dprobs,
                                     std::span<std::byte> saved, std::span<std::byte> ws) {
  if constexpr (declares_saved_bytes<E>)
    return e.backward(x, b, dy, dx, dprobs, saved, ws);
  else
    return e.backward(x, b, dy, dx, dprobs, ws);
}
}  // namespace detail

//! Checks a batch against an expert functor of L local experts and hidden size H, `who` naming
//! it in the messages: the row ranges (L counts >= 0 summing to M < 2^31, or offsets [1, L + 1]
//! on the context), x [M, H] and probs [M, 1] contiguous. Functors call it first, so every
//! implementation rejects bad input the same way; their outputs' shapes they check themselves.
template <class T, class P, class S>
[[nodiscard]] status check_expert_batch(const expert_batch<T, P, S>& b, int local_experts,
                                        int hidden, const char* who) {
  using detail::to_decimal;
  const auto fail = [&](errc code, const std::string& what) {
    return status(make_error(code, std::string(who) + ": " + what));
  };
  const int M = b.x.rows();
  if (b.offsets_on_context()) {
    if (b.offsets.rows() != 1 || b.offsets.width() != local_experts + 1)
      return fail(errc::shape_mismatch,
                  "offsets must be [1, L + 1] = [1, " + to_decimal(local_experts + 1) + "] (got [" +
                      to_decimal(b.offsets.rows()) + ", " + to_decimal(b.offsets.width()) + "])");
  } else {
    if (static_cast<long long>(b.counts.size()) != local_experts)
      return fail(errc::shape_mismatch,
                  "counts has " + to_decimal(static_cast<long long>(b.counts.size())) +
                      " entries for " + to_decimal(local_experts) + " local experts");
    long long m = 0;
    for (int c : b.counts) {
      if (c < 0) return fail(errc::invalid_argument, "a negative row count in counts");
      m += c;
    }
    if (m > 0x7fffffffLL) return fail(errc::invalid_size, "more than 2^31 - 1 rows");
    if (m != M || b.x.width() != hidden)
      return fail(errc::shape_mismatch, "x must be [M, H] = [" + to_decimal(m) + ", " +
                                            to_decimal(hidden) + "], M = sum(counts) (got [" +
                                            to_decimal(M) + ", " + to_decimal(b.x.width()) + "])");
  }
  if (b.x.width() != hidden)
    return fail(errc::shape_mismatch, "x must be [M, H] with H = " + to_decimal(hidden) +
                                          " (got width " + to_decimal(b.x.width()) + ")");
  if (b.probs.rows() != M || b.probs.width() != 1 || !b.probs.contiguous())
    return fail(errc::shape_mismatch, "probs must be contiguous [M, 1], M = " + to_decimal(M) +
                                          " (got [" + to_decimal(b.probs.rows()) + ", " +
                                          to_decimal(b.probs.width()) + "])");
  return {};
}

}  // namespace v0_1
}  // namespace moefold
