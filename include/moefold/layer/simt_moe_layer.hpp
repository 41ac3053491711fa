//! @file simt_moe_layer.hpp
//! @brief One MoE layer on an execution context that runs kernels (cpu_exec in CI, under the
//! sanitizers; cuda_exec on a GPU): the router (topk_router: gating GEMM, fused top-k),
//! the load-balancing losses (per micro-batch, per sequence, global) and the z-loss as device
//! values (load_balancing_losses, router_z_loss), the expert bias with its counts and its
//! once-per-global-batch update (expert_bias): the objects moe_layer runs; the dispatcher on the
//! context (either of moefold's), the experts on the context (mlp_experts, or any expert_fn) and
//! the combine, forward and backward. Every tensor lives in the context's memory; the host sees the
//! counts the dispatcher needs for its collectives and the experts' row ranges, nothing else (no
//! loss value is read back: the stats are views the caller reads when it wants them).
//!
//! It computes what moe_layer computes on the host for the same options (tested over folds of
//! the thread world against moe_layer and the fp64 single-rank reference, and over micro-batches
//! and a global batch's end for the losses with state and the bias). The shared expert
//! (moe_layer_options::shared_expert, its parameters given to make()) runs as moe_layer's:
//! experts/shared_expert.hpp, Megatron-Core's sequence-parallel MLP over the attention TP group
//! (every TP rank's N equal); its gradients are reduced by reduce_shared_gradients. Drop policies:
//! dropless (default) or sub-sequence dropping (`sub_sequence`: capacity from this rank's tokens,
//! by probability or by position, pad mode included) and full-sequence dropping
//! (`simt_full_sequence`: the tp-cp group's routing gathered on the context, capacity and decision
//! over the group's tokens in true sequence order from device order keys), both the policies'
//! decision on the context (dispatch/capacity_keep.hpp, as moe_layer runs them); a bad routing or
//! bad keys are refused at once on the CPU contexts and left in sticky fault words device_status()
//! reads on a GPU.
//!
//! Forwards in flight: forward(x, groups, out, context) fills a simt_moe_layer::context (its
//! input, logits, routing, the losses' saved bytes and the dispatcher's saved and host parts, in
//! the context's memory, allocated at its first forward) and backward(context, ...) consumes it,
//! in any order (pipeline schedules, two forwards before either backward). forward(x, groups,
//! out) and backward(dout, ...) are the one-in-flight form over a context the layer holds.
//!
//! State across micro-batches, in the context's memory: the expert bias [1, E] and this global
//! batch's routed counts [1, E] (fp32, whole numbers), the global loss's running counts [1, E]
//! (fp64, summed over tp-dp-cp) with the micro-batches they cover (a host integer, as Megatron's
//! ga_steps). end_global_batch updates the bias and restarts the running counts. The stats'
//! loss views are the context's, valid until its next forward.
//!
//! Numerics: Megatron-Core's router dtype fp32 (logits, probabilities, losses and their
//! gradients in fp32 for fp32 and bf16 tokens); probabilities travel to the experts in fp32; the
//! router's input gradient dx_router [N, H] stays fp32 and is added to the experts' dx once, as
//! moe_layer does.
//!
//! Shapes: x, out, dout, dx [N, H] (any row stride), N <= max_tokens; the router weight and its
//! gradient [E, H] contiguous.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <moefold/kernels/sequence_order.hpp>

#include "../comm/communicator.hpp"
#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../dispatch/dispatch_args.hpp"
#include "../dispatch/drop_policy_full_sequence.hpp"
#include "../dispatch/drop_policy_local.hpp"
#include "../dispatch/exec_workspace.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"
#include "../exec/gemm_policy.hpp"
#include "../experts/expert_fn.hpp"
#include "../experts/mlp_experts.hpp"
#include "../experts/shared_expert.hpp"
#include "../routing/expert_bias.hpp"
#include "../routing/load_balancing_losses.hpp"
#include "../routing/router_z_loss.hpp"
#include "../routing/topk_router.hpp"
#include "moe_layer.hpp"

