//! @file routing_view.hpp
//! @brief The host reference's routing record (tests only; the library's policies take
//! drop_input / drop_output views on a context): N tokens, their k selected experts and
//! probabilities, and the keep mask the host drop reference writes. The selection is never
//! rewritten (the router backward needs every selected expert); what was dropped is only the
//! mask.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <moefold/core/config.hpp>
#include <moefold/core/memory_space.hpp>
#include <moefold/routing/topk_routing.hpp>

namespace moefold {
inline namespace v0_1 {

//! One rank's routing: expert[t*k + i] and probs[t*k + i] are the i-th selected expert of token t
//! and its probability; keep[t*k + i] is 1 when that pair is dispatched (written by a drop
//! policy; a router leaves it to the policy). Views: valid while the caller's storage is.
template <class P, memory_space Space = host_space>
struct routing_view {
  using memory_space = Space;
  int num_tokens = 0;            //!< N
  int topk = 0;                  //!< k
  int num_experts = 0;           //!< E
  const int* expert = nullptr;   //!< [N, k] selected experts (distinct per token)
  const P* probs = nullptr;      //!< [N, k] their probabilities
  std::uint8_t* keep = nullptr;  //!< [N, k] 1: dispatched; 0: dropped by capacity

  [[nodiscard]] MOEFOLD_HOST_DEVICE std::size_t pairs() const noexcept {
    return static_cast<std::size_t>(num_tokens) * static_cast<std::size_t>(topk);
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int expert_of(std::size_t pair) const noexcept {
    return expert[pair];
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE P prob(std::size_t pair) const noexcept { return probs[pair]; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE bool kept(std::size_t pair) const noexcept {
    return keep[pair] != 0;
  }
};

//! The view of a host top-k routing with `keep` [N*k] as its mask (caller storage).
template <class P>
[[nodiscard]] routing_view<P> view_of(const topk_routing<P>& r,
                                      std::span<std::uint8_t> keep) noexcept {
  return {.num_tokens = r.num_tokens,
          .topk = r.topk,
          .num_experts = r.num_experts,
          .expert = r.indices.data(),
          .probs = r.probs.data(),
          .keep = keep.data()};
}

namespace detail {
//! The dispatcher's record form of a kept routing (host): expert [N*k] with -1 for a dropped
//! pair, probs [N*k] with 0 for one, converted to Q (the dispatcher's element type) once. Sizes
//! are the caller's to match (r.pairs() each).
template <class P, class Q = P>
void write_kept_pairs(const routing_view<P>& r, std::span<int> expert, std::span<Q> probs) {
  for (std::size_t p = 0; p < r.pairs(); ++p) {
    expert[p] = r.kept(p) ? r.expert_of(p) : -1;
    probs[p] = r.kept(p) ? static_cast<Q>(r.prob(p)) : Q(0);
  }
}
}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
