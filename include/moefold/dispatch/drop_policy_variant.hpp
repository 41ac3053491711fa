//! @file drop_policy_variant.hpp
//! @brief One of moefold's three drop policies, chosen at run time. A trainer picks dropless,
//! sub-sequence or full-sequence dropping from its configuration; with this policy one layer type
//! serves all three (one instantiation to compile instead of three), and switching costs nothing
//! per forward but a branch.
#pragma once

#include <cstddef>
#include <span>
#include <variant>

#include "drop_args.hpp"
#include "drop_policy_full_sequence.hpp"
#include "drop_policy_local.hpp"

namespace moefold {
inline namespace v0_1 {

//! dropless, sub_sequence or full_sequence, held by value and forwarded to. Converts implicitly
//! from each, so `layer_t::make(exec, options, sub_sequence{...}, ...)` reads as with the policy
//! itself. Like every policy it must be the same on every rank of the tp-cp group: full-sequence
//! dropping is collective over it.
struct drop_policy_variant {
  std::variant<dropless, sub_sequence, full_sequence> policy{};

  drop_policy_variant() = default;
  drop_policy_variant(dropless p) : policy(p) {}       // NOLINT(google-explicit-constructor)
  drop_policy_variant(sub_sequence p) : policy(p) {}   // NOLINT(google-explicit-constructor)
  drop_policy_variant(full_sequence p) : policy(p) {}  // NOLINT(google-explicit-constructor)

  //! The chosen policy's rules for forwards up to `shape`.
  [[nodiscard]] status check(const drop_shape& shape) const {
    return std::visit([&](const auto& p) { return p.check(shape); }, policy);
  }
  //! The chosen policy's most rows per expert in pad mode (nullopt: it does not pad).
  [[nodiscard]] std::optional<int> pad_rows_bound(const drop_shape& shape) const {
    return std::visit([&](const auto& p) { return p.pad_rows_bound(shape); }, policy);
  }
  //! The chosen policy's workspace for forwards up to `shape`.
  template <class R>
  [[nodiscard]] std::size_t workspace_bytes(const drop_shape& shape) const {
    return std::visit([&](const auto& p) { return p.template workspace_bytes<R>(shape); }, policy);
  }

  //! The chosen policy's decision (collective over tp_cp for full-sequence dropping).
  template <class R, class Exec, class Comm>
  [[nodiscard]] expected<drop_decision> apply(Exec& x, Comm& tp_cp,
                                              const drop_input<R, typename Exec::memory_space>& in,
                                              const drop_output<typename Exec::memory_space>& out,
                                              std::span<std::byte> ws) const {
    return std::visit([&](const auto& p) { return p.apply(x, tp_cp, in, out, ws); }, policy);
  }
};

}  // namespace v0_1
}  // namespace moefold
