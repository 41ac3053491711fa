//! @file topk_routing.hpp
//! @brief The routing of N tokens as host records: each token's k experts and probabilities
//! (topk_router::route's indices and probs, read into vectors), with Megatron-Core's dense views
//! on demand; and the finiteness rule the layer applies to logits before routing.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"

namespace moefold {
inline namespace v0_1 {

//! The routing of N tokens: for each token its k experts (sorted by selection score, descending,
//! ties by lower expert index) and their probabilities. Dense views as Megatron-Core builds them
//! (`probs_sparse [N,E]`, `routing_map [N,E]`) are available on demand.
template <class T>
struct topk_routing {
  int num_tokens = 0;
  int num_experts = 0;
  int topk = 0;
  std::vector<int> indices{};  // [N, k]
  std::vector<T> probs{};      // [N, k]

  [[nodiscard]] int expert(int t, int i) const {
    return indices[static_cast<std::size_t>(t) * static_cast<std::size_t>(topk) +
                   static_cast<std::size_t>(i)];
  }
  [[nodiscard]] T prob(int t, int i) const {
    return probs[static_cast<std::size_t>(t) * static_cast<std::size_t>(topk) +
                 static_cast<std::size_t>(i)];
  }
  //! probs scattered to [N, E], zero outside the selection.
  [[nodiscard]] std::vector<T> dense_probs() const {
    std::vector<T> out(static_cast<std::size_t>(num_tokens) *
                       static_cast<std::size_t>(num_experts));
    for (int t = 0; t < num_tokens; ++t)
      for (int i = 0; i < topk; ++i)
        out[static_cast<std::size_t>(t) * static_cast<std::size_t>(num_experts) +
            static_cast<std::size_t>(expert(t, i))] = prob(t, i);
    return out;
  }
  //! The routing map [N, E] (1 where routed).
  [[nodiscard]] std::vector<std::uint8_t> dense_map() const {
    std::vector<std::uint8_t> out(static_cast<std::size_t>(num_tokens) *
                                  static_cast<std::size_t>(num_experts));
    for (int t = 0; t < num_tokens; ++t)
      for (int i = 0; i < topk; ++i)
        out[static_cast<std::size_t>(t) * static_cast<std::size_t>(num_experts) +
            static_cast<std::size_t>(expert(t, i))] = 1;
    return out;
  }
};

namespace detail {
template <class T>
[[nodiscard]] status check_finite(std::span<const T> x, const char* what) {
  for (std::size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i]))
      return make_error(errc::non_finite_input, std::string(what) + ": element " +
                                                    to_decimal(static_cast<long long>(i)) +
                                                    " is NaN or infinite");
  return {};
}
//! check_finite over rows where the host reads the context's memory (host memory); on device
//! memory nothing is read back (the router's kernels meet non-finite logits there).
template <class T, memory_space S>
[[nodiscard]] status check_finite_rows(row_view<const T, S> v, const char* what) {
  if constexpr (host_accessible_v<S>) {
    for (int r = 0; r < v.rows(); ++r)
      if (auto st = check_finite(std::span<const T>(v.row(r)), what); !st) return st;
  }
  return {};
}
template <class T>
[[nodiscard]] status check_logits_shape(std::span<const T> logits, int num_tokens,
                                        int num_experts) {
  if (num_tokens < 0)
    return make_error(errc::invalid_size,
                      "router: num_tokens must be >= 0 (got " + to_decimal(num_tokens) + ")");
  if (logits.size() != static_cast<std::size_t>(num_tokens) * static_cast<std::size_t>(num_experts))
    return make_error(errc::shape_mismatch,
                      "router: logits must hold num_tokens*num_experts = " +
                          to_decimal(static_cast<long long>(num_tokens) * num_experts) +
                          " elements (got " + to_decimal(static_cast<long long>(logits.size())) +
                          ")");
  return {};
}
}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
