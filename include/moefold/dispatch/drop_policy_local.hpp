//! @file drop_policy_local.hpp
//! @brief The drop policies that decide from the rank's own tokens: dropless, and sub-sequence
//! dropping (Megatron-Core's only capacity mode; the paper's default).
#pragma once

#include <cstdint>
#include <span>

#include "capacity_keep.hpp"
#include "drop_args.hpp"
#include "drop_policy.hpp"
#include "drop_result.hpp"

namespace moefold {
inline namespace v0_1 {

//! Every routed pair is computed; nothing is dropped or padded.
struct dropless {
  //! On an execution context (dispatch/capacity_keep.hpp): the workspace for forwards up to
  //! `shape`, and the decision over this rank's tokens (tp_cp unused).
  template <class R>
  [[nodiscard]] std::size_t workspace_bytes(const drop_shape& shape) const {
    return detail::keep_workspace_bytes<R>(shape, false);
  }
  template <class R, class Exec, class Comm>
  [[nodiscard]] expected<drop_decision> apply(Exec& x, Comm& /*tp_cp*/,
                                              const drop_input<R, typename Exec::memory_space>& in,
                                              const drop_output<typename Exec::memory_space>& out,
                                              std::span<std::byte> ws) const {
    return detail::keep_on_context<false, R>(x, static_cast<Comm*>(nullptr), in, out, ws,
                                             detail::keep_rule{});
  }
  template <class T>
  [[nodiscard]] status apply(const routing_view<T>& r, drop_counts& out, drop_scratch<T>&) const {
    if (auto s = detail::check_routing(r); !s) return s;
    if (auto s = detail::check_counts(out, r.num_tokens, r.num_experts); !s) return s;
    std::fill(r.keep, r.keep + r.pairs(), std::uint8_t{1});
    detail::count_kept(r, 0, static_cast<std::size_t>(r.num_tokens), out);
    out.capacity.reset();
    out.pad_rows.reset();
    return {};
  }
  template <class C, class T>
  [[nodiscard]] status apply(C&, std::span<const std::int64_t>, const routing_view<T>& r,
                             drop_counts& out, drop_scratch<T>& ws) const {
    return apply(r, out, ws);
  }
  //! The dense form (tests).
  template <class T>
  [[nodiscard]] status apply(const topk_routing<T>& r, drop_result<T>& out) const {
    detail::no_comm none;
    return apply_dense(*this, none, {}, r, out);
  }
  template <class C, class T>
  [[nodiscard]] status apply(C& c, std::span<const std::int64_t> keys, const topk_routing<T>& r,
                             drop_result<T>& out) const {
    return apply_dense(*this, c, keys, r, out);
  }
};

//! Sub-sequence dropping: capacity C = ceil(N*k/E * capacity_factor) from this rank's N tokens and
//! the keep decision over them alone (no communication). Results depend on TP x CP.
struct sub_sequence {
  double capacity_factor = 1.0;
  bool pad_to_capacity = false;  //!< every expert gets exactly C rows (static shapes)
  drop_by by = drop_by::probs;

  //! On an execution context (dispatch/capacity_keep.hpp): the workspace for forwards up to
  //! `shape`, and the decision over this rank's tokens (tp_cp unused).
  template <class R>
  [[nodiscard]] std::size_t workspace_bytes(const drop_shape& shape) const {
    return detail::keep_workspace_bytes<R>(shape, false);
  }
  template <class R, class Exec, class Comm>
  [[nodiscard]] expected<drop_decision> apply(Exec& x, Comm& /*tp_cp*/,
                                              const drop_input<R, typename Exec::memory_space>& in,
                                              const drop_output<typename Exec::memory_space>& out,
                                              std::span<std::byte> ws) const {
    return detail::keep_on_context<false, R>(
        x, static_cast<Comm*>(nullptr), in, out, ws,
        detail::keep_rule{.capacity_factor = capacity_factor, .pad = pad_to_capacity, .by = by});
  }

  template <class T>
  [[nodiscard]] status apply(const routing_view<T>& r, drop_counts& out,
                             drop_scratch<T>& ws) const {
    if (auto s = detail::check_routing(r); !s) return s;
    if (auto s = detail::check_counts(out, r.num_tokens, r.num_experts); !s) return s;
    auto c = expert_capacity(static_cast<long long>(r.num_tokens) * r.topk, r.num_experts,
                             capacity_factor);
    if (!c) return unexpected<error>(c.error());
    if (pad_to_capacity && *c > r.num_tokens)
      return make_error(errc::invalid_argument,
                        "pad_to_capacity: capacity " + detail::to_decimal(*c) + " exceeds the " +
                            detail::to_decimal(r.num_tokens) +
                            " tokens, so no expert can be padded to it (lower capacity_factor "
                            "to at most num_experts/topk)");
    detail::keep_within_capacity(r, *c, by, pad_to_capacity, {}, 0,
                                 static_cast<std::size_t>(r.num_tokens), out, ws);
    out.capacity = *c;
    out.pad_rows = pad_to_capacity ? std::optional<int>(*c) : std::nullopt;
    return {};
  }
  template <class C, class T>
  [[nodiscard]] status apply(C&, std::span<const std::int64_t>, const routing_view<T>& r,
                             drop_counts& out, drop_scratch<T>& ws) const {
    return apply(r, out, ws);
  }
  //! The dense form (tests).
  template <class T>
  [[nodiscard]] status apply(const topk_routing<T>& r, drop_result<T>& out) const {
    detail::no_comm none;
    return apply_dense(*this, none, {}, r, out);
  }
  template <class C, class T>
  [[nodiscard]] status apply(C& c, std::span<const std::int64_t> keys, const topk_routing<T>& r,
                             drop_result<T>& out) const {
    return apply_dense(*this, c, keys, r, out);
  }
};

}  // namespace v0_1
}  // namespace moefold
