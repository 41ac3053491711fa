//! @file expert_batch.hpp
//! @brief What a dispatcher hands the experts: the rows routed to this rank's local experts,
//! grouped by local expert (the dispatcher's output; experts/expert_fn.hpp consumes it).
#pragma once

#include <span>

namespace moefold {
inline namespace v0_1 {

//! Rows grouped by local expert: rows [offset_l, offset_l + counts[l]) belong to local expert l,
//! offsets being the running sum of counts. M = sum(counts). T is the rows' element type, P the
//! probabilities' (T, or wider: fp32 with bf16 rows).
template <class T, class P = T>
struct expert_batch {
  int hidden = 0;                 //!< H
  std::span<const int> counts{};  //!< [L] rows per local expert (zeros allowed)
  std::span<const T> x{};         //!< [M, H] input rows
  std::span<const P> probs{};     //!< [M] router probability of each row, applied after the
                                  //!< activation and before fc2 (docs/dispatch-semantics.md 4.6)
};

}  // namespace v0_1
}  // namespace moefold
