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

#include "../core/expected.hpp"
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

//! What one forward in flight keeps per row its experts receive and per token of the rank
//! (moe_layer::saved_bytes_per_row), for a trainer's memory budget: the saved storage is about
//! per_token * N + per_received_row * M for N tokens and M received rows.
struct moe_saved_rates {
  //! Per received row: the dispatcher's copy of the row and its probability, and the experts'
  //! saved part (mlp_experts: the pre-activation, F1 values in T; none with recompute_fc1).
  std::size_t per_received_row = 0;
  std::size_t experts_per_row = 0;  //!< of which the experts' saved part
  //! Per token (rounded up): the input copy, the logits, the dispatcher's routing plan and the
  //! shared expert's saved part.
  std::size_t per_token = 0;
};

//! The caller's storage for one forward in flight: give each forward its own, until its backward
//! has run (or until the caller drops it and recomputes). On host contexts both parts may be
//! pieces of one buffer.
struct moe_saved_storage {
  std::span<std::byte> saved{};  //!< >= moe_saved_bytes::saved
  std::span<std::byte> host{};   //!< >= moe_saved_bytes::host
};

//! Where a forward's losses sit in moe_forward_stats::losses.
enum class moe_loss : int { aux = 0, seq_aux = 1, global_aux = 2, z = 3 };
inline constexpr int moe_loss_count = 4;

//! What a forward reports, as views of values its context holds in the layer's memory (valid
//! until the context's next forward): the forward copies nothing to the host for them, so a
//! trainer reads them when it logs (read_forward_stats: one copy, one wait) and a CUDA graph can
//! capture the step. `capacity` and `pad_rows` are host values (they depend on N only).
template <class R, class S>
struct moe_forward_stats {
  std::optional<int> capacity{};  //!< C per expert; unset when dropless
  std::optional<int> pad_rows{};  //!< pad mode: every expert's rows per rank; else unset
  //! [1, 4] this rank's part of each loss (indexed by moe_loss; each sums over tp-cp to the
  //! layer's), 0 where a loss is off and in evaluation.
  row_view<const R, S> losses{};
  row_view<const int, S> counts{};             //!< [3, E] routed, dropped, padded per expert
  row_view<const long long, S> drop_totals{};  //!< [1, 2] dropped pairs, tokens that lost all k
};

//! A forward's stats as host values, for logging and tests.
struct moe_forward_values {
  double aux_loss = 0.0;         //!< per micro-batch
  double seq_aux_loss = 0.0;     //!< per sequence
  double global_aux_loss = 0.0;  //!< per global batch (running average of the counts)
  double z_loss = 0.0;
  drop_report dropped{};
};

//! Copies a forward's stats to the host (allocates; the copy to the host waits for the context).
template <class Exec, class R>
[[nodiscard]] expected<moe_forward_values> read_forward_stats(
    Exec& x, const moe_forward_stats<R, typename Exec::memory_space>& s) {
  moe_forward_values v;
  R l[moe_loss_count] = {};
  const int E = s.counts.width();
  drop_report& d = v.dropped;
  d.capacity = s.capacity;
  d.routed.resize(static_cast<std::size_t>(E));
  d.dropped.resize(static_cast<std::size_t>(E));
  d.padded.resize(static_cast<std::size_t>(E));
  long long totals[2] = {0, 0};
  const auto row = [&](int r, std::vector<int>& into) {
    return x.copy(s.counts.subrows(r, 1), row_view<int>(into.data(), 1, E));
  };
  for (status st : {x.copy(s.losses, row_view<R>(l, 1, moe_loss_count)), row(0, d.routed),
                    row(1, d.dropped), row(2, d.padded),
                    x.copy(s.drop_totals, row_view<long long>(totals, 1, 2)), x.synchronize()})
    if (!st) return unexpected<error>(st.error());
  v.aux_loss = static_cast<double>(l[0]);
  v.seq_aux_loss = static_cast<double>(l[1]);
  v.global_aux_loss = static_cast<double>(l[2]);
  v.z_loss = static_cast<double>(l[3]);
  d.dropped_pairs = totals[0];
  d.fully_dropped_tokens = static_cast<int>(totals[1]);
  return v;
}

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

//! What a backward leaves of its forward's context: `consumed` (the usual end: the context takes
//! a new forward next), or `retained` (autograd's retain_graph: the activations are dropped as
//! after any backward, but the forward stays, so recompute() can refill it for another backward
//! of the same forward, with the same bits).
enum class moe_context_after { consumed, retained };

