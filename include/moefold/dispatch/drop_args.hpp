//! @file drop_args.hpp
//! @brief What a drop policy works on, on an execution context: one forward's routing in (each
//! token's k experts and probabilities, and for full-sequence dropping the tokens' order keys),
//! the decision out (the keep mask, the kept record the dispatcher takes, the per-expert counts
//! and totals), all views in the context's memory space S; and the shape a policy sizes its
//! workspace for.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"

namespace moefold {
inline namespace v0_1 {

//! The largest forward a policy's workspace serves.
struct drop_shape {
  int max_tokens = 0;   //!< N per rank
  int topk = 0;         //!< k
  int num_experts = 0;  //!< E
  int group = 1;        //!< ranks of the tp-cp group (full-sequence dropping decides over them)
};

//! One forward's routing (the router's indices and probabilities, every selected pair).
template <class R, class S>
struct drop_input {
  row_view<const int, S> experts{};              //!< [N, k] distinct per token
  row_view<const R, S> probs{};                  //!< [N, k]
  row_view<const std::int64_t, S> order_keys{};  //!< [N, 1] (full sequence) or empty
};

//! The decision, written by the policy.
template <class S>
struct drop_output {
  row_view<std::uint8_t, S> keep{};        //!< [N, k] 1 dispatched, 0 dropped
  row_view<int, S> kept{};                 //!< [N, k] the expert, or -1 for a dropped pair
  row_view<int, S> routed{};               //!< [1, E] pairs the router sent to each expert
  row_view<int, S> dropped{};              //!< [1, E] of those, beyond capacity
  row_view<int, S> padded{};               //!< [1, E] zero-probability filler rows (pad mode)
  row_view<long long, S> totals{};         //!< [1, 2] dropped pairs, tokens that lost all k
  row_view<std::uint8_t, S> filler_map{};  //!< [N, E] 1 where a filler row sits, or empty
  //! [1, 3] or empty: sticky fault words every decision lowers (atomic min) and none resets:
  //! {the first routing pair naming an expert outside [0, E) or one its token already named, the
  //! first row of the group whose order key is outside [0, M), the first key no row or two rows
  //! hold}; kernels::order_fault_none (INT_MAX) means none. The caller sets them once and reads
  //! them when it checks its device status: on device memory (cuda_exec, cpu_exec) the policy
  //! reads nothing back, so these words are where a bad routing or bad keys surface (host_exec
  //! also reports at once). Without them a device context's faults are lost with the workspace.
  row_view<int, S> faults{};
};

//! What the host learns of a decision without reading the context's memory.
struct drop_decision {
  std::optional<int> capacity{};  //!< C per expert; unset when unbounded (dropless)
  std::optional<int> pad_rows{};  //!< pad mode: every expert's rows per rank; else unset
};

//! A drop policy on an execution context: the workspace it needs for forwards up to a shape (in
//! the context's memory, dead after the call), and the decision for one forward, collective over
//! the tp-cp communicator for a policy that decides over the group (a local one ignores it).
//! dropless, sub_sequence and full_sequence model it; a user policy writes the keep mask and the
//! rest of drop_output itself.
template <class P, class R, class Exec, class Comm>
concept drop_policy = requires(const P& p, Exec& x, Comm& tp_cp,
                               const drop_input<R, typename Exec::memory_space>& in,
                               const drop_output<typename Exec::memory_space>& out,
                               std::span<std::byte> ws, const drop_shape& shape) {
  { p.template workspace_bytes<R>(shape) } -> std::same_as<std::size_t>;
  { p.apply(x, tp_cp, in, out, ws) } -> std::same_as<expected<drop_decision>>;
};

//! A policy may state its rules for forwards up to a shape (`check(shape) -> status`, as
//! moefold's policies do): a layer checks them when it is made, so a bad policy is refused before
//! any forward. A policy without `check` passes.
template <class P>
[[nodiscard]] status check_drop_policy(const P& p, const drop_shape& shape) {
  if constexpr (requires {
                  { p.check(shape) } -> std::same_as<status>;
                })
    return p.check(shape);
  else
    return {};
}

//! A policy that pads (pad mode: every expert gets exactly pad_rows rows) may state the most rows
//! per expert it gives for forwards up to a shape (`pad_rows_bound(shape) -> optional<int>`, as
//! moefold's policies do): a layer then sizes its buffers for it when it is made and never grows
//! them in a forward. nullopt: the policy does not pad, or states no bound (a user policy without
//! it: the layer's receive bound then limits pad mode's rows).
template <class P>
[[nodiscard]] std::optional<int> drop_pad_rows_bound(const P& p, const drop_shape& shape) {
  if constexpr (requires {
                  { p.pad_rows_bound(shape) } -> std::same_as<std::optional<int>>;
                })
    return p.pad_rows_bound(shape);
  else
    return std::nullopt;
}

}  // namespace v0_1
}  // namespace moefold
