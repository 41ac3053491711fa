// A host expert_batch from vectors or spans (dispatch/expert_batch.hpp): the tests' shorthand for
// the row views an expert functor takes, x [M, H] and probs [M, 1] with M = probs.size(). A size
// that does not make [M, H] of x gives a view of another row count, which the experts refuse.
#pragma once

#include <moefold/dispatch/expert_batch.hpp>

#include <span>
#include <type_traits>

namespace moefold::test {

template <class X, class Pr>
auto host_batch(int hidden, std::span<const int> counts, const X& x, const Pr& probs) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(std::data(x))>>;
  using P = std::remove_cv_t<std::remove_pointer_t<decltype(std::data(probs))>>;
  const auto n = std::size(x);
  const int m = static_cast<int>(std::size(probs));
  const int rows = hidden > 0 && n % static_cast<std::size_t>(hidden) == 0
                       ? static_cast<int>(n / static_cast<std::size_t>(hidden))
                       : m + 1;
  return expert_batch<T, P>{.counts = counts,
                            .x = row_view<const T>(std::data(x), rows, hidden),
                            .probs = row_view<const P>(std::data(probs), m, 1)};
}

}  // namespace moefold::test
