//! @file drop_policy_local.hpp
//! @brief The drop policies that decide from the rank's own tokens: dropless, and sub-sequence
//! dropping (Megatron-Core's only capacity mode; the paper's default).
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "capacity_keep.hpp"
#include "drop_args.hpp"

namespace moefold {
inline namespace v0_1 {

//! Every routed pair is computed; nothing is dropped or padded.
struct dropless {
  //! Its rules for forwards up to `shape` (none).
  [[nodiscard]] status check(const drop_shape&) const { return {}; }
  //! It never pads.
  [[nodiscard]] std::optional<int> pad_rows_bound(const drop_shape&) const { return std::nullopt; }
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
};

//! Sub-sequence dropping: capacity C = ceil(N*k/E * capacity_factor) from this rank's N tokens and
//! the keep decision over them alone (no communication). Results depend on TP x CP.
struct sub_sequence {
  double capacity_factor = 1.0;
  bool pad_to_capacity = false;  //!< every expert gets exactly C rows (static shapes)
  drop_by by = drop_by::probs;

  //! Its rules for forwards up to `shape` (capacity factor finite and > 0, a drop-by value).
  [[nodiscard]] status check(const drop_shape& shape) const {
    return detail::check_keep_rule({.capacity_factor = capacity_factor, .by = by}, shape, false);
  }
  //! With pad_to_capacity, the most rows per expert for forwards up to `shape`.
  [[nodiscard]] std::optional<int> pad_rows_bound(const drop_shape& shape) const {
    return detail::pad_rows_bound(
        {.capacity_factor = capacity_factor, .pad = pad_to_capacity, .by = by}, shape, false);
  }
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
};

}  // namespace v0_1
}  // namespace moefold
