//! @file drop_counts.hpp
//! @brief What a drop decision counted, as the host sees it for logging: per expert the routed,
//! dropped and padded pairs, the capacity and the pad rows (moe_forward_stats::dropped). The
//! decision itself runs on a context (drop_args.hpp, capacity_keep.hpp). Semantics:
//! docs/dispatch-semantics.md section 3.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace moefold {
inline namespace v0_1 {

//! What a policy dropped, per expert, for logging and tests.
struct drop_report {
  std::optional<int> capacity{};  //!< C per expert; unset when unbounded (dropless)
  std::vector<int> routed{};      //!< [E] pairs the router sent to each expert
  std::vector<int> dropped{};     //!< [E] routed pairs beyond capacity
  std::vector<int> padded{};      //!< [E] zero-probability filler rows (pad mode)
  long long dropped_pairs = 0;    //!< sum of dropped
  int fully_dropped_tokens = 0;   //!< tokens that lost all k experts

  //! The rows expert e receives from this rank's tokens (drop_counts::dispatched).
  [[nodiscard]] int dispatched(std::size_t e) const noexcept {
    return routed[e] - dropped[e] + padded[e];
  }
};

//! The counts of one decision over caller storage, so that a step allocates nothing. `routed`,
//! `dropped` and `padded` [E] are required; `filler_map` [N, E] is optional (empty: not wanted) and
//! marks the pad-mode filler rows, which Megatron-Core's dense `routing_map` holds (tests compare
//! it).
struct drop_counts {
  std::span<int> routed{};               //!< [E] pairs the router sent to each expert
  std::span<int> dropped{};              //!< [E] routed pairs beyond capacity
  std::span<int> padded{};               //!< [E] zero-probability filler rows (pad mode)
  std::span<std::uint8_t> filler_map{};  //!< [N, E] or empty: 1 where a filler row sits
  std::optional<int> capacity{};         //!< C per expert; unset when unbounded (dropless)
  //! Pad mode: the rows per expert the dispatcher pads this rank's column to (its kept pairs,
  //! then zero rows of probability 0, which contribute nothing: docs/dispatch-semantics.md 3.3),
  //! giving static shapes; unset without padding. Sub-sequence: C. Full-sequence: the group's C,
  //! because a rank may hold up to all C kept rows of a column (static shapes cost |TP x CP| x the
  //! rows). dispatch_input::capacity takes it.
  std::optional<int> pad_rows{};
  long long dropped_pairs = 0;   //!< sum of dropped
  int fully_dropped_tokens = 0;  //!< tokens that lost all k experts

  //! The rows expert e receives from this rank's tokens: kept pairs plus fillers (what
  //! Megatron-Core's post-drop map counts, and the expert bias learns from).
  [[nodiscard]] int dispatched(std::size_t e) const noexcept {
    return routed[e] - dropped[e] + padded[e];
  }
  //! An owning copy, for logging and tests (allocates).
  [[nodiscard]] drop_report to_report() const {
    return {.capacity = capacity,
            .routed = {routed.begin(), routed.end()},
            .dropped = {dropped.begin(), dropped.end()},
            .padded = {padded.begin(), padded.end()},
            .dropped_pairs = dropped_pairs,
            .fully_dropped_tokens = fully_dropped_tokens};
  }
};

//! drop_counts over a drop_report's vectors (resized to E; no allocation once they have grown).
[[nodiscard]] inline drop_counts counts_into(drop_report& r, int num_experts,
                                             std::span<std::uint8_t> filler_map = {}) {
  const auto E = static_cast<std::size_t>(num_experts < 0 ? 0 : num_experts);
  r.routed.resize(E);
  r.dropped.resize(E);
  r.padded.resize(E);
  return {.routed = r.routed, .dropped = r.dropped, .padded = r.padded, .filler_map = filler_map};
}

}  // namespace v0_1
}  // namespace moefold