namespace moefold {
inline namespace v0_1 {

//! Full-sequence dropping on a context (drop_policy_full_sequence.hpp's policy and semantics): the
//! capacity C = ceil(M k / E x capacity factor) and the keep decision over the M tokens of the
//! tp-cp group, whose routing every forward gathers on the context. The group's size is given up
//! front, so that the gathered buffers are allocated at make (group x max_tokens tokens) and no
//! forward allocates; every rank of the group forwards the same N (sequence parallel's equal
//! shards: a rank with another N fails the gather's count check).
//!
//! The true sequence order comes from device order keys given to forward() ([N, 1] int64 per
//! rank, sequence_order_keys' values: the group's keys are then a permutation of [0, M)); without
//! keys the group's rank order is the sequence order, as the host policy's. All ranks must agree
//! on whether keys are given.
struct simt_full_sequence {
  full_sequence policy{};
  int group = 1;  //!< ranks of moe_layer_groups::tp_cp (tp x cp of the attention mapping)
};
//! simt_moe_layer's drop policies.
using simt_drop_policy = std::variant<sub_sequence, simt_full_sequence>;
//! The capacity rule of either policy (capacity factor, pad mode, what decides): full-sequence
//! dropping's fields as sub_sequence holds them, the decision's scope aside.
[[nodiscard]] inline sub_sequence capacity_rule(const simt_drop_policy& d) noexcept {
  if (const auto* s = std::get_if<sub_sequence>(&d)) return *s;
  const auto& f = std::get<simt_full_sequence>(d).policy;
  return {.capacity_factor = f.capacity_factor, .pad_to_capacity = f.pad_to_capacity, .by = f.by};
}

//! The loss values of a forward, each a [1, 1] view in the context's memory (empty when the loss
//! is off or in evaluation): valid until the next forward.
template <class S>
struct simt_moe_forward_stats {
  //! With a drop policy: the capacity C per expert (a host value: it depends on N only) and
  //! {dropped pairs, tokens that lost all k experts} [1, 2] on the context; empty when dropless.
  std::optional<int> capacity{};
  row_view<const long long, S> drop_totals{};
  row_view<const float, S> aux_loss{};         //!< this rank's part of the micro-batch loss
  row_view<const float, S> seq_aux_loss{};     //!< this rank's part of the per-sequence loss
  row_view<const float, S> global_aux_loss{};  //!< this rank's part of the global-batch loss
  row_view<const float, S> z_loss{};           //!< this rank's part of the z-loss
};

template <class T, execution_context Exec, class Comm, class Dispatcher, class Experts>
requires std::same_as<typename Dispatcher::value_type, T> &&
    std::same_as<typename Dispatcher::prob_type, float> &&
    std::same_as<typename Dispatcher::exec_type, Exec> && expert_fn<Experts, Exec, T, float> &&
    communicator_for<Comm, Exec, double> && communicator_for<Comm, Exec, float>
class simt_moe_layer {
  template <class U>
  using buffer = exec_buffer<U, Exec>;

 public:
  using value_type = T;
  using space = typename Exec::memory_space;
  //! The router weight's gradient type (fp32 for fp32 and bf16 weights).
  using grad_type = main_grad_t<T>;
  using dispatcher_type = Dispatcher;
  using handle_type = typename Dispatcher::handle_type;

  //! One forward in flight: what its backward needs, in the context's memory. Made empty by the
  //! caller; the layer's first forward into it allocates its buffers (for max_tokens; a context
  //! kept per micro-batch slot allocates nothing afterwards). Move-only: a copy would let one
  //! forward be backwarded twice. A moved-from context holds no forward.
  class context {
   public:
    context() = default;
    context(const context&) = delete;
    context& operator=(const context&) = delete;
    context(context&& o) noexcept { *this = std::move(o); }
    context& operator=(context&& o) noexcept {
      if (this == &o) return *this;
      handle_ = std::move(o.handle_);
      o.handle_.reset();
      n_ = std::exchange(o.n_, 0);
      lb_ = std::exchange(o.lb_, {});
      z_ = std::exchange(o.z_, {});
      key_ = std::exchange(o.key_, {});
      input_ = std::move(o.input_);
      logits_ = std::move(o.logits_);
      probs_ = std::move(o.probs_);
      indices_ = std::move(o.indices_);
      kept_ = std::move(o.kept_);
      loss_saved_ = std::move(o.loss_saved_);
      saved_ = std::move(o.saved_);
      host_ = std::move(o.host_);
      sh_saved_ = std::move(o.sh_saved_);
      return *this;
    }
    ~context() = default;

    //! True from a forward into it until its backward.
    [[nodiscard]] bool ready() const noexcept { return handle_.has_value(); }
    //! N of its last forward (kept after the backward, with the views below).
    [[nodiscard]] int num_tokens() const noexcept { return n_; }
    //! Its forward's routing (selected experts and probabilities [N, k]), logits [N, E] and the
    //! record as dispatched [N, k] (-1 where a pair was dropped; the selection when dropless).
    [[nodiscard]] row_view<const int, space> indices() const noexcept {
      return indices_.cview().first(n_);
    }
    [[nodiscard]] row_view<const float, space> probs() const noexcept {
      return probs_.cview().first(n_);
    }
    [[nodiscard]] row_view<const float, space> logits() const noexcept {
      return logits_.cview().first(n_);
    }
    [[nodiscard]] row_view<const int, space> kept() const noexcept { return record(n_); }
    //! Its forward's input as the layer keeps it [N, H] (for the router's weight gradient; its
    //! row stride padded to 16 bytes, as every row buffer the layer allocates).
    [[nodiscard]] row_view<const T, space> input() const noexcept {
      const auto v = input_.cview();
      return row_view<const T, space>(v.data(), n_, static_cast<int>(key_.hidden), v.width());
    }
    //! Its dispatch (rows per local expert on the host, the batch's rows); null unless ready().
    [[nodiscard]] const handle_type* dispatch() const noexcept {
      return handle_ ? &*handle_ : nullptr;
    }

   private:
    friend class simt_moe_layer;
    // The record the dispatcher takes for n tokens: the kept one with a drop policy, else the
    // selection.
    row_view<const int, space> record(int n) const noexcept {
      return key_.drop ? kept_.cview().first(n) : indices_.cview().first(n);
    }
    // The sizes its buffers were allocated for: a context filled by a layer of other options
    // is reallocated, never overrun.
    struct sizes_key {
      long long tokens = 0, hidden = 0, experts = 0, topk = 0, batch = 0;
      bool drop = false;
      long long shared_bytes = 0;  // the shared expert's saved bytes (0: none)
      long long loss_bytes = 0;    // the losses' saved bytes
      dispatch_workspace_bytes ws{};
      bool operator==(const sizes_key& k) const noexcept {
        return shared_bytes == k.shared_bytes && tokens == k.tokens && hidden == k.hidden &&
               experts == k.experts && topk == k.topk && batch == k.batch && drop == k.drop &&
               loss_bytes == k.loss_bytes && ws.saved == k.ws.saved && ws.scratch == k.ws.scratch &&
               ws.host == k.ws.host;
      }
    };
    std::optional<handle_type> handle_{};
    int n_ = 0;
    load_balancing_record lb_{};    // the load-balancing terms its forward ran
    z_loss_record<float> z_{};      // the z-loss its forward ran
    sizes_key key_{};               // tokens 0: nothing allocated
    buffer<T> input_;               // [max_tokens, H] the forward's input (rows padded)
    buffer<float> logits_, probs_;  // [N, E], [N, k]
    buffer<int> indices_, kept_;    // [N, k] the selection; the kept record (a drop policy)
    // The losses' saved bytes (load_balancing_losses', then router_z_loss'): their values and
    // what their backward needs.
    buffer<std::byte> loss_saved_;
    buffer<std::byte> saved_;      // the dispatcher's saved part
    std::vector<std::byte> host_;  // and its host part
    // The shared expert's saved part (with one).
    buffer<std::byte> sh_saved_;
  };
  using context_type = context;

  //! Checks the options (what moe_layer checks, and what this layer does not take yet), makes
  //! the router and the dispatcher and allocates the layer's scratch and the buffers of its own
  //! context (in pad mode for the capacity of max_tokens, or of the group's tokens). `exec`, the
  //! router weight and its gradient buffer must outlive the layer. `drop`: sub-sequence or
  //! full-sequence dropping, or none (dropless).
  [[nodiscard]] static expected<simt_moe_layer> make(
      Exec& exec, const moe_layer_options& o, row_view<const T, space> router_weight,
      row_view<grad_type, space> router_grad, Experts experts,
      std::optional<simt_drop_policy> drop = {},
      const shared_expert_views<T, space, grad_type>& shared = {}) {
    using detail::to_decimal;
    const auto refuse = [](const std::string& what, errc code = errc::not_supported) {
      return unexpected<error>(make_error(code, "simt_moe_layer: " + what));
    };
    const bool any_shared = !shared.mlp.fc1.empty() || !shared.mlp.fc2.empty() ||
                            !shared.gate.empty() || !shared.gate_grad.empty();
    if (o.shared_expert.ffn < 0)
      return refuse("shared_expert.ffn must be >= 0 (0: no shared expert)", errc::invalid_size);
    if (o.shared_expert.ffn == 0 && any_shared)
      return refuse(
          "shared-expert parameters given without a shared expert (shared_expert.ffn = 0)",
          errc::invalid_argument);
    const auto coeff_ok = [](double c) { return std::isfinite(c) && c >= 0; };
    if (!(coeff_ok(o.aux_loss_coeff) && coeff_ok(o.z_loss_coeff) &&
          coeff_ok(o.seq_aux_loss_coeff) && coeff_ok(o.global_aux_loss_coeff)))
      return refuse("loss coefficients must be finite and >= 0 (0 turns one off)",
                    errc::invalid_argument);
    if (o.batch < 1)
      return refuse("batch (sequences per micro-batch) must be >= 1", errc::invalid_argument);
    if (o.router.expert_bias &&
        !(std::isfinite(o.expert_bias_update_rate) && o.expert_bias_update_rate >= 0))
      return refuse("expert_bias_update_rate must be finite and >= 0", errc::invalid_argument);
    if (o.max_tokens < 1 || o.hidden < 1)
      return unexpected<error>(
          make_error(errc::invalid_size, "simt_moe_layer: max_tokens and hidden must be >= 1"));
    // The capacity rule both policies share, and full-sequence dropping's group (0: none).
    std::optional<sub_sequence> rule;
    int group = 0;
    if (drop) {
      rule = capacity_rule(*drop);
      if (const auto* full = std::get_if<simt_full_sequence>(&*drop)) {
        group = full->group;
        if (group < 1)
          return refuse("full-sequence dropping's group (the ranks of tp_cp) must be >= 1",
                        errc::invalid_argument);
      }
      if (rule->by != drop_by::probs && rule->by != drop_by::position)
        return refuse("drop.by must be drop_by::probs or drop_by::position",
                      errc::invalid_argument);
      // The capacity factor's rule, and the capacity of the most tokens it sees fits (the
      // group's routed pairs as one int: the gathered record's size).
      const long long tokens = static_cast<long long>(std::max(group, 1)) * o.max_tokens;
      if (o.max_tokens > 0 && tokens * o.router.topk > 2147483647LL)
        return refuse(
            "full-sequence dropping: the group's routed pairs (group x max_tokens x "
            "topk) reach 2^31",
            errc::overflow);
      auto c = expert_capacity(tokens * o.router.topk, o.router.num_experts, rule->capacity_factor);
      if (!c) return refuse(c.error().message, c.error().code);
    }
    if (experts.hidden() != o.hidden || experts.num_local_experts() * o.ep != o.router.num_experts)
      return unexpected<error>(
          make_error(errc::shape_mismatch,
                     "simt_moe_layer: the experts hold " + to_decimal(experts.num_local_experts()) +
                         " local experts of hidden size " + to_decimal(experts.hidden()) +
                         "; the layer needs num_experts / ep = " +
                         to_decimal(o.ep > 0 ? o.router.num_experts / o.ep : 0) + " of size " +
                         to_decimal(o.hidden)));
    auto router = router_type::make(o.router, o.hidden);
    if (!router) return unexpected<error>(router.error());
    const auto fits = [&](const auto& v) {
      return v.rows() == o.router.num_experts && v.width() == o.hidden && v.contiguous();
    };
    if (!fits(router_weight) || !fits(router_grad))
      return refuse("the router weight and its gradient must be contiguous [E, H] = [" +
                        to_decimal(o.router.num_experts) + ", " + to_decimal(o.hidden) + "]",
                    errc::shape_mismatch);
    auto disp = Dispatcher::make(moe_dispatch_shape(o));
    if (!disp) return unexpected<error>(disp.error());
    simt_moe_layer l(exec, o, std::move(*router), std::move(*disp), std::move(experts));
    l.router_w_ = router_weight;
    l.router_g_ = router_grad;
    l.drop_ = rule;
    l.drop_group_ = group;
    l.policy_ = drop;
    if (o.shared_expert.ffn > 0) {
      const auto& so = o.shared_expert;
      auto se = shared_type::make({.max_tokens = o.max_tokens,
                                   .hidden = o.hidden,
                                   .ffn = so.ffn,
                                   .tp = so.tp,
                                   .tp_rank = so.tp_rank,
                                   .act = so.act,
                                   .gate = so.gate},
                                  shared);
      if (!se) return refuse("the shared expert: " + se.error().message, se.error().code);
      l.shared_.emplace(std::move(*se));
    }
    auto lb = load_balancing_losses<float, Exec>::make(exec, moe_load_balancing_options(o));
    if (!lb) return unexpected<error>(lb.error());
    l.lb_ = std::move(*lb);
    auto z = router_z_loss<float, Exec>::make(o.router.num_experts, o.max_tokens, o.z_loss_coeff);
    if (!z) return unexpected<error>(z.error());
    l.z_ = *z;
    if (o.router.expert_bias) {
      auto b =
          moefold::expert_bias<Exec>::make(exec, o.router.num_experts, o.expert_bias_update_rate);
      if (!b) return unexpected<error>(b.error());
      l.bias_.emplace(std::move(*b));
    }
    if (auto st = l.allocate(); !st) return unexpected<error>(st.error());
    return l;
  }

  [[nodiscard]] const moe_layer_options& options() const noexcept { return o_; }
  [[nodiscard]] Experts& experts() noexcept { return experts_; }
  [[nodiscard]] const Dispatcher& dispatcher() const noexcept { return disp_; }
  //! The one-in-flight form's last forward (its context's views): routing (selected experts and
  //! probabilities [N, k]), logits [N, E], the record as dispatched [N, k] (-1 where a pair was
  //! dropped; the same as last_indices() when dropless).
  [[nodiscard]] row_view<const int, space> last_indices() const noexcept { return own_.indices(); }
  [[nodiscard]] row_view<const float, space> last_probs() const noexcept { return own_.probs(); }
  [[nodiscard]] row_view<const float, space> last_logits() const noexcept { return own_.logits(); }
  [[nodiscard]] row_view<const int, space> last_kept() const noexcept { return own_.kept(); }
  //! Its input as kept [N, H] (row stride padded to 16 bytes; context::input()).
  [[nodiscard]] row_view<const T, space> last_input() const noexcept { return own_.input(); }
  //! With a drop policy, the last training or evaluation forward's pairs per expert [1, E]:
  //! routed, dropped beyond capacity, zero-probability filler rows (pad mode); empty dropless.
  struct drop_views {
    row_view<const int, space> routed{}, dropped{}, padded{};
  };
  [[nodiscard]] drop_views last_drop_counts() const noexcept {
    if (!drop_) return {};
    return {routed_.cview(), dropped_.cview(), padded_.cview()};
  }
  [[nodiscard]] const std::optional<simt_drop_policy>& drop_policy() const noexcept {
    return policy_;
  }
  //! The one-in-flight form's dispatch (rows per local expert on the host, the batch's rows),
  //! until its backward.
  [[nodiscard]] const handle_type* last_dispatch() const noexcept { return own_.dispatch(); }

  //! What the forwards' kernels found and left to the device, read when the caller asks (each
  //! read a device-to-host copy, a wait): full-sequence order keys that were not a permutation of
  //! the group's [0, M) since the last call (those forwards dropped in the group's rank order;
  //! the fault is then cleared), then the dispatch of `ctx` (its dispatcher's device_status: a
  //! pad-mode record's faults and the context's error word) while it is in flight, else the
  //! context's error word.
  [[nodiscard]] status device_status(const context& ctx) {
    using detail::to_decimal;
    if (drop_) {  // the drop decisions' sticky fault words (drop_output::faults)
      int f[3] = {0, 0, 0};
      if (auto st = x_->copy(drop_faults_.cview(), row_view<int>(f, 1, 3)); !st) return st;
      if (auto st = x_->synchronize(); !st) return st;
      constexpr int none = kernels::order_fault_none;
      if (f[0] != none || f[1] != none || f[2] != none) {
        if (auto st = x_->template fill<int>(drop_faults_.view(), none); !st) return st;
        if (f[0] != none)
          return make_error(errc::invalid_argument,
                            "simt_moe_layer: the drop decision's routing pair " + to_decimal(f[0]) +
                                " names an expert outside [0, E) or one its token already named");
        return make_error(
            errc::invalid_argument,
            "simt_moe_layer: full-sequence dropping's order keys must be a permutation of [0, M) "
            "over the tp-cp group's M tokens (sequence_order_keys' values): " +
                (f[1] != none
                     ? "the group's token " + to_decimal(f[1]) + " has a key outside [0, M)"
                     : "no token or more than one token has key " + to_decimal(f[2])) +
                "; those forwards dropped in the group's rank order");
      }
    }
    if (const handle_type* h = ctx.dispatch()) return disp_.device_status(*x_, *h);
    return device_status_of(*x_);
  }
  //! The one-in-flight form's.
  [[nodiscard]] status device_status() { return device_status(own_); }

  //! The expert bias (with options.router.expert_bias, else null: routing/expert_bias.hpp; zeros
  //! after make, its load() takes a checkpoint), this global batch's routed counts [1, E] that
  //! end_global_batch turns into its update, and the global loss's running counts [1, E] (fp64,
  //! summed over tp-dp-cp) with the micro-batches they cover. Views are empty when the feature is
  //! off.
  [[nodiscard]] moefold::expert_bias<Exec>* expert_bias() noexcept {
    return bias_ ? &*bias_ : nullptr;
  }
  [[nodiscard]] row_view<const float, space> expert_bias_counts() const noexcept {
    return bias_ ? bias_->counts() : row_view<const float, space>{};
  }
  [[nodiscard]] row_view<const double, space> global_aux_counts() const noexcept {
    return o_.global_aux_loss_coeff > 0 ? lb_.running_counts() : row_view<const double, space>{};
  }
  [[nodiscard]] int global_aux_steps() const noexcept { return lb_.running_steps(); }

  //! Training (default): the forward computes the losses. Evaluation: it does not.
  void set_training(bool training) noexcept { training_ = training; }
  [[nodiscard]] bool training() const noexcept { return training_; }

  //! out [N, H] for x [N, H] into the layer's own context (one forward in flight: the next
  //! forward replaces it).
  [[nodiscard]] expected<simt_moe_forward_stats<space>> forward(row_view<const T, space> x,
                                                                const moe_layer_groups<Comm>& g,
                                                                row_view<T, space> out) {
    return forward(x, g, out, own_, {});
  }
  //! The same, with full-sequence dropping's order keys [N, 1] (see simt_full_sequence).
  [[nodiscard]] expected<simt_moe_forward_stats<space>> forward(
      row_view<const T, space> x, const moe_layer_groups<Comm>& g, row_view<T, space> out,
      row_view<const std::int64_t, space> order_keys) {
    return forward(x, g, out, own_, order_keys);
  }
  //! out [N, H] for x [N, H]; `ctx` keeps what the backward needs until backward(ctx, ...) runs
  //! (a forward into a ready context replaces the forward it held). The stats' loss views are
  //! the context's (until its next forward), the drop totals the layer's (until the next forward).
  //! `order_keys` [N, 1] (contiguous, or empty): each token's key in the true sequence order, for
  //! full-sequence dropping only.
  [[nodiscard]] expected<simt_moe_forward_stats<space>> forward(
      row_view<const T, space> x, const moe_layer_groups<Comm>& g, row_view<T, space> out,
      context& ctx, row_view<const std::int64_t, space> order_keys = {}) {
    ctx.handle_.reset();
    ctx.n_ = 0;
    const int n = x.rows();
    if (n < 0 || n > o_.max_tokens || x.width() != o_.hidden || out.rows() != n ||
        out.width() != o_.hidden)
      return make_error(errc::shape_mismatch,
                        "simt_moe_layer: x and out must be [N, H] with N <= max_tokens = " +
                            detail::to_decimal(o_.max_tokens) +
                            ", H = " + detail::to_decimal(o_.hidden));
    if (auto st = check_order_keys(order_keys, g, n); !st) return unexpected<error>(st.error());
    const bool seq_on = training_ && o_.seq_aux_loss_coeff > 0,
               global_on = training_ && o_.global_aux_loss_coeff > 0;
    if (seq_on && n % o_.batch != 0)
      return make_error(errc::shape_mismatch,
                        "simt_moe_layer: the per-sequence loss needs N a multiple of batch (N = " +
                            detail::to_decimal(n) + ", batch = " + detail::to_decimal(o_.batch) +
                            "; token n = s * batch + b is sequence b)");
    if (global_on && g.tp_dp_cp == nullptr)
      return make_error(errc::invalid_argument,
                        "simt_moe_layer: the global load-balancing loss needs the tp-dp-cp "
                        "communicator in moe_layer_groups::tp_dp_cp");
    if (shared_)
      if (auto st = check_tp(g); !st) return unexpected<error>(st.error());
    if (auto st = prepare(ctx); !st) return unexpected<error>(st.error());
    // The input is kept for the router's weight gradient (the caller may reuse its buffer).
    const auto xs = hidden_rows(ctx.input_, n);
    if (auto st = x_->copy(x, xs); !st) return unexpected<error>(st.error());
    if (auto st =
            router_.forward(*x_,
                            {.x = xs,
                             .weight = router_w_,
                             .expert_bias = bias_ ? bias_->bias() : row_view<const float, space>{},
                             .logits = ctx.logits_.view().first(n),
                             .indices = ctx.indices_.view().first(n),
                             .probs = ctx.probs_.view().first(n)},
                            router_workspace());
        !st)
      return unexpected<error>(st.error());
    simt_moe_forward_stats<space> stats;
    std::optional<int> pad_rows;
    if (drop_) {
      auto c = drop_pairs(ctx, n, g.tp_cp, order_keys);
      if (!c) return unexpected<error>(c.error());
      stats.capacity = *c;
      stats.drop_totals = drop_totals_.cview();
      if (drop_->pad_to_capacity) pad_rows = *c;
    }
    // The losses (load_balancing_losses, router_z_loss: their values and what their backward
    // needs in the context's saved bytes) and the bias's counts, once per training forward.
    ctx.lb_ = {};
    ctx.z_ = {};
    if (training_) {
      const auto logits = ctx.logits_.cview().first(n);
      const auto saved = loss_saved(ctx);
      if (lb_.any()) {
        auto rec = lb_.forward(*x_, logits, {}, g.tp_cp, g.tp_dp_cp, saved.first(lb_.saved_bytes()),
                               loss_workspace());
        if (!rec) return unexpected<error>(rec.error());
        ctx.lb_ = *rec;
        const auto losses = lb_.losses(saved.first(lb_.saved_bytes()));
        const auto term = [&](int i) {
          return row_view<const float, space>(losses.data() + i, 1, 1);
        };
        if (ctx.lb_.on[0]) stats.aux_loss = term(0);
        if (ctx.lb_.on[1]) stats.seq_aux_loss = term(1);
        if (ctx.lb_.on[2]) stats.global_aux_loss = term(2);
      }
      if (z_.on()) {
        auto rec = z_.forward(*x_, logits, {}, g.tp_cp.size(), saved.subspan(lb_.saved_bytes()));
        if (!rec) return unexpected<error>(rec.error());
        ctx.z_ = *rec;
        stats.z_loss = z_.loss(saved.subspan(lb_.saved_bytes()));
      }
      // The rows each expert receives (routed - dropped + padded).
      if (bias_)
        if (auto st = add_routed_counts(ctx, n); !st) return unexpected<error>(st.error());
    }
    const dispatch_input<T, space, float> din{.num_tokens = n,
                                              .x = xs,
                                              .expert = ctx.record(n),
                                              .probs = ctx.probs_.cview().first(n),
                                              .capacity = pad_rows,
                                              // dropless: the router names k experts per token
                                              .every_pair_routed = !drop_};
    // The saved and host parts are the context's (they live until its backward), the scratch
    // part the layer's.
    const dispatch_workspace ws{.saved = {ctx.saved_.view().data(), ctx.key_.ws.saved},
                                .scratch = {scratch_.view().data(), ctx.key_.ws.scratch},
                                .host = ctx.host_};
    auto h = disp_.dispatch(*x_, din, g.dispatch, ws);
    if (!h) return unexpected<error>(h.error());
    const int M = h->num_rows();
    const auto y = hidden_rows(rows_a_, M);
    if (auto st = experts_.forward(*x_, h->batch(), y, experts_workspace()); !st)
      return unexpected<error>(st.error());
    if (auto st = disp_.combine(*x_, *h, y, g.dispatch, out); !st)
      return unexpected<error>(st.error());
    if (shared_)  // out += the shared expert's output, the sum Megatron-Core forms after combine
      if (auto st = shared_->forward(*x_, x, *g.tp, out, shared_saved(ctx), shared_scratch()); !st)
        return unexpected<error>(st.error());
    ctx.handle_.emplace(std::move(*h));
    ctx.n_ = n;
    return stats;
  }

  //! The one-in-flight form: the backward of the layer's own context.
  [[nodiscard]] status backward(row_view<const T, space> dout, float loss_seed,
                                const moe_layer_groups<Comm>& g, row_view<T, space> dx) {
    return backward(own_, dout, loss_seed, g, dx);
  }
  //! dx [N, H] from dout [N, H] of the forward `ctx` holds, which it consumes (whatever the
  //! outcome); `loss_seed` is d(training loss) / d(each auxiliary loss). Adds the router weight's
  //! and the experts' gradients. The other contexts in flight are untouched.
  [[nodiscard]] status backward(context& ctx, row_view<const T, space> dout, float loss_seed,
                                const moe_layer_groups<Comm>& g, row_view<T, space> dx) {
    if (!ctx.handle_)
      return make_error(errc::invalid_argument,
                        "simt_moe_layer: backward of a context no forward filled (or its backward "
                        "already ran)");
    if (!std::isfinite(loss_seed))
      return make_error(errc::invalid_argument, "simt_moe_layer: the loss seed must be finite");
    if (shared_)
      if (auto st = check_tp(g); !st) return st;
    const int n = ctx.n_;
    if (dout.rows() != n || dout.width() != o_.hidden || dx.rows() != n || dx.width() != o_.hidden)
      return make_error(errc::shape_mismatch,
                        "simt_moe_layer: dout and dx must be [N, H] = [" + detail::to_decimal(n) +
                            ", " + detail::to_decimal(o_.hidden) + "] (the forward's N)");
    const handle_type h = std::move(*ctx.handle_);
    ctx.handle_.reset();  // consumed, whatever the outcome
    const int M = h.num_rows();
    const auto dy = hidden_rows(rows_a_, M), dx_rows = hidden_rows(rows_b_, M);
    const auto dprob_rows = prob_rows_.view().first(M);
    // Experts' path: dout -> dy rows -> dx rows, dprob rows -> dx [N, H], dprobs [N, k].
    if (auto st = disp_.combine_backward(*x_, h, dout, g.dispatch, dy); !st) return st;
    if (auto st = experts_.backward(*x_, h.batch(), dy, dx_rows, dprob_rows, experts_workspace());
        !st)
      return st;
    if (auto st = disp_.dispatch_backward(*x_, h, dx_rows, dprob_rows, g.dispatch, dx,
                                          dprobs_.view().first(n));
        !st)
      return st;
    // Router's path: the Jacobian, the losses' gradients added to dlogits, the gating GEMM.
    const auto dlogits = dlogits_.view().first(n);
    if (auto st = router_.backward(*x_, {.logits = ctx.logits_.cview().first(n),
                                         .indices = ctx.indices_.cview().first(n),
                                         .dprobs = dprobs_.cview().first(n),
                                         .dlogits = dlogits});
        !st)
      return st;
    {  // micro-batch, per sequence, global, then the z-loss: moe_layer's order
      const auto logits = ctx.logits_.cview().first(n);
      const auto saved = loss_saved(ctx);
      if (auto st = lb_.backward(*x_, logits, {}, ctx.lb_, saved.first(lb_.saved_bytes()),
                                 {loss_seed, loss_seed, loss_seed}, dlogits);
          !st)
        return st;
      if (auto st = z_.backward(*x_, logits, {}, ctx.z_, saved.subspan(lb_.saved_bytes()),
                                loss_seed, dlogits);
          !st)
        return st;
    }
    const auto dxr = hidden_rows(dx_router_, n);
    if (auto st = router_.backward_gating(
            *x_,
            gating_backward_args<T, float, grad_type, space>{.x = hidden_rows(ctx.input_, n),
                                                             .weight = router_w_,
                                                             .dlogits = dlogits_.cview().first(n),
                                                             .dx = dxr,
                                                             .weight_grad = router_g_},
            router_workspace());
        !st)
      return st;
    if (auto st = x_->template add_converted<T, float>(dxr, dx); !st) return st;
    if (shared_)  // dx += dx_shared, the host's order
      return shared_->backward(*x_, dout, *g.tp, dx, shared_saved(ctx), shared_scratch());
    return {};
  }

  //! Sums the local gradients over their groups: the router weight over tp-dp-cp, the experts'
  //! (their gradient buffers, e.g. fc1 and fc2) over edp. Collective, on the context.
  [[nodiscard]] status reduce_gradients(Comm& tp_dp_cp, Comm& edp, row_view<grad_type, space> dw,
                                        std::initializer_list<row_view<grad_type, space>> experts) {
    if (auto st = tp_dp_cp.all_reduce(*x_, dw, reduce_op::sum); !st) return st;
    for (const auto& b : experts)
      if (auto st = edp.all_reduce(*x_, b, reduce_op::sum); !st) return st;
    return {};
  }
  //! The same with the experts' own gradient views (`grads()`, as mlp_experts exposes them).
  [[nodiscard]] status reduce_gradients(Comm& tp_dp_cp, Comm& edp,
                                        row_view<grad_type, space> dw) requires
      exposes_expert_grads<Experts, grad_type, space> {
    const auto& g = experts_.grads();
    return reduce_gradients(tp_dp_cp, edp, dw, {g.fc1, g.fc2});
  }

  //! With a shared expert: its MLP's gradients summed over dp-cp (each TP shard saw its TP
  //! group's tokens), its gate weight's over tp-dp-cp (replicated over TP, it saw this rank's
  //! tokens only), as moe_layer reduces them. Collective, on the context.
  [[nodiscard]] status reduce_shared_gradients(Comm& dp_cp, Comm& tp_dp_cp) {
    if (!shared_)
      return make_error(errc::invalid_argument,
                        "simt_moe_layer: reduce_shared_gradients of a layer without a shared "
                        "expert");
    const auto& p = shared_->params();
    const row_view<grad_type, space> mlp_grads[] = {p.grads.fc1, p.grads.fc2};
    for (const auto& b : mlp_grads)
      if (auto st = dp_cp.all_reduce(*x_, b, reduce_op::sum); !st) return st;
    if (o_.shared_expert.gate)
      if (auto st = tp_dp_cp.all_reduce(*x_, p.gate_grad, reduce_op::sum); !st) return st;
    return {};
  }

  //! Once per global batch, after the last backward: the expert bias moves by rate * sign(mean -
  //! count) on the counts summed over tp-dp-cp, its counts restart at 0, and so do the global
  //! loss's running counts. Collective over tp-dp-cp when the bias is enabled.
  [[nodiscard]] status end_global_batch(Comm& tp_dp_cp) {
    if (bias_)
      if (auto st = bias_->update(*x_, tp_dp_cp); !st) return st;
    return lb_.reset_running(*x_);
  }

 private:
  using router_type = topk_router<T, Exec, float>;
  simt_moe_layer(Exec& x, const moe_layer_options& o, router_type r, Dispatcher d, Experts e)
      : x_(&x), o_(o), router_(std::move(r)), disp_(std::move(d)), experts_(std::move(e)) {}

  // Allocates buffers on the context in a list whose calls all run: once one fails, the ones
  // after it are skipped and each returns that first failure.
  struct buffer_maker {
    Exec& x;
    status failed{};
    template <class U>
    status operator()(buffer<U>& b, long long rows, long long width) {
      if (!failed) return failed;
      auto v = buffer<U>::make(x, rows, width);
      if (!v) return failed = unexpected<error>(v.error());
      b = std::move(*v);
      return {};
    }
    // A workspace part's width in bytes: at least one, so that every view has an address.
    static long long bytes(std::size_t n) noexcept {
      return std::max<long long>(static_cast<long long>(n), 1);
    }
  };

  status allocate() {
    const long long N = o_.max_tokens, H = o_.hidden, E = o_.router.num_experts, K = o_.router.topk;
    // The experts' rows: the receive bound (by default every routed pair of the tp-ep group).
    // In pad mode every expert receives C rows from each rank of the group: C E etp in all, which
    // may exceed the routed pairs (capacity factors above 1).
    const std::optional<int> pad_max = max_pad_rows();
    const long long M = o_.max_recv_rows.value_or(
        std::max<long long>(detail::worst_recv_rows(disp_.shape()),
                            pad_max ? static_cast<long long>(*pad_max) * E * o_.etp : 0));
    buffer_maker make{*x_};
    for (status st :
         {make(dprobs_, N, K), make(dlogits_, N, E), make(dx_router_, N, padded<float>(H)),
          make(router_ws_, 1, buffer_maker::bytes(router_type::workspace_bytes())),
          make(rows_a_, std::max(M, 1LL), padded<T>(H)),
          make(rows_b_, std::max(M, 1LL), padded<T>(H)), make(prob_rows_, std::max(M, 1LL), 1),
          make(histogram_, 1, E), make(fault_, 1, 2),
          make(loss_ws_, 1, buffer_maker::bytes(lb_.workspace_bytes()))})
      if (!st) return st;
    // The drop decision's outputs and workspace (the group's gathered record is the latter's).
    if (drop_)
      for (status st : {make(keep_, N, K), make(routed_, 1, E), make(dropped_, 1, E),
                        make(padded_, 1, E), make(drop_totals_, 1, 2), make(drop_faults_, 1, 3),
                        make(drop_ws_, 1, buffer_maker::bytes(drop_workspace_bytes()))})
        if (!st) return st;
    if (drop_)  // no fault yet
      if (auto st = x_->template fill<int>(drop_faults_.view(), kernels::order_fault_none); !st)
        return st;
    // The workspace of the larger of the two forwards pad mode may run (a capacity of 0 rows
    // is the smallest; max_tokens' the largest): its scratch part here, the saved and host
    // parts in each context.
    ws_sizes_ = disp_.workspace_sizes(pad_max);
    if (auto st = make(scratch_, 1, buffer_maker::bytes(ws_sizes_.scratch)); !st) return st;
    if (shared_)  // the shared expert's scratch (its calls' MLP workspace included)
      if (auto st = make(sh_scratch_, 1, buffer_maker::bytes(shared_->scratch_bytes())); !st)
        return st;
    // The experts' workspace: the receive bound's rows.
    const std::size_t ws = expert_workspace_bytes(experts_, static_cast<int>(M));
    if (auto st = make(experts_ws_, 1, buffer_maker::bytes(ws)); !st) return st;
    return prepare(own_);
  }

  // Rows of H values of U the layer allocates start 16 bytes apart (the kernels' 16-byte row
  // accesses; a stride of H elements is padded up): the buffer's width is the padded stride.
  template <class U>
  static long long padded(long long H) noexcept {
    static_assert(16 % sizeof(U) == 0, "a row element must divide 16 bytes");
    constexpr auto e = static_cast<long long>(sizeof(U));
    return (H * e + 15) / 16 * 16 / e;
  }
  // The first `rows` rows of such a buffer as [rows, H], its stride the padded one.
  template <class U>
  row_view<U, space> hidden_rows(const buffer<U>& b, int rows) const noexcept {
    return row_view<U, space>(b.view().data(), rows, o_.hidden, b.view().width());
  }

  // The sizes a context's buffers take for this layer.
  typename context::sizes_key key() const noexcept {
    return {.tokens = o_.max_tokens,
            .hidden = o_.hidden,
            .experts = o_.router.num_experts,
            .topk = o_.router.topk,
            .batch = o_.batch,
            .drop = drop_.has_value(),
            .shared_bytes = shared_ ? static_cast<long long>(shared_->saved_bytes()) : 0,
            .loss_bytes = static_cast<long long>(lb_.saved_bytes() + z_.saved_bytes()),
            .ws = ws_sizes_};
  }
  // Allocates a context's buffers unless they have this layer's sizes already (its first
  // forward, or one filled by a layer of other options). On failure the context holds none.
  status prepare(context& c) {
    const auto k = key();
    if (c.key_ == k) return {};
    c = context{};
    const long long N = k.tokens, H = k.hidden, E = k.experts, K = k.topk;
    buffer_maker make{*x_};
    for (status st :
         {make(c.input_, N, padded<T>(H)), make(c.logits_, N, E), make(c.probs_, N, K),
          make(c.indices_, N, K), make(c.kept_, k.drop ? N : 1, k.drop ? K : 1),
          make(c.loss_saved_, 1, buffer_maker::bytes(static_cast<std::size_t>(k.loss_bytes))),
          make(c.saved_, 1, buffer_maker::bytes(k.ws.saved))})
      if (!st) {
        c = context{};
        return st;
      }
    if (k.shared_bytes > 0)
      if (auto st =
              make(c.sh_saved_, 1, buffer_maker::bytes(static_cast<std::size_t>(k.shared_bytes)));
          !st) {
        c = context{};
        return st;
      }
    c.host_.assign(k.ws.host, std::byte{0});
    c.key_ = k;
    return {};
  }

  // The rows each expert receives from this forward added to the bias's counts: with a drop
  // policy the kept and filler rows (kept_record_kernel's dispatched), dropless every routed pair
  // (an exact integer histogram of the record, whose ids the router wrote: its fault word stays
  // {-1, 0}).
  status add_routed_counts(const context& ctx, int n) {
    if (drop_) return bias_->add_counts(*x_, routed_.cview(), dropped_.cview(), padded_.cview());
    if (auto st =
            x_->expert_histogram(ctx.indices_.cview().first(n), histogram_.view(), fault_.view());
        !st)
      return st;
    return bias_->add_counts(*x_, histogram_.cview());
  }
  // The losses' saved bytes of a context, and their forward's workspace.
  std::span<std::byte> loss_saved(context& ctx) const noexcept {
    return {ctx.loss_saved_.view().data(), static_cast<std::size_t>(ctx.key_.loss_bytes)};
  }
  std::span<std::byte> loss_workspace() const noexcept {
    return {loss_ws_.view().data(), static_cast<std::size_t>(loss_ws_.view().width())};
  }

  // The largest pad-mode capacity (that of max_tokens), or none without pad mode.
  std::optional<int> max_pad_rows() const {
    if (!drop_ || !drop_->pad_to_capacity) return std::nullopt;
    auto c = expert_capacity(static_cast<long long>(drop_ranks()) * o_.max_tokens * o_.router.topk,
                             o_.router.num_experts, drop_->capacity_factor);
    return c ? std::optional<int>(*c) : std::nullopt;  // make() checked it
  }

  // The order keys' rules (simt_full_sequence), and full-sequence dropping's group.
  status check_order_keys(row_view<const std::int64_t, space> keys, const moe_layer_groups<Comm>& g,
                          int n) const {
    using detail::to_decimal;
    if (!keys.empty() && drop_group_ == 0)
      return make_error(errc::invalid_argument,
                        "simt_moe_layer: order keys are for full-sequence dropping "
                        "(simt_full_sequence); this layer has none");
    if (!keys.empty() && (keys.rows() != n || keys.width() != 1 || !keys.contiguous()))
      return make_error(
          errc::shape_mismatch,
          "simt_moe_layer: the order keys must be contiguous [N, 1] = [" + to_decimal(n) + ", 1]");
    if (drop_group_ > 0 && g.tp_cp.size() != drop_group_)
      return make_error(errc::shape_mismatch,
                        "simt_moe_layer: full-sequence dropping was made for a tp-cp group of " +
                            to_decimal(drop_group_) + " ranks; moe_layer_groups::tp_cp has " +
                            to_decimal(g.tp_cp.size()));
    return {};
  }

  // The drop decision (dispatch/capacity_keep.hpp, the policies every layer runs): sub-sequence
  // dropping over this rank's n tokens, full-sequence over the tp-cp group's (their record and
  // keys gathered by the policy); this rank's keep mask, kept record (-1 where dropped),
  // per-expert counts and totals, and the sticky fault words device_status reads. Returns C.
  expected<int> drop_pairs(context& ctx, int n, Comm& tp_cp,
                           row_view<const std::int64_t, space> keys) {
    const drop_input<float, space> in{.experts = ctx.indices_.cview().first(n),
                                      .probs = ctx.probs_.cview().first(n),
                                      .order_keys = keys};
    const drop_output<space> out{.keep = keep_.view().first(n),
                                 .kept = ctx.kept_.view().first(n),
                                 .routed = routed_.view(),
                                 .dropped = dropped_.view(),
                                 .padded = padded_.view(),
                                 .totals = drop_totals_.view(),
                                 .faults = drop_faults_.view()};
    const std::span<std::byte> ws(drop_ws_.view().data(),
                                  static_cast<std::size_t>(drop_ws_.view().width()));
    const sub_sequence& r = *drop_;
    auto d = drop_group_ > 0 ? full_sequence{.capacity_factor = r.capacity_factor,
                                             .pad_to_capacity = r.pad_to_capacity,
                                             .by = r.by}
                                   .apply(*x_, tp_cp, in, out, ws)
                             : r.apply(*x_, tp_cp, in, out, ws);
    if (!d)
      return unexpected<error>(make_error(d.error().code, "simt_moe_layer: " + d.error().message));
    return *d->capacity;
  }
  // The drop decision's workspace for max_tokens (over the group with full-sequence dropping).
  std::size_t drop_workspace_bytes() const {
    const drop_shape shape{.max_tokens = o_.max_tokens,
                           .topk = o_.router.topk,
                           .num_experts = o_.router.num_experts,
                           .group = drop_ranks()};
    return drop_group_ > 0 ? full_sequence{}.workspace_bytes<float>(shape)
                           : drop_->workspace_bytes<float>(shape);
  }

  // The shared expert's TP communicator: given, of the options' size and rank.
  status check_tp(const moe_layer_groups<Comm>& g) const {
    using detail::to_decimal;
    const auto& so = o_.shared_expert;
    if (g.tp == nullptr)
      return make_error(errc::invalid_argument,
                        "simt_moe_layer: the layer has a shared expert; pass the attention TP "
                        "communicator in moe_layer_groups::tp");
    if (g.tp->size() != so.tp || g.tp->rank() != so.tp_rank)
      return make_error(errc::shape_mismatch,
                        "simt_moe_layer: the options say shared_expert.tp = " + to_decimal(so.tp) +
                            ", tp_rank = " + to_decimal(so.tp_rank) + "; the TP communicator has " +
                            to_decimal(g.tp->size()) + " ranks and this is rank " +
                            to_decimal(g.tp->rank()));
    return {};
  }
  // The shared expert's saved part of a context, and its scratch.
  static std::span<std::byte> shared_saved(context& ctx) noexcept {
    const auto v = ctx.sh_saved_.view();
    return {v.data(), static_cast<std::size_t>(v.width())};
  }
  std::span<std::byte> shared_scratch() const noexcept {
    return {sh_scratch_.view().data(), static_cast<std::size_t>(sh_scratch_.view().width())};
  }

  Exec* x_;
  // The shared expert (with moe_layer_options::shared_expert.ffn > 0) on the caller's
  // parameters, and its scratch (dead after each call).
  using shared_type = shared_expert<T, Exec, Comm, grad_type>;
  std::optional<shared_type> shared_{};
  buffer<std::byte> sh_scratch_;
  moe_layer_options o_;
  router_type router_;
  row_view<const T, space> router_w_{};    // [E, H] the caller's
  row_view<grad_type, space> router_g_{};  // [E, H] the caller's
  buffer<std::byte> router_ws_;            // the router's GEMM workspace
  std::span<std::byte> router_workspace() const noexcept {
    return {router_ws_.view().data(), static_cast<std::size_t>(router_ws_.view().width())};
  }
  Dispatcher disp_;
  Experts experts_;
  bool training_ = true;
  context own_{};  // the one-in-flight form's
  // The scratch of one forward or backward (dead after the call), in the context's memory.
  buffer<float> dprobs_;               // [N, k]
  buffer<float> dlogits_, dx_router_;  // [N, E], [N, H] (rows padded: hidden_rows)
  buffer<T> rows_a_, rows_b_;          // [M, H]: y then dy; dx rows (rows padded)
  buffer<float> prob_rows_;            // [M, 1] dprob rows
  // The losses and the expert bias (routing/: the objects every layer runs), the load-balancing
  // forward's workspace.
  load_balancing_losses<float, Exec> lb_{};
  router_z_loss<float, Exec> z_{};
  std::optional<moefold::expert_bias<Exec>> bias_{};
  buffer<std::byte> loss_ws_;
  buffer<int> histogram_, fault_;  // [1, E], [1, 2]
  // The drop decision's buffers (allocated with a drop policy only; the kept record is the
  // context's). drop_: the capacity rule (sub-sequence's fields, full-sequence's alike);
  // drop_group_: the tp-cp ranks of full-sequence dropping (0: sub-sequence); policy_: as make()
  // was given it.
  std::optional<sub_sequence> drop_{};
  int drop_group_ = 0;
  std::optional<simt_drop_policy> policy_{};
  // The ranks whose tokens one keep decision sees: the tp-cp group, or this rank alone.
  int drop_ranks() const { return drop_group_ > 0 ? drop_group_ : 1; }
  buffer<std::uint8_t> keep_;              // [N, k] 1 kept, 0 dropped
  buffer<int> routed_, dropped_, padded_;  // [1, E] each
  buffer<int> drop_faults_;                // [1, 3] sticky until device_status reads them
  buffer<std::byte> drop_ws_;              // the decision's workspace
  buffer<long long> drop_totals_;          // [1, 2] dropped pairs, fully dropped tokens
  buffer<std::byte> scratch_;              // the dispatcher's scratch part
  // The routed experts' and the shared MLP's workspace (their calls never overlap): the larger
  // of expert_workspace_bytes for the receive bound and the shared MLP's for tp N rows.
  buffer<std::byte> experts_ws_;
  std::span<std::byte> experts_workspace() const noexcept {
    return {experts_ws_.view().data(), static_cast<std::size_t>(experts_ws_.view().width())};
  }
  dispatch_workspace_bytes ws_sizes_{};
};

}  // namespace v0_1
}  // namespace moefold
