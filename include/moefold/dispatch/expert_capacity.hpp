//! @file expert_capacity.hpp
//! @brief The capacity of the dropping policies: C = ceil(pairs / E x capacity_factor), evaluated
//! in double as Megatron-Core does (docs/dispatch-semantics.md section 3).
#pragma once

#include <climits>
#include <cmath>

#include "../core/error.hpp"
#include "../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {

//! C = ceil(num_pairs / E * capacity_factor) (Megatron-Core `get_capacity`, in double as Python
//! evaluates it), with num_pairs = tokens * k. The factor must be finite and > 0: dropless is its
//! own policy, not a magic factor.
[[nodiscard]] inline expected<int> expert_capacity(long long num_pairs, int num_experts,
                                                   double capacity_factor) {
  if (!(std::isfinite(capacity_factor) && capacity_factor > 0))
    return make_error(errc::invalid_argument,
                      "capacity_factor must be finite and > 0 (use the dropless policy for no "
                      "capacity)");
  if (num_experts < 1 || num_pairs < 0)
    return make_error(errc::invalid_size, "capacity: need num_experts >= 1 and num_pairs >= 0");
  const double c = std::ceil((static_cast<double>(num_pairs) / num_experts) * capacity_factor);
  if (c > static_cast<double>(INT_MAX))
    return make_error(errc::overflow, "capacity does not fit in int");
  return static_cast<int>(c);
}

}  // namespace v0_1
}  // namespace moefold
