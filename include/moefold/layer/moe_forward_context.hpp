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

#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../dispatch/drop_counts.hpp"
#include "../exec/exec_buffer.hpp"
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

//! One forward of `Layer` in flight. Made empty by the caller, filled by Layer::forward (its
//! first forward allocates the routing record's buffers in the layer's context memory, for
//! max_tokens; a context kept per micro-batch slot allocates nothing afterwards), consumed by
//! Layer::backward. It refers to the storage its forward was given.
template <class Layer>
class moe_forward_context {
 public:
  using value_type = typename Layer::value_type;                // tokens
  using router_value_type = typename Layer::router_value_type;  // logits, probabilities, losses
  using prob_type = typename Layer::prob_type;                  // the probabilities dispatched
  using handle_type = typename Layer::dispatcher_type::handle_type;
  using exec_type = typename Layer::exec_type;
  using space = typename exec_type::memory_space;

  // Move-only: a copy would let one forward be backwarded twice (its gradients counted twice).
  // A moved-from context holds no forward.
  moe_forward_context() = default;
  moe_forward_context(const moe_forward_context&) = delete;
  moe_forward_context& operator=(const moe_forward_context&) = delete;
  moe_forward_context(moe_forward_context&& o) noexcept : moe_forward_context() {
    *this = std::move(o);
  }
  moe_forward_context& operator=(moe_forward_context&& o) noexcept {
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
    key_ = std::exchange(o.key_, {});
    indices_ = std::move(o.indices_);
    kept_ = std::move(o.kept_);
    counts_ = std::move(o.counts_);
    probs_ = std::move(o.probs_);
    keep_ = std::move(o.keep_);
    kept_probs_ = std::move(o.kept_probs_);
    totals_ = std::move(o.totals_);
    loss_saved_ = std::move(o.loss_saved_);
    report_ = std::move(o.report_);
    stats_ = o.stats_;
    lb_ = o.lb_;
    z_ = o.z_;
    loss_host_ = o.loss_host_;
    totals_host_ = o.totals_host_;
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
  //! Its forward's routing [N, k] (every selected expert and its probability), the drop policy's
  //! keep mask of it and the record the dispatcher took (the expert, -1 for a dropped pair), in
  //! the layer's context memory.
  [[nodiscard]] row_view<const int, space> indices() const noexcept {
    return indices_.cview().first(n_);
  }
  [[nodiscard]] row_view<const router_value_type, space> probs() const noexcept {
    return probs_.cview().first(n_);
  }
  [[nodiscard]] row_view<const std::uint8_t, space> keep() const noexcept {
    return keep_.cview().first(n_);
  }
  [[nodiscard]] row_view<const int, space> kept_experts() const noexcept {
    return kept_.cview().first(n_);
  }
  //! The routing as host vectors (host memory contexts).
  [[nodiscard]] topk_routing<router_value_type> routing() const requires host_accessible_v<space> {
    const auto i = indices().flat(), p = probs().flat();
    topk_routing<router_value_type> r;
    r.num_tokens = n_;
    r.num_experts = key_.experts;
    r.topk = key_.topk;
    r.indices.assign(i.begin(), i.end());
    r.probs.assign(p.begin(), p.end());
    return r;
  }
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
  template <class U>
  using buffer = exec_buffer<U, exec_type>;

  // The sizes its buffers were allocated for: a context filled by a layer of other options is
  // reallocated, never overrun.
  struct sizes_key {
    int tokens = 0, topk = 0, experts = 0;
    std::size_t loss_bytes = 0;
    bool operator==(const sizes_key&) const = default;
  };

  bool filled_ = false;   // a forward ran and its backward has not
  bool training_ = true;  // the mode of that forward
  int n_ = 0;
  std::uint64_t scratch_epoch_ = 0;              // the layer's scratch growths at its forward
  row_view<value_type, space> x_{};              // saved: [N, H] input
  row_view<router_value_type, space> logits_{};  // saved: [N, E] logits
  std::span<std::byte> shared_saved_{};          // saved: the shared expert's part
  std::optional<handle_type> handle_{};
  sizes_key key_{};                  // tokens 0: nothing allocated
  buffer<int> indices_, kept_;       // [max_tokens, k]
  buffer<int> counts_;               // [3, E] routed, dropped, padded
  buffer<router_value_type> probs_;  // [max_tokens, k]
  buffer<std::uint8_t> keep_;        // [max_tokens, k]
  buffer<prob_type> kept_probs_;     // [max_tokens, k]
  buffer<long long> totals_;         // [1, 2] dropped pairs, fully dropped
  // What the losses keep for the backward (their saved bytes): kept across a recompute.
  buffer<std::byte> loss_saved_;
  drop_report report_{};  // the host copy of the counts the stats show (vectors sized once)
  moe_forward_stats stats_{};
  load_balancing_record lb_{};            // the load-balancing terms the forward ran
  z_loss_record<router_value_type> z_{};  // the z-loss the forward ran
  // The host read of the losses' values (aux, per-sequence aux, global aux, z), landed by the
  // forward's one wait.
  std::array<router_value_type, 4> loss_host_{};
  std::array<long long, 2> totals_host_{};  // the same for the drop totals
};

}  // namespace v0_1
}  // namespace moefold