//! One forward of `Layer` in flight. Made empty by the caller, filled by Layer::forward (its
//! first forward allocates the routing record's buffers and the forward's and backward's scratch
//! in the layer's memory, for max_tokens; a context kept per micro-batch slot allocates nothing
//! afterwards), consumed by Layer::backward. It refers to the storage its forward was given.
//! Everything a forward or its backward writes is its own or the caller's storage, never shared
//! with another context: two forwards may run on two streams at once.
template <class Layer>
class moe_forward_context {
 public:
  using value_type = typename Layer::value_type;                // tokens
  using router_value_type = typename Layer::router_value_type;  // logits, probabilities, losses
  using prob_type = typename Layer::prob_type;                  // the probabilities dispatched
  using handle_type = typename Layer::dispatcher_type::handle_type;
  using exec_type = typename Layer::exec_type;
  using space = typename exec_type::memory_space;
  using stats_type = moe_forward_stats<router_value_type, space>;

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
    capacity_ = o.capacity_;
    pad_rows_ = o.pad_rows_;
    x_ = std::exchange(o.x_, {});
    logits_ = std::exchange(o.logits_, {});
    shared_saved_ = std::exchange(o.shared_saved_, {});
    experts_saved_ = std::exchange(o.experts_saved_, {});
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
    losses_ = std::move(o.losses_);
    loss_saved_ = std::move(o.loss_saved_);
    scratch_ = std::move(o.scratch_);
    disp_scratch_ = std::move(o.disp_scratch_);
    lb_ = o.lb_;
    z_ = o.z_;
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
  //! The losses and drop counts of its forward, as views of its values (read_forward_stats
  //! copies them to the host).
  [[nodiscard]] stats_type stats() const noexcept {
    if (key_.tokens == 0) return {};
    return {.capacity = capacity_,
            .pad_rows = pad_rows_,
            .losses = losses_.cview(),
            .counts = counts_.cview(),
            .drop_totals = totals_.cview()};
  }
  //! Its forward's routing [N, k] (every selected expert and its probability), the drop policy's
  //! keep mask of it and the record the dispatcher took (the expert, -1 for a dropped pair), in
  //! the layer's memory.
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
  //! Its forward's input [N, H] as saved (in the storage; rows 16 bytes apart) and logits [N, E],
  //! until its backward.
  [[nodiscard]] row_view<const value_type, space> input() const noexcept { return x_.first(n_); }
  [[nodiscard]] row_view<const router_value_type, space> logits() const noexcept {
    return logits_.first(n_);
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
    experts_saved_ = {};
  }

 private:
  friend Layer;
  template <class U>
  using buffer = exec_buffer<U, exec_type>;

  // The sizes its record buffers were allocated for: a context filled by a layer of other
  // options is reallocated, never overrun.
  struct sizes_key {
    int tokens = 0, topk = 0, experts = 0;
    std::size_t loss_bytes = 0;
    bool operator==(const sizes_key&) const = default;
  };

  bool filled_ = false;   // a forward ran and its backward has not
  bool training_ = true;  // the mode of that forward
  int n_ = 0;
  std::optional<int> capacity_{}, pad_rows_{};   // the drop decision's (host values)
  row_view<value_type, space> x_{};              // saved: [N, H] input
  row_view<router_value_type, space> logits_{};  // saved: [N, E] logits
  std::span<std::byte> shared_saved_{};          // saved: the shared expert's part
  std::span<std::byte> experts_saved_{};         // saved: the experts' part
  std::optional<handle_type> handle_{};
  sizes_key key_{};                   // tokens 0: nothing allocated
  buffer<int> indices_, kept_;        // [max_tokens, k]
  buffer<int> counts_;                // [3, E] routed, dropped, padded
  buffer<router_value_type> probs_;   // [max_tokens, k]
  buffer<std::uint8_t> keep_;         // [max_tokens, k]
  buffer<prob_type> kept_probs_;      // [max_tokens, k]
  buffer<long long> totals_;          // [1, 2] dropped pairs, fully dropped
  buffer<router_value_type> losses_;  // [1, 4] the losses' values (moe_loss)
  // What the losses keep for the backward (their saved bytes): kept across a recompute.
  buffer<std::byte> loss_saved_;
  // The scratch of its forward and backward (Layer's carve_scratch), sized at its first forward
  // for the layer's row bound; the dispatcher's part lives until the backward.
  buffer<std::byte> scratch_;
  buffer<std::byte> disp_scratch_;  // the dispatcher's scratch: its handle's until the backward
  load_balancing_record lb_{};      // the load-balancing terms the forward ran
  z_loss_record<router_value_type> z_{};  // the z-loss the forward ran
};

}  // namespace v0_1
}  // namespace moefold
