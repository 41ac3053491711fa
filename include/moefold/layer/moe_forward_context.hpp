//! @file moe_forward_context.hpp
//! @brief What one forward of an MoE layer leaves for its backward: the dispatch handle, views of
//! the saved activations (in storage the caller owns), the routing record and the auxiliary
//! losses' terms. Any number of contexts may be in flight (pipeline schedules, autograd running
//! two forwards before either backward, activation recomputation).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dispatch/drop_counts.hpp"
#include "../routing/load_balancing_losses.hpp"
#include "../routing/router_z_loss.hpp"
#include "../routing/topk_routing.hpp"

namespace moefold {
inline namespace v0_1 {

//! Bytes of the storage one forward in flight keeps until its backward (moe_layer::saved_sizes).
struct moe_saved_bytes {
  std::size_t saved = 0;  //!< in the layer's context memory
  std::size_t host = 0;   //!< host memory (the dispatcher's bookkeeping)
};

//! The caller's storage for one forward in flight: give each forward its own, until its backward
//! has run (or until the caller drops it and recomputes). On host contexts both parts may be
//! pieces of one buffer.
struct moe_saved_storage {
  std::span<std::byte> saved{};  //!< >= moe_saved_bytes::saved
  std::span<std::byte> host{};   //!< >= moe_saved_bytes::host
};

//! What a forward reports: this rank's partial losses (each sums over tp-cp to the layer's; zero
//! in evaluation) and what the drop policy dropped (views of the context's counts, valid until its
//! next forward; `dropped.to_report()` copies them).
struct moe_forward_stats {
  double aux_loss = 0.0;         //!< per micro-batch
  double seq_aux_loss = 0.0;     //!< per sequence
  double global_aux_loss = 0.0;  //!< per global batch (running average of the counts)
  double z_loss = 0.0;
  drop_counts dropped{};
};

//! d(training loss) / d(each output of a forward), so a caller can weight or drop each loss.
//! The main output's gradient is dout itself; `output` scales it (1: as given, 0: drop it).
template <class T>
struct moe_loss_seeds {
  T output = T(1);      //!< the routed and shared experts' output
  T aux = T(1);         //!< micro-batch load-balancing loss
  T seq_aux = T(1);     //!< per-sequence load-balancing loss
  T global_aux = T(1);  //!< global-batch load-balancing loss
  T z = T(1);           //!< z-loss
};

//! One forward of `Layer` in flight. Made empty by the caller, filled by Layer::forward (which
//! reuses its records' capacity: a context kept per micro-batch slot allocates nothing in steady
//! state), consumed by Layer::backward. It refers to the storage its forward was given.
template <class Layer>
class moe_forward_context {
 public:
  using value_type = typename Layer::value_type;                // tokens
  using router_value_type = typename Layer::router_value_type;  // logits, probabilities, losses
  using handle_type = typename Layer::dispatcher_type::handle_type;

  // Move-only: a copy would let one forward be backwarded twice (its gradients counted twice).
  // A moved-from context holds no forward.
  moe_forward_context() = default;
  moe_forward_context(const moe_forward_context&) = delete;
  moe_forward_context& operator=(const moe_forward_context&) = delete;
  moe_forward_context(moe_forward_context&& o) noexcept(
      std::is_nothrow_move_constructible_v<topk_routing<router_value_type>>)
      : moe_forward_context() {
    *this = std::move(o);
  }
  moe_forward_context& operator=(moe_forward_context&& o) noexcept(
      std::is_nothrow_move_assignable_v<topk_routing<router_value_type>>) {
    if (this == &o) return *this;
    filled_ = std::exchange(o.filled_, false);
    training_ = o.training_;
    n_ = std::exchange(o.n_, 0);
    scratch_epoch_ = o.scratch_epoch_;
    x_ = std::exchange(o.x_, {});
    logits_ = std::exchange(o.logits_, {});
    shared_saved_ = std::exchange(o.shared_saved_, {});
    handle_ = std::move(o.handle_);
    o.handle_.reset();
    routing_ = std::move(o.routing_);
    keep_ = std::move(o.keep_);
    kept_experts_ = std::move(o.kept_experts_);
    kept_probs_ = std::move(o.kept_probs_);
    report_ = std::move(o.report_);
    drop_totals_ = o.drop_totals_;
    stats_ = o.stats_;
    lb_ = o.lb_;
    z_ = o.z_;
    loss_saved_ = std::move(o.loss_saved_);
    return *this;
  }
  ~moe_forward_context() = default;

  //! True between a forward (or a recompute) and its backward.
  [[nodiscard]] bool ready() const noexcept { return handle_.has_value(); }
  //! True from a training or evaluation forward until its backward: the losses' terms are kept
  //! here (not in the storage), so a recompute reproduces the backward exactly.
  [[nodiscard]] bool holds_forward() const noexcept { return filled_; }
  //! N of its forward.
  [[nodiscard]] int num_tokens() const noexcept { return n_; }
  //! The losses and drop counts its forward reported.
  [[nodiscard]] const moe_forward_stats& stats() const noexcept { return stats_; }
  //! The routing (every selected expert), its keep mask [N*k] and the record the dispatcher
  //! took: expert [N*k], -1 for a dropped pair.
  [[nodiscard]] const topk_routing<router_value_type>& routing() const noexcept { return routing_; }
  [[nodiscard]] std::span<const std::uint8_t> keep() const noexcept { return keep_; }
  [[nodiscard]] std::span<const int> kept_experts() const noexcept { return kept_experts_; }
  //! Its dispatch handle (rows per local expert, byte accounting); only while ready().
  [[nodiscard]] const handle_type& dispatch() const noexcept { return *handle_; }
  //! Forgets the views of the saved storage (the caller may free or reuse it); the losses' terms
  //! stay, so Layer::recompute can refill the context from the same input before the backward.
  void drop_activations() noexcept {
    handle_.reset();
    x_ = {};
    logits_ = {};
    shared_saved_ = {};
  }

 private:
  friend Layer;

  bool filled_ = false;   // a forward ran and its backward has not
  bool training_ = true;  // the mode of that forward
  int n_ = 0;
  std::uint64_t scratch_epoch_ = 0;        // the layer's scratch growths at its forward
  std::span<value_type> x_{};              // saved: [N, H] input
  std::span<router_value_type> logits_{};  // saved: [N, E] logits
  std::span<std::byte> shared_saved_{};    // saved: the shared expert's part
  std::optional<handle_type> handle_{};
  topk_routing<router_value_type> routing_{};
  std::vector<std::uint8_t> keep_;                     // [N*k] the drop policy's mask of routing_
  std::vector<int> kept_experts_;                      // [N*k] expert or -1
  std::vector<typename Layer::prob_type> kept_probs_;  // [N*k] in the dispatcher's prob_type
  drop_report report_{};                    // what the policy counted (its vectors sized once)
  std::array<long long, 2> drop_totals_{};  // dropped pairs, fully dropped tokens
  moe_forward_stats stats_{};
  load_balancing_record lb_{};            // the load-balancing terms the forward ran
  z_loss_record<router_value_type> z_{};  // the z-loss the forward ran
  // What the losses keep for the backward (their saved bytes; the layer's context memory): kept
  // across a recompute, sized at the context's first training forward.
  std::vector<std::byte> loss_saved_;
};

}  // namespace v0_1
}  // namespace moefold
