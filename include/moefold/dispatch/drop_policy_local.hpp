//! @file drop_policy_local.hpp
//! @brief The drop policies that decide from the rank's own tokens: dropless, and sub-sequence
//! dropping (Megatron-Core's only capacity mode; the paper's default).
#pragma once

#include <cstdint>
#include <span>

#include "drop_policy.hpp"

namespace moefold {

//! Every routed pair is computed; nothing is dropped or padded.
struct dropless {
  template <class T>
  [[nodiscard]] status apply(const topk_routing<T>& r, drop_result<T>& out) const {
    if (auto s = detail::check_routing(r); !s) return s;
    detail::keep_within_capacity(r, r.num_tokens, drop_by::position, false, {}, out);
    out.report.capacity = -1;
    return {};
  }
  template <class C, class T>
  [[nodiscard]] status apply(C&, std::span<const std::int64_t>, const topk_routing<T>& r,
                             drop_result<T>& out) const {
    return apply(r, out);
  }
};

//! Sub-sequence dropping: capacity C = ceil(N*k/E * capacity_factor) from this rank's N tokens and
//! the keep decision over them alone (no communication). Results depend on TP x CP.
struct sub_sequence {
  double capacity_factor = 1.0;
  bool pad_to_capacity = false;  //!< every expert gets exactly C rows (static shapes)
  drop_by by = drop_by::probs;

  template <class T>
  [[nodiscard]] status apply(const topk_routing<T>& r, drop_result<T>& out) const {
    if (auto s = detail::check_routing(r); !s) return s;
    auto c = expert_capacity(static_cast<long long>(r.num_tokens) * r.topk, r.num_experts,
                             capacity_factor);
    if (!c) return unexpected<error>(c.error());
    if (pad_to_capacity && *c > r.num_tokens)
      return make_error(errc::invalid_argument,
                        "pad_to_capacity: capacity " + detail::to_decimal(*c) + " exceeds the " +
                            detail::to_decimal(r.num_tokens) +
                            " tokens, so no expert can be padded to it (lower capacity_factor "
                            "to at most num_experts/topk)");
    detail::keep_within_capacity(r, *c, by, pad_to_capacity, {}, out);
    return {};
  }
  template <class C, class T>
  [[nodiscard]] status apply(C&, std::span<const std::int64_t>, const topk_routing<T>& r,
                             drop_result<T>& out) const {
    return apply(r, out);
  }
};

}  // namespace moefold
