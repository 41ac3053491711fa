//! @file expert_batch.hpp
//! @brief What a dispatcher hands the experts: the rows routed to this rank's local experts,
//! grouped by local expert, in the memory space of the dispatcher's execution context (the
//! dispatcher's output; experts/expert_fn.hpp consumes it). One type for every context: on
//! host_exec the views are host memory, on cpu_exec and cuda_exec the context's.
//!
//! Where the row ranges are: the host knows the rows per local expert (`counts`, what a dispatch
//! that exchanged counts has anyway), or only the context does (`offsets`, the first row of each
//! local expert on the context: a dropless dispatch with EP = ETP = 1 reads nothing back). The
//! experts take either; nothing is read back to learn them.
#pragma once

#include <span>

#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"

namespace moefold {
inline namespace v0_1 {

//! Rows grouped by local expert: rows [offset_l, offset_l + rows_l) belong to local expert l,
//! offset_l being the running sum of the rows before. T is the rows' element type, P the
//! probabilities' (T, or wider: fp32 with bf16 rows), Space the memory space of `x`, `probs` and
//! `offsets`.
//!
//! Give the row ranges as `counts` (host memory) or, with `counts` empty, as `offsets`
//! (context memory): offsets [1, L + 1] non-decreasing from 0 with offsets[L] <= M; rows past
//! offsets[L] belong to no expert, and the experts leave their outputs unspecified.
template <class T, class P = T, memory_space Space = host_space>
struct expert_batch {
  using value_type = T;
  using prob_type = P;
  using space = Space;

  std::span<const int> counts{};         //!< [L] rows per local expert (zeros allowed), host
  row_view<const T, Space> x{};          //!< [M, H] input rows (any row stride)
  row_view<const P, Space> probs{};      //!< [M, 1] router probability of each row (contiguous),
                                         //!< applied after the activation and before fc2
  row_view<const int, Space> offsets{};  //!< [1, L + 1] with counts empty (see above)

  //! M, the rows of the batch.
  [[nodiscard]] constexpr int rows() const noexcept { return x.rows(); }
  //! H, the rows' width.
  [[nodiscard]] constexpr int hidden() const noexcept { return x.width(); }
  //! True when the row ranges are on the context only (`offsets`, counts empty).
  [[nodiscard]] constexpr bool offsets_on_context() const noexcept {
    return counts.empty() && !offsets.empty();
  }
};

}  // namespace v0_1
}  // namespace moefold
