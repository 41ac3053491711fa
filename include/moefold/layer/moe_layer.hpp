//! @file moe_layer.hpp
//! @brief One MoE layer on the host: gating -> router -> drop policy -> dispatcher -> experts ->
//! combine (+ an optional shared expert), forward and backward, with the load-balancing losses
//! (per micro-batch, per sequence, per global batch), the z-loss and the expert bias. It holds its
//! experts functor, its running statistics and its scratch, and nothing global; its router and
//! shared-expert parameters are its own until bind_parameters() points it at a caller's
//! (moe_layer_params: read in place, gradients accumulated into the caller's buffers);
//! gradient reduction across ranks is an explicit step (reduce_gradients), with the group of each
//! parameter stated, and so is the end of a global batch (end_global_batch).
//!
//! Forwards in flight: forward(input, groups, out, context, storage) fills a moe_forward_context
//! whose saved activations live in the caller's storage (saved_sizes() tells how much), and
//! backward(context, ...) consumes it, in any order; recompute() refills a context whose
//! activations were dropped. forward(n, x, ...) / backward(dout, ...) are the one-in-flight
//! convenience over a context and storage the layer holds.
//!
//! Gradient groups (the class of bug users hit in Megatron-Core with ETP > 1 is reducing expert
//! gradients over the wrong group):
//!   - expert weights: edp (replicated over EDP; each tp-ep group sees different tokens)
//!   - router weight: tp-dp-cp (a sequence-parallel parameter: each rank saw only its own tokens)
//!   - shared-expert MLP: dp-cp (sharded over TP, each shard saw its TP group's tokens)
//!   - shared-expert gate: tp-dp-cp (replicated over TP, saw only this rank's tokens)
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../dispatch/capacity_keep.hpp"
#include "../dispatch/dispatch_args.hpp"
#include "../dispatch/drop_args.hpp"
#include "../dispatch/drop_counts.hpp"
#include "../dispatch/token_dispatcher.hpp"
#include "../experts/expert_fn.hpp"
#include "../experts/shared_expert.hpp"
#include "../mesh/groups.hpp"
#include "../routing/expert_bias.hpp"
#include "../routing/load_balancing_losses.hpp"
#include "../routing/router.hpp"
#include "../routing/router_gating.hpp"
#include "../routing/router_z_loss.hpp"
#include "../routing/topk_router.hpp"
#include "../routing/topk_routing.hpp"
#include "moe_forward_context.hpp"
#include "moe_layer_communicators.hpp"
#include "moe_layer_params.hpp"

namespace moefold {
inline namespace v0_1 {

//! The shared expert of a layer (Megatron-Core `moe_shared_expert_intermediate_size`): a dense
//! MLP every token goes through, sharded over the attention TP group.
struct moe_shared_expert_options {
  int ffn = 0;                          //!< its FFN size F_s; 0: no shared expert
  activation act = activation::swiglu;  //!< its activation
  bool gate = false;                    //!< out *= sigmoid(x . w_g) (moe_shared_expert_gate)
  int tp = 1;                           //!< attention TP
  int tp_rank = 0;                      //!< this rank's index in the TP group
};

struct moe_layer_options {
  int hidden = 0;                         //!< H
  int max_tokens = 0;                     //!< upper bound of N on every rank
  std::optional<int> max_recv_rows{};     //!< dispatch_shape::max_recv_rows (unset: worst case)
  int ep = 1;                             //!< EP of the fold
  int etp = 1;                            //!< ETP of the fold
  topk_router_options router{};           //!< E, k, score function, expert bias, ...
  double aux_loss_coeff = 0.0;            //!< per-micro-batch load-balancing loss (0: off)
  double z_loss_coeff = 0.0;              //!< z-loss (0: off)
  double seq_aux_loss_coeff = 0.0;        //!< per-sequence load-balancing loss (0: off)
  double global_aux_loss_coeff = 0.0;     //!< global-batch load-balancing loss (0: off)
  int batch = 1;                          //!< B sequences per micro-batch: token n = s*B + b
  float expert_bias_update_rate = 1e-3f;  //!< u of the bias update (with router.expert_bias)
  moe_shared_expert_options shared_expert{};
};

//! The dispatcher shape of a layer of these options (moe_layer and simt_moe_layer).
[[nodiscard]] inline dispatch_shape moe_dispatch_shape(const moe_layer_options& o) noexcept {
  const dispatch_shape shape{.max_tokens = o.max_tokens,
                             .hidden = o.hidden,
                             .topk = o.router.topk,
                             .num_experts = o.router.num_experts,
                             .ep = o.ep,
                             .etp = o.etp,
                             .max_recv_rows = o.max_recv_rows};
  return shape;
}

//! The load-balancing losses of a layer of these options (moe_layer and simt_moe_layer).
[[nodiscard]] inline load_balancing_options moe_load_balancing_options(
    const moe_layer_options& o) noexcept {
  return {.num_experts = o.router.num_experts,
          .topk = o.router.topk,
          .score = o.router.score,
          .max_tokens = o.max_tokens,
          .batch = o.batch,
          .aux_coeff = o.aux_loss_coeff,
          .seq_aux_coeff = o.seq_aux_loss_coeff,
          .global_aux_coeff = o.global_aux_loss_coeff};
}

//! One forward's input: x [N, H] and, for full-sequence dropping by position, the tokens' true
//! sequence positions `order_keys` [N] (or empty; see sequence_order_keys).
template <class T>
struct moe_forward_input {
  int num_tokens = 0;                          //!< N <= max_tokens
  std::span<const T> x{};                      //!< [N, H]
  std::span<const std::int64_t> order_keys{};  //!< [N] or empty
};

//! A layer's state besides its weights, as plain data for a trainer's checkpoint: the expert
//! bias and this global batch's routed counts (empty without router.expert_bias), the global
//! load-balancing loss's running counts and the micro-batches they cover (empty and 0 without
//! global_aux_loss_coeff). Saved after any backward and loaded into a layer of the same options,
//! it continues the run exactly (tested bitwise).
struct moe_layer_state {
  std::vector<float> expert_bias{};         //!< [E]
  std::vector<float> expert_bias_counts{};  //!< [E] this global batch's dispatched pairs
  std::vector<double> global_aux_counts{};  //!< [E] summed over tp-dp-cp
  int global_aux_steps = 0;                 //!< micro-batches in global_aux_counts
  bool operator==(const moe_layer_state&) const = default;
};

//! The gradient group of each parameter kind of an MoE layer.
inline constexpr group_kind expert_gradient_group = group_kind::edp;
inline constexpr group_kind router_gradient_group = group_kind::tp_dp_cp;
inline constexpr group_kind shared_expert_gradient_group = group_kind::dp_cp;
inline constexpr group_kind shared_gate_gradient_group = group_kind::tp_dp_cp;

//! Types: `T` is the tokens' and the experts' element type (bf16, float, double); `Router` is any
//! routing::router, moefold's topk_router by default, whose element type R (`router_value_type`)
//! is the type of the logits, the scores, the probabilities the router gives and the losses
//! (Megatron-Core's moe_router_dtype; the default, accumulator_t<T>, is fp32 for bf16 tokens).
//! The gating GEMM (router_gating, for every router) reads the T tokens and weight and
//! accumulates in fp32 (fp64 for fp64 operands) into R. `Dispatcher` is any
//! token_dispatcher of token type T; its probability type Pt (`prob_type`: T, or wider, e.g.
//! all_to_all_dispatcher<bf16, Comm, host_exec, float>) is the type the kept probabilities are
//! converted to once (exactly when Pt is R), travel in to the experts, who apply them (Experts
//! must be an expert_fn of T and Pt on the dispatcher's context, e.g. reference_mlp or
//! mlp_experts), and whose gradients come back in (widened to R for the
//! router's backward). With Pt = R = fp32 for bf16 tokens the probabilities are never rounded to
//! 16 bits, as in Megatron-Core with moe_router_dtype='fp32'. The router weight is a T parameter
//! with a main_grad_t<T> gradient.
template <class T, communicator Comm, class Policy, class Dispatcher, class Experts,
          class Router = topk_router<T, typename Dispatcher::exec_type>>
requires expert_fn<Experts, typename Dispatcher::exec_type, T, typename Dispatcher::prob_type> &&
    drop_policy<Policy, typename Router::value_type, typename Dispatcher::exec_type, Comm> &&
    token_dispatcher<Dispatcher, Comm> && routing::router<Router, typename Dispatcher::exec_type> &&
    std::same_as<typename Dispatcher::value_type, T> &&
    std::floating_point<typename Router::value_type> &&
    communicator_for<Comm, typename Dispatcher::exec_type, T>
class moe_layer {
 public:
  using value_type = T;
  //! The router's element type R: logits, scores, probabilities, losses and their gradients.
  using router_value_type = typename Router::value_type;
  //! The type the kept probabilities travel to the experts in (the dispatcher's prob_type).
  using prob_type = typename Dispatcher::prob_type;

 private:
  using R = router_value_type;
  using Pt = prob_type;
  using exec_t = typename Dispatcher::exec_type;
  // moefold's router (any of its GEMM policies), which takes the expert bias.
  static constexpr bool is_topk_router = is_topk_router_v<Router>;
  // The gating linear for every router (topk_router's own runs the same code).
  using gating_type = router_gating<T, exec_t, R>;

 public:
  //! The element type of the router's and the shared expert's gradients (fp32 for bf16 weights).
  using grad_type = main_grad_t<T>;
  using params_type = moe_layer_params<T, grad_type>;
  using dispatcher_type = Dispatcher;
  using router_type = Router;
  //! The execution context the layer's row operations run on (its dispatcher's).
  using exec_type = typename Dispatcher::exec_type;
  //! One forward in flight (see moe_forward_context).
  using context_type = moe_forward_context<moe_layer>;

  //! A layer with moefold's top-k router made from `o.router`.
  [[nodiscard]] static expected<moe_layer> make(const moe_layer_options& o, Policy policy,
                                                Experts experts) requires is_topk_router {
    auto router = Router::make(o.router, o.hidden);
    if (!router) return unexpected<error>(router.error());
    return make(o, std::move(policy), std::move(experts), std::move(*router));
  }

  //! A layer with the caller's router, which must select `o.router.topk` of
  //! `o.router.num_experts` experts; the load-balancing losses score the logits with
  //! `o.router.score`; the expert bias is topk_router's alone.
  [[nodiscard]] static expected<moe_layer> make(const moe_layer_options& o, Policy policy,
                                                Experts experts, Router router) {
    using detail::to_decimal;
    if (router.num_experts() != o.router.num_experts || router.topk() != o.router.topk)
      return make_error(errc::shape_mismatch,
                        "moe_layer: the router selects " + to_decimal(router.topk()) + " of " +
                            to_decimal(router.num_experts()) + " experts; the options say " +
                            to_decimal(o.router.topk) + " of " + to_decimal(o.router.num_experts));
    if (o.router.expert_bias && !is_topk_router)
      return make_error(errc::invalid_argument,
                        "moe_layer: router.expert_bias needs moefold's topk_router (a user router "
                        "takes no bias)");
    auto disp = Dispatcher::make(dispatch_shape_of(o));
    if (!disp) return unexpected<error>(disp.error());
    if (experts.hidden() != o.hidden || experts.num_local_experts() * o.ep != o.router.num_experts)
      return make_error(
          errc::shape_mismatch,
          "moe_layer: the experts hold " + to_decimal(experts.num_local_experts()) +
              " local experts of hidden size " + to_decimal(experts.hidden()) +
              "; the layer needs num_experts / ep = " + to_decimal(o.router.num_experts / o.ep) +
              " of size " + to_decimal(o.hidden));
    const bool losses_ok = std::isfinite(o.aux_loss_coeff) && o.aux_loss_coeff >= 0 &&
                           std::isfinite(o.z_loss_coeff) && o.z_loss_coeff >= 0 &&
                           std::isfinite(o.seq_aux_loss_coeff) && o.seq_aux_loss_coeff >= 0 &&
                           std::isfinite(o.global_aux_loss_coeff) && o.global_aux_loss_coeff >= 0;
    if (!losses_ok)
      return make_error(errc::invalid_argument,
                        "moe_layer: loss coefficients must be finite and >= 0 (0 turns one off)");
    if (o.batch < 1)
      return make_error(errc::invalid_argument,
                        "moe_layer: batch (sequences per micro-batch) "
                        "must be >= 1");
    if (o.router.expert_bias &&
        !(std::isfinite(o.expert_bias_update_rate) && o.expert_bias_update_rate >= 0))
      return make_error(errc::invalid_argument,
                        "moe_layer: expert_bias_update_rate must be finite and >= 0");
    if (o.shared_expert.ffn < 0)
      return make_error(errc::invalid_size, "moe_layer: shared_expert.ffn must be >= 0");
    auto gating = gating_type::make(o.router.num_experts, o.hidden);
    if (!gating) return unexpected<error>(gating.error());
    moe_layer l(o, std::move(router), std::move(policy), std::move(*disp), std::move(experts));
    l.gating_ = *gating;
    l.gating_ws_.resize(gating_type::workspace_bytes());
    const auto E = static_cast<std::size_t>(o.router.num_experts), H = detail::uz(o.hidden);
    const auto N = detail::uz(o.max_tokens);
    l.own_w_.assign(E * H, T(0));
    l.own_dw_.assign(E * H, grad_type(0));
    l.w_ = l.own_w_;
    l.dw_ = l.own_dw_;
    auto lb = load_balancing_type::make(*l.exec_, moe_load_balancing_options(o));
    if (!lb) return unexpected<error>(lb.error());
    l.lb_ = std::move(*lb);
    auto z = z_loss_type::make(o.router.num_experts, o.max_tokens, o.z_loss_coeff);
    if (!z) return unexpected<error>(z.error());
    l.z_ = *z;
    l.loss_ws_.resize(l.lb_.workspace_bytes());
    if (o.router.expert_bias) {
      auto b = moefold::expert_bias<exec_t>::make(*l.exec_, o.router.num_experts,
                                                  o.expert_bias_update_rate);
      if (!b) return unexpected<error>(b.error());
      l.bias_.emplace(std::move(*b));
    }
    if (o.shared_expert.ffn > 0) {
      auto se = shared_type::make(*l.exec_, {.max_tokens = o.max_tokens,
                                             .hidden = o.hidden,
                                             .ffn = o.shared_expert.ffn,
                                             .tp = o.shared_expert.tp,
                                             .tp_rank = o.shared_expert.tp_rank,
                                             .act = o.shared_expert.act,
                                             .gate = o.shared_expert.gate});
      if (!se) return unexpected<error>(se.error());
      l.shared_.emplace(std::move(*se));
      l.shared_scratch_.resize(l.shared_->scratch_bytes());
    }
    // Sized once (nothing is allocated per step here; the router and policy reference code
    // allocate their own records): the dispatcher's scratch, the one-in-flight form's storage,
    // the experts' output rows (at most the receive bound; pad mode may grow them).
    l.scratch_ws_.resize(l.disp_.workspace_sizes(std::nullopt).scratch);
    l.logits_.resize(N * E);
    const moe_saved_bytes sb = l.saved_sizes();
    l.own_saved_.resize(sb.saved);
    l.own_host_.resize(sb.host);
    const auto recv = o.max_recv_rows.value_or(detail::worst_recv_rows(l.disp_.shape()));
    l.y_.reserve(detail::uz(recv) * H);
    l.grow_experts_ws(static_cast<int>(recv));
    return l;
  }

  //! `o` with EP, ETP, the attention TP and this rank's TP position taken from the communicators
  //! (options left at their defaults take them; a differing value is an error naming both).
  [[nodiscard]] static expected<moe_layer_options> options_for(
      moe_layer_options o, const moe_layer_communicators<Comm>& c) {
    using detail::to_decimal;
    const auto take = [](int& field, int value, const char* name) -> status {
      if (field != 1 && field != value)
        return make_error(errc::shape_mismatch, std::string("moe_layer: the options say ") + name +
                                                    " = " + to_decimal(field) +
                                                    ", the communicators " + to_decimal(value));
      field = value;
      return {};
    };
    if (auto st = take(o.ep, c.ep.size(), "ep"); !st) return unexpected<error>(st.error());
    if (auto st = take(o.etp, c.etp.size(), "etp"); !st) return unexpected<error>(st.error());
    if (auto st = take(o.shared_expert.tp, c.tp.size(), "shared_expert.tp"); !st)
      return unexpected<error>(st.error());
    if (o.shared_expert.tp_rank != 0 && o.shared_expert.tp_rank != c.tp.rank())
      return make_error(errc::shape_mismatch,
                        "moe_layer: the options say shared_expert.tp_rank = " +
                            to_decimal(o.shared_expert.tp_rank) + ", the TP communicator " +
                            to_decimal(c.tp.rank()));
    o.shared_expert.tp_rank = c.tp.rank();
    return o;
  }
  //! A layer with moefold's top-k router on the communicators' mapping (see options_for).
  [[nodiscard]] static expected<moe_layer> make(
      const moe_layer_options& o, Policy policy, Experts experts,
      const moe_layer_communicators<Comm>& c) requires is_topk_router {
    auto full = options_for(o, c);
    if (!full) return unexpected<error>(full.error());
    return make(*full, std::move(policy), std::move(experts));
  }

  //! The dispatcher shape of a layer.
  [[nodiscard]] static dispatch_shape dispatch_shape_of(const moe_layer_options& o) noexcept {
    return moe_dispatch_shape(o);
  }
  //! The dispatcher workspace a layer of these options holds, per part (saved for the backward;
  //! scratch, which layers of a model could share), without making the layer or allocating.
  [[nodiscard]] static expected<dispatch_workspace_bytes> workspace_sizes(
      const moe_layer_options& o, std::optional<int> capacity = {}) {
    auto d = Dispatcher::make(dispatch_shape_of(o));
    if (!d) return unexpected<error>(d.error());
    return d->workspace_sizes(capacity);
  }
  //! What this layer's one-in-flight form holds now, per part (pad mode grows it).
  [[nodiscard]] dispatch_workspace_bytes workspace_sizes() const noexcept {
    return {own_saved_.size(), scratch_ws_.size(), own_host_.size()};
  }
  //! The storage one forward in flight needs until its backward: the input copy [N, H], the
  //! logits [N, E], the dispatcher's saved and host parts and the shared expert's saved part, for
  //! N = max_tokens. In pad mode pass the capacity C the drop policy reports
  //! (drop_counts::pad_rows): the dispatched rows grow with it.
  [[nodiscard]] moe_saved_bytes saved_sizes(std::optional<int> capacity = {}) const {
    const dispatch_workspace_bytes d = disp_.workspace_sizes(capacity);
    workspace_carver c;
    (void)carve_saved(c, d);
    return {c.required(), d.host};
  }

  //! Pad mode with forwards in flight: sizes the scratch the forwards share for capacity C up
  //! front. The scratch grows when a forward's C exceeds every C before, and a forward already in
  //! flight then refuses its backward (it holds views of the old scratch).
  void reserve(int capacity) { grow_scratch(disp_.workspace_sizes(capacity).scratch); }

  //! The router weight [E, H] (logits = x W^T) and its gradient: the layer's own, or the caller's
  //! after bind_parameters().
  [[nodiscard]] std::span<T> router_weight() noexcept { return w_; }
  [[nodiscard]] std::span<grad_type> router_weight_grad() noexcept { return dw_; }

  //! The element counts bind_parameters() expects.
  [[nodiscard]] moe_layer_param_sizes param_sizes() const noexcept {
    moe_layer_param_sizes n;
    n.router = detail::uz(o_.router.num_experts) * detail::uz(o_.hidden);
    if (shared_) {
      n.shared = shared_->mlp_sizes_needed();
      n.shared_gate = o_.shared_expert.gate ? detail::uz(o_.hidden) : 0;
    }
    return n;
  }
  //! Runs on the caller's parameters from now on: reads the router weight and the shared expert's
  //! weights in place and accumulates (beta = 1) into the caller's gradient buffers, copying
  //! nothing per step; the layer's own parameter buffers are released. Checked against
  //! param_sizes() first: a refused binding changes nothing. A backward reads the weights bound
  //! when it runs, so between a forward and its backward a rebinding must point at the same
  //! values (FSDP re-gathering into a new buffer is fine; an optimizer step is not).
  [[nodiscard]] status bind_parameters(const params_type& p) {
    const moe_layer_param_sizes n = param_sizes();
    using detail::to_decimal;
    if (p.router_weight.size() != n.router || p.router_grad.size() != n.router)
      return make_error(errc::shape_mismatch,
                        "moe_layer: bind_parameters: the router weight and its gradient must be "
                        "[E, H] = " +
                            to_decimal(n.router) + " elements; got " +
                            to_decimal(p.router_weight.size()) + " and " +
                            to_decimal(p.router_grad.size()));
    const auto& sp = p.shared;
    const bool any_shared = !sp.mlp.fc1.empty() || !sp.mlp.fc2.empty() ||
                            !sp.mlp_grad.fc1.empty() || !sp.mlp_grad.fc2.empty() ||
                            !sp.gate.empty() || !sp.gate_grad.empty();
    if (!shared_ && any_shared)
      return make_error(errc::invalid_argument,
                        "moe_layer: bind_parameters: shared-expert parameters given to a layer "
                        "without a shared expert");
    if (shared_)
      if (auto st = shared_->bind(sp); !st) return st;  // checks its sizes before changing
    w_ = p.router_weight;
    dw_ = p.router_grad;
    own_w_ = {};
    own_dw_ = {};
    return {};
  }
  [[nodiscard]] Experts& experts() noexcept { return experts_; }
  //! The shared expert, or nullptr without one.
  [[nodiscard]] shared_expert<T, exec_type, Comm>* shared() noexcept {
    return shared_ ? &*shared_ : nullptr;
  }
  //! The expert bias and this global batch's routed-token counts (empty unless the router options
  //! enable the bias). Load a checkpointed bias into bias.
  [[nodiscard]] moefold::expert_bias<exec_t>* expert_bias() noexcept {
    return bias_ ? &*bias_ : nullptr;
  }
  //! The running counts of the global load-balancing loss.
  [[nodiscard]] const load_balancing_losses<R, exec_t>& load_balancing() const noexcept {
    return lb_;
  }
  [[nodiscard]] const Dispatcher& dispatcher() const noexcept { return disp_; }
  //! The dispatch handle of the last one-in-flight forward (rows per local expert, bytes).
  [[nodiscard]] const auto& last_dispatch() const noexcept { return own_ctx_.dispatch(); }
  //! The routing of the last one-in-flight forward (every selected expert), its keep mask [N*k]
  //! (what the drop policy kept) and the record the dispatcher took: expert [N*k], -1 for a
  //! dropped pair. A caller's context has the same accessors.
  [[nodiscard]] const topk_routing<R>& last_routing() const noexcept { return own_ctx_.routing(); }
  [[nodiscard]] std::span<const std::uint8_t> last_keep() const noexcept { return own_ctx_.keep(); }
  [[nodiscard]] std::span<const int> last_kept_experts() const noexcept {
    return own_ctx_.kept_experts();
  }

  //! The state besides the weights (see moe_layer_state).
  [[nodiscard]] moe_layer_state save_state() const {
    moe_layer_state st;
    if (bias_) (void)bias_->save(*exec_, st.expert_bias, st.expert_bias_counts);  // host_exec
    if (o_.global_aux_loss_coeff > 0) {
      const auto run = lb_.running_counts();
      st.global_aux_counts.resize(detail::uz(run.width()));
      (void)exec_->copy(run,
                        row_view<double, host_space>(st.global_aux_counts.data(), 1, run.width()));
      st.global_aux_steps = lb_.running_steps();
    }
    return st;
  }
  //! Loads a saved state; checked first (sizes for these options, finite values, counts and steps
  //! >= 0), so a refused state changes nothing.
  [[nodiscard]] status load_state(const moe_layer_state& st) {
    const auto E = detail::uz(o_.router.num_experts);
    const std::size_t want_bias = o_.router.expert_bias ? E : 0;
    const bool global_on = o_.global_aux_loss_coeff > 0;
    if (st.expert_bias.size() != want_bias || st.expert_bias_counts.size() != want_bias)
      return make_error(errc::shape_mismatch,
                        "moe_layer: load_state: the expert bias and its counts must have " +
                            detail::to_decimal(want_bias) +
                            " entries for these options (E with router.expert_bias, else 0)");
    if (!(st.global_aux_counts.size() == (global_on ? E : 0) ||
          (global_on && st.global_aux_counts.empty() && st.global_aux_steps == 0)))
      return make_error(errc::shape_mismatch,
                        "moe_layer: load_state: the global aux counts must have E entries with "
                        "global_aux_loss_coeff > 0 (or none, at the start of a global batch), "
                        "else none");
    const auto finite_nonneg = [](auto v) { return std::isfinite(v) && v >= 0; };
    if (!std::all_of(st.expert_bias.begin(), st.expert_bias.end(),
                     [](float v) { return std::isfinite(v); }) ||
        !std::all_of(st.expert_bias_counts.begin(), st.expert_bias_counts.end(), finite_nonneg) ||
        !std::all_of(st.global_aux_counts.begin(), st.global_aux_counts.end(), finite_nonneg) ||
        st.global_aux_steps < 0 || (!global_on && st.global_aux_steps != 0))
      return make_error(errc::invalid_argument,
                        "moe_layer: load_state: values must be finite, counts and steps >= 0");
    if (bias_)
      if (auto s = bias_->load(*exec_, st.expert_bias, st.expert_bias_counts); !s) return s;
    return lb_.load_running(*exec_, st.global_aux_counts, st.global_aux_steps);
    return {};
  }

  //! Training (default) or evaluation. In evaluation the forward computes no auxiliary losses
  //! and does not count tokens for the expert bias (Megatron-Core does both only with gradients
  //! enabled); the output is the same.
  void set_training(bool training) noexcept { training_ = training; }
  [[nodiscard]] bool training() const noexcept { return training_; }

  //! out [N, H] for x [N, H], into `ctx`, whose saved activations go to `storage` (see
  //! saved_sizes()); `ctx` and `storage` stay with this forward until its backward. In training
  //! it adds the routed counts to the expert bias and the global aux loss's running counts.
  [[nodiscard]] expected<moe_forward_stats> forward(const moe_forward_input<T>& in,
                                                    const moe_layer_groups<Comm>& g,
                                                    std::span<T> out, context_type& ctx,
                                                    const moe_saved_storage& storage) {
    return run_forward(in, g, out, ctx, storage, /*recompute=*/false);
  }

  //! Activation recomputation: refills `ctx` (a forward whose activations were dropped, or
  //! whose storage is to be replaced) from the same input, into `storage`, before its backward.
  //! It changes no layer state (bias counts, running counts) and reuses the losses' terms the
  //! forward kept in `ctx`, so the backward equals the stored-activation one bitwise; `out` is
  //! written again. Every rank of the layer's groups recomputes together (it is collective).
  [[nodiscard]] status recompute(context_type& ctx, const moe_forward_input<T>& in,
                                 const moe_layer_groups<Comm>& g, std::span<T> out,
                                 const moe_saved_storage& storage) {
    if (!ctx.filled_)
      return make_error(errc::invalid_argument,
                        "moe_layer: recompute needs a context its forward filled and its backward "
                        "has not consumed");
    if (in.num_tokens != ctx.n_)
      return make_error(errc::shape_mismatch,
                        "moe_layer: recompute with N = " + detail::to_decimal(in.num_tokens) +
                            " of a forward of N = " + detail::to_decimal(ctx.n_) +
                            " (recompute from the forward's own input)");
    auto st = run_forward(in, g, out, ctx, storage, /*recompute=*/true);
    if (!st) return unexpected<error>(st.error());
    return {};
  }

  //! dx [N, H] from dout [N, H] of the forward in `ctx`, which it consumes; `seeds` weight each
  //! loss (see moe_loss_seeds). Adds the router weight, expert and shared-expert gradients.
  //! After an evaluation forward no auxiliary loss contributes.
  [[nodiscard]] status backward(context_type& ctx, std::span<const T> dout,
                                const moe_loss_seeds<R>& seeds, const moe_layer_groups<Comm>& g,
                                std::span<T> dx) {
    if (!ctx.ready())
      return make_error(errc::invalid_argument,
                        ctx.filled_ ? "moe_layer: the context's activations were dropped; "
                                      "recompute() refills them before the backward"
                                    : "moe_layer: backward of a context no forward filled (or "
                                      "whose backward already ran)");
    const std::array<R, 5> all_seeds{seeds.output, seeds.aux, seeds.seq_aux, seeds.global_aux,
                                     seeds.z};
    if (!std::all_of(all_seeds.begin(), all_seeds.end(),
                     [](R v) { return std::isfinite(static_cast<double>(v)); }))
      return make_error(errc::invalid_argument, "moe_layer: loss seeds must be finite");
    const int E = o_.router.num_experts;
    const typename Dispatcher::handle_type& hd = *ctx.handle_;
    const int n = ctx.n_;
    const auto H = detail::uz(o_.hidden), M = detail::uz(hd.num_rows()), N = detail::uz(n),
               K = detail::uz(o_.router.topk);
    if (dout.size() != N * H || dx.size() != N * H)
      return make_error(errc::shape_mismatch, "moe_layer: dout and dx must be [N, H]");
    if (shared_ && g.tp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the layer has a shared expert; pass the attention TP "
                        "communicator in moe_layer_groups::tp");
    // Experts' path. The scratch buffers are members, zeroed each step: their capacity is reused,
    // so steady-state steps allocate nothing here.
    auto& [dy, dx_rows, dp_rows, dprobs, dx_experts, dout_seeded] = scratch_;
    auto& [dprobs_r, dlogits, dx_router] = router_scratch_;
    std::span<const T> dmain = dout;  // the main output's gradient, times its seed
    if (seeds.output != R(1)) {
      dout_seeded.resize(N * H);
      if (auto st = exec_->copy(rows(dout), rows(std::span<T>(dout_seeded))); !st) return st;
      if (auto st = exec_->template scale<T>(rows(std::span<T>(dout_seeded)),
                                             detail::narrow<T>(seeds.output));
          !st)
        return st;
      dmain = dout_seeded;
    }
    dy.assign(M * H, T(0));
    dx_rows.assign(M * H, T(0));
    dp_rows.assign(M, Pt(0));
    dprobs.assign(N * K, Pt(0));
    dx_experts.assign(N * H, T(0));
    if (ctx.scratch_epoch_ != scratch_epoch_)
      return make_error(errc::invalid_argument,
                        "moe_layer: the layer's scratch grew (a pad-mode capacity above any "
                        "before) while this forward was in flight; size it first with "
                        "reserve(capacity)");
    if (auto st = disp_.combine_backward(hd, dmain, g.dispatch, dy); !st) return st;
    ctx.filled_ = false;  // from here the backward has begun: the context is consumed
    if (auto st = experts_.backward(*exec_, hd.batch(), rows(std::span<const T>(dy)),
                                    rows(std::span<T>(dx_rows)), rows(std::span<Pt>(dp_rows), 1),
                                    experts_ws_);
        !st)
      return done(ctx, st);
    if (auto st = disp_.dispatch_backward(hd, dx_rows, dp_rows, g.dispatch, dx_experts, dprobs);
        !st)
      return done(ctx, st);
    // Router's path: dropped pairs have no gradient (their probabilities were not renormalised),
    // then the router Jacobian, the auxiliary losses, the gating GEMM.
    const std::span<const R> logits = ctx.logits_.first(N * detail::uz(E));
    const std::span<const T> x = ctx.x_.first(N * H);
    dlogits.assign(N * detail::uz(E), R(0));
    dx_router.assign(N * H, R(0));
    // The kept pairs' probability gradients [N, k], widened from Pt to R for the router.
    dprobs_r.resize(N * K);
    if (auto st = exec_->template convert<R, Pt>(rows(std::span<const Pt>(dprobs), o_.router.topk),
                                                 rows(std::span<R>(dprobs_r), o_.router.topk));
        !st)
      return done(ctx, st);
    if (auto st = router_.backward(
            *exec_, {.logits = rows(logits, E),
                     .indices = rows(std::span<const int>(ctx.routing_.indices), o_.router.topk),
                     .dprobs = rows(std::span<const R>(dprobs_r), o_.router.topk),
                     .dlogits = rows(std::span<R>(dlogits), E)});
        !st)
      return done(ctx, st);
    // The load-balancing terms (micro-batch, per sequence, global) and the z-loss, each when its
    // forward ran it, into the same dlogits.
    {
      const std::size_t lb_bytes = ctx.lb_.any() || ctx.z_.on ? lb_.saved_bytes() : 0;
      const std::span<std::byte> saved(ctx.loss_saved_);
      if (auto st = lb_.backward(*exec_, rows(logits, E), {}, ctx.lb_, saved.first(lb_bytes),
                                 {seeds.aux, seeds.seq_aux, seeds.global_aux},
                                 rows(std::span<R>(dlogits), E));
          !st)
        return done(ctx, st);
      if (auto st = z_.backward(*exec_, rows(logits, E), {}, ctx.z_, saved.subspan(lb_bytes),
                                seeds.z, rows(std::span<R>(dlogits), E));
          !st)
        return done(ctx, st);
    }
    // The router weight's gradient goes straight into its (caller's) buffer, beta = 1.
    if (auto st = gating_.backward(*exec_,
                                   gating_backward_args<T, R, grad_type, space_t>{
                                       .x = rows(x),
                                       .weight = rows(std::span<const T>(w_)),
                                       .dlogits = rows(std::span<const R>(dlogits), E),
                                       .dx = rows(std::span<R>(dx_router)),
                                       .weight_grad = rows(dw_)},
                                   gating_ws_);
        !st)
      return done(ctx, st);
    // dx = dx_experts + dx_router (+ dx_shared).
    if (auto st = exec_->copy(rows(std::span<const T>(dx_experts)), rows(dx)); !st)
      return done(ctx, st);
    if (auto st =
            exec_->template add_converted<T, R>(rows(std::span<const R>(dx_router)), rows(dx));
        !st)
      return done(ctx, st);
    if (shared_)  // dx += dx_shared
      if (auto st = shared_->backward(*exec_, rows(dmain), *g.tp, rows(dx), ctx.shared_saved_,
                                      shared_scratch_);
          !st)
        return done(ctx, st);
    return done(ctx, {});
  }

  //! The one-in-flight form: out [N, H] for x [N, H] into the layer's own context and storage.
  //! `order_keys` [N] (or empty) are the tokens' true sequence positions for full-sequence
  //! dropping by position (see sequence_order_keys).
  [[nodiscard]] expected<moe_forward_stats> forward(int n, std::span<const T> x,
                                                    std::span<const std::int64_t> order_keys,
                                                    const moe_layer_groups<Comm>& g,
                                                    std::span<T> out) {
    return run_forward({.num_tokens = n, .x = x, .order_keys = order_keys}, g, out, own_ctx_,
                       {own_saved_, own_host_}, /*recompute=*/false, /*grow=*/true);
  }

  //! dx [N, H] from dout [N, H] of the last one-in-flight forward; `loss_seed` is d(training
  //! loss) / d(each auxiliary loss) (Megatron's aux-loss scale).
  [[nodiscard]] status backward(std::span<const T> dout, R loss_seed,
                                const moe_layer_groups<Comm>& g, std::span<T> dx) {
    if (!own_ctx_.ready())
      return make_error(errc::invalid_argument, "moe_layer: backward before forward");
    const moe_loss_seeds<R> seeds{.output = R(1),
                                  .aux = loss_seed,
                                  .seq_aux = loss_seed,
                                  .global_aux = loss_seed,
                                  .z = loss_seed};
    return backward(own_ctx_, dout, seeds, g, dx);
  }

  //! Sums the local gradients over their groups: the router weight over tp-dp-cp, the experts'
  //! over edp, and with a shared expert its MLP over `dp_cp` and its gate over tp-dp-cp.
  //! `expert_grads` lists the experts' gradient buffers (e.g. {grads_fc1, grads_fc2}).
  [[nodiscard]] status reduce_gradients(Comm& tp_dp_cp, Comm& edp,
                                        std::initializer_list<std::span<grad_type>> expert_grads,
                                        Comm* dp_cp = nullptr) {
    if (shared_ && dp_cp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the shared expert's gradients are reduced over dp-cp; pass "
                        "that communicator");
    if (auto st = tp_dp_cp.template all_reduce<grad_type>(dw_, reduce_op::sum); !st) return st;
    if (auto st = all_reduce_each<grad_type>(edp, expert_grads, reduce_op::sum); !st) return st;
    if (shared_) {
      const auto& sg = shared_->params();
      if (auto st = all_reduce_each<grad_type>(*dp_cp, {sg.grads.fc1.flat(), sg.grads.fc2.flat()},
                                               reduce_op::sum);
          !st)
        return st;
      if (o_.shared_expert.gate)
        if (auto st = tp_dp_cp.template all_reduce<grad_type>(sg.gate_grad.flat(), reduce_op::sum);
            !st)
          return st;
    }
    return {};
  }

  //! reduce_gradients over the bundle's groups (tp-dp-cp, edp, dp-cp).
  [[nodiscard]] status reduce_gradients(moe_layer_communicators<Comm>& c,
                                        std::initializer_list<std::span<grad_type>> expert_grads) {
    return reduce_gradients(c.tp_dp_cp, c.edp, expert_grads, &c.dp_cp);
  }
  //! The same with the experts' own gradient views (`grads()`, as mlp_experts and reference_mlp
  //! expose them): no list from the caller.
  [[nodiscard]] status reduce_gradients(moe_layer_communicators<Comm>& c) requires
      exposes_expert_grads<Experts, grad_type, typename exec_type::memory_space> {
    const auto& g = experts_.grads();
    return reduce_gradients(c.tp_dp_cp, c.edp, {g.fc1.flat(), g.fc2.flat()}, &c.dp_cp);
  }
  //! end_global_batch over the bundle's tp-dp-cp.
  [[nodiscard]] status end_global_batch(moe_layer_communicators<Comm>& c) {
    return end_global_batch(c.tp_dp_cp);
  }

  //! Once per global batch, after the last backward: updates the expert bias from the counts of
  //! the whole stage (bias += rate * sign(mean - count), counts summed over tp-dp-cp) and restarts
  //! the global load-balancing loss's running counts. Collective over tp-dp-cp when the bias is
  //! enabled.
  [[nodiscard]] status end_global_batch(Comm& tp_dp_cp) {
    if (o_.router.expert_bias)
      if (auto st = bias_->update(*exec_, tp_dp_cp); !st) return st;
    return lb_.reset_running(*exec_);
    return {};
  }

 private:
  moe_layer(const moe_layer_options& o, Router r, Policy p, Dispatcher d, Experts e)
      : o_(o),
        router_(std::move(r)),
        policy_(std::move(p)),
        disp_(std::move(d)),
        experts_(std::move(e)) {}

  // The saved part of one forward in flight, carved by one function for its size and its views.
  struct saved_views {
    std::span<T> x;                            // [max_tokens, H]
    std::span<R> logits;                       // [max_tokens, E]
    std::span<std::byte> dispatch, shared_ex;  // the dispatcher's and the shared expert's parts
  };
  saved_views carve_saved(workspace_carver& c, const dispatch_workspace_bytes& d) const {
    const auto N = detail::uz(o_.max_tokens), H = detail::uz(o_.hidden),
               E = detail::uz(o_.router.num_experts);
    saved_views v;
    v.x = c.take<T>(N * H);
    v.logits = c.take<R>(N * E);
    v.dispatch = c.take<std::byte>(d.saved);
    v.shared_ex = c.take<std::byte>(shared_ ? shared_->saved_bytes() : 0);
    return v;
  }

  // The forward, or (recompute) its side-effect-free repetition into a filled context. With
  // `grow` the storage is the layer's own, grown to what pad mode needs.
  [[nodiscard]] expected<moe_forward_stats> run_forward(const moe_forward_input<T>& in,
                                                        const moe_layer_groups<Comm>& g,
                                                        std::span<T> out, context_type& ctx,
                                                        moe_saved_storage storage, bool recompute,
                                                        bool grow = false) {
    const int E = o_.router.num_experts, n = in.num_tokens;
    const auto H = detail::uz(o_.hidden);
    const std::span<const T> x = in.x;
    if (n < 0 || n > o_.max_tokens || x.size() != detail::uz(n) * H ||
        out.size() != detail::uz(n) * H)
      return make_error(errc::shape_mismatch,
                        "moe_layer: x and out must be [N, H] with N <= "
                        "max_tokens");
    if (shared_ && g.tp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the layer has a shared expert; pass the attention TP "
                        "communicator in moe_layer_groups::tp");
    const bool training = recompute ? ctx.training_ : training_;
    if (!recompute && training && o_.global_aux_loss_coeff > 0 && g.tp_dp_cp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the global load-balancing loss needs the tp-dp-cp "
                        "communicator in moe_layer_groups::tp_dp_cp");
    // A failed forward leaves nothing for a backward; a failed recompute leaves the forward's
    // terms for another try.
    ctx.drop_activations();
    if (!recompute) ctx.filled_ = false;
    // The saved part: its own pieces checked before anything runs, then, once the drop policy
    // has given the capacity (pad mode), with the dispatcher's part, before any side effect.
    const auto carve = [&](const dispatch_workspace_bytes& d) -> expected<saved_views> {
      if (grow) {
        workspace_carver m;
        (void)carve_saved(m, d);
        if (own_saved_.size() < m.required()) own_saved_.resize(m.required());
        if (own_host_.size() < d.host) own_host_.resize(d.host);
        storage = {own_saved_, own_host_};
      }
      workspace_carver c(storage.saved);
      saved_views v = carve_saved(c, d);
      if (!c.fits() || storage.host.size() < d.host)
        return make_error(
            errc::workspace_too_small,
            "moe_layer: the saved storage has " + detail::to_decimal(storage.saved.size()) +
                " saved and " + detail::to_decimal(storage.host.size()) +
                " host bytes; saved_sizes() asks for " + detail::to_decimal(c.required()) +
                " and " + detail::to_decimal(d.host));
      return v;
    };
    if (auto pre = carve({}); !pre) return unexpected<error>(pre.error());
    // The logits go to the layer's scratch first and to the saved part once it is sized.
    const std::span<R> logits = std::span<R>(logits_).first(detail::uz(n) * detail::uz(E));
    if (auto st = gating_.forward(
            *exec_,
            {.x = rows(x), .weight = rows(std::span<const T>(w_)), .logits = rows(logits, E)},
            gating_ws_);
        !st)
      return unexpected<error>(st.error());
    if (auto st = route(n, logits, ctx.routing_); !st) return unexpected<error>(st.error());
    // The drop policy decides on the context what each expert keeps: the keep mask, the kept
    // record the dispatcher takes, the counts; the selection stays whole for the router backward.
    const int K = o_.router.topk;
    const auto pairs = ctx.routing_.indices.size();
    ctx.keep_.resize(pairs);
    ctx.kept_experts_.resize(pairs);
    ctx.kept_probs_.resize(pairs);
    drop_counts counts = counts_into(ctx.report_, E);
    // The workspace for the largest forward over this tp-cp group, sized once.
    drop_ws_.resize(std::max(
        drop_ws_.size(),
        policy_.template workspace_bytes<R>(
            {.max_tokens = o_.max_tokens, .topk = K, .num_experts = E, .group = g.tp_cp.size()})));
    const row_view<const std::int64_t, space_t> keys =
        in.order_keys.empty() ? row_view<const std::int64_t, space_t>{}
                              : row_view<const std::int64_t, space_t>(in.order_keys.data(), n, 1);
    auto decided = policy_.apply(
        *exec_, g.tp_cp,
        drop_input<R, space_t>{.experts = rows(std::span<const int>(ctx.routing_.indices), K),
                               .probs = rows(std::span<const R>(ctx.routing_.probs), K),
                               .order_keys = keys},
        drop_output<space_t>{.keep = rows(std::span<std::uint8_t>(ctx.keep_), K),
                             .kept = rows(std::span<int>(ctx.kept_experts_), K),
                             .routed = rows(counts.routed, E),
                             .dropped = rows(counts.dropped, E),
                             .padded = rows(counts.padded, E),
                             .totals = rows(std::span<long long>(ctx.drop_totals_), 2)},
        drop_ws_);
    if (!decided) return unexpected<error>(decided.error());
    counts.capacity = decided->capacity;
    counts.pad_rows = decided->pad_rows;
    counts.dropped_pairs = ctx.drop_totals_[0];  // host_exec: the context's memory is the host's
    counts.fully_dropped_tokens = static_cast<int>(ctx.drop_totals_[1]);
    if (auto st = write_kept_probs(*exec_, rows(std::span<const int>(ctx.kept_experts_), K),
                                   rows(std::span<const R>(ctx.routing_.probs), K),
                                   rows(std::span<Pt>(ctx.kept_probs_), K));
        !st)
      return unexpected<error>(st.error());
    const host_dispatch_input<T, Pt> din{.num_tokens = n,
                                         .x = x,
                                         .expert = ctx.kept_experts_,
                                         .probs = ctx.kept_probs_,
                                         .capacity = counts.pad_rows};
    // Pad mode sizes the rows from the capacity, once the capacity is known to be sane.
    if (counts.pad_rows)
      if (auto st =
              detail::check_dispatch_input(disp_.shape(), din.to_views(o_.hidden, o_.router.topk));
          !st)
        return unexpected<error>(st.error());
    const dispatch_workspace_bytes need = disp_.workspace_sizes(counts.pad_rows);
    auto sv = carve(need);
    if (!sv) return unexpected<error>(sv.error());
    grow_scratch(need.scratch);
    // The losses (a training forward adds to the global aux loss's running counts) and the
    // expert bias's counts of what was dispatched (the post-drop map), once per training forward;
    // a recompute reuses the forward's terms.
    moe_forward_stats stats;
    if (!recompute) {
      if (auto st = forward_losses(ctx, g, logits, training, stats); !st)
        return unexpected<error>(st.error());
      if (training && o_.router.expert_bias)
        if (auto st = bias_->add_counts(*exec_, rows(std::span<const int>(counts.routed), E),
                                        rows(std::span<const int>(counts.dropped), E),
                                        rows(std::span<const int>(counts.padded), E));
            !st)
          return unexpected<error>(st.error());
    } else {
      stats = ctx.stats_;
    }
    stats.dropped = counts;
    if (auto st = exec_->copy(rows(x), rows(sv->x.first(x.size()))); !st)
      return unexpected<error>(st.error());
    if (auto st = exec_->copy(rows(std::span<const R>(logits), E),
                              rows(sv->logits.first(logits.size()), E));
        !st)
      return unexpected<error>(st.error());
    const dispatch_workspace dws{
        .saved = sv->dispatch, .scratch = scratch_ws_, .host = storage.host};
    auto h = disp_.dispatch(din, g.dispatch, dws);
    if (!h) return unexpected<error>(h.error());
    ctx.handle_.emplace(std::move(*h));
    const auto& hd = *ctx.handle_;
    y_.resize(detail::uz(hd.num_rows()) * H);
    grow_experts_ws(hd.num_rows());  // pad mode may pass the receive bound
    if (auto st = experts_.forward(*exec_, hd.batch(), rows(std::span<T>(y_)), experts_ws_); !st)
      return fail(ctx, st);
    if (auto st = disp_.combine(*ctx.handle_, y_, g.dispatch, out); !st) return fail(ctx, st);
    if (shared_)  // out += shared(x), the sum Megatron-Core forms in combine_postprocess
      if (auto st =
              shared_->forward(*exec_, rows(x), *g.tp, rows(out), sv->shared_ex, shared_scratch_);
          !st)
        return fail(ctx, st);
    ctx.n_ = n;
    ctx.scratch_epoch_ = scratch_epoch_;
    ctx.x_ = sv->x;
    ctx.logits_ = sv->logits;
    ctx.shared_saved_ = sv->shared_ex;
    if (!recompute) {
      ctx.training_ = training;
      ctx.stats_ = stats;
    }
    ctx.stats_.dropped = counts;
    ctx.filled_ = true;
    return stats;
  }

  // The load-balancing losses and the z-loss of a training forward: what their backward needs
  // stays in ctx (its own bytes, not the storage: a recompute reuses it), the values go to stats.
  [[nodiscard]] status forward_losses(context_type& ctx, const moe_layer_groups<Comm>& g,
                                      std::span<const R> logits, bool training,
                                      moe_forward_stats& stats) {
    const int E = o_.router.num_experts;
    ctx.lb_ = {};
    ctx.z_ = {};
    if (!training || (!lb_.any() && !z_.on())) return {};
    const std::size_t lb_bytes = lb_.saved_bytes();
    ctx.loss_saved_.resize(lb_bytes + z_.saved_bytes());  // once per context
    const std::span<std::byte> lb_saved = std::span<std::byte>(ctx.loss_saved_).first(lb_bytes),
                               z_saved = std::span<std::byte>(ctx.loss_saved_).subspan(lb_bytes);
    const row_view<const R, space_t> lv = rows(logits, E);
    if (lb_.any()) {
      auto rec = lb_.forward(*exec_, lv, {}, g.tp_cp, g.tp_dp_cp, lb_saved, loss_ws_);
      if (!rec) return unexpected<error>(rec.error());
      ctx.lb_ = *rec;
      std::array<R, load_balancing_terms> v{};  // the host read, for the caller's logging
      if (auto st = exec_->copy(lb_.losses(lb_saved),
                                row_view<R, host_space>(v.data(), 1, load_balancing_terms));
          !st)
        return st;
      stats.aux_loss = static_cast<double>(v[0]);
      stats.seq_aux_loss = static_cast<double>(v[1]);
      stats.global_aux_loss = static_cast<double>(v[2]);
    }
    if (z_.on()) {
      auto rec = z_.forward(*exec_, lv, {}, g.tp_cp.size(), z_saved);
      if (!rec) return unexpected<error>(rec.error());
      ctx.z_ = *rec;
      R v{};
      if (auto st = exec_->copy(z_.loss(z_saved), row_view<R, host_space>(&v, 1, 1)); !st)
        return st;
      stats.z_loss = static_cast<double>(v);
    }
    return {};
  }

  // The router's routing of n tokens' logits [n, E] into `out` (indices and probabilities [n, k]):
  // moefold's router with the expert bias, a user router without. Non-finite logits are refused
  // first (a NaN would select no expert on every context).
  [[nodiscard]] status route(int n, std::span<const R> logits, topk_routing<R>& out) {
    const int E = o_.router.num_experts, k = o_.router.topk;
    if (auto st = detail::check_finite(logits, "router logits"); !st) return st;
    out.num_tokens = n;
    out.num_experts = E;
    out.topk = k;
    out.indices.resize(detail::uz(n) * detail::uz(k));
    out.probs.resize(out.indices.size());
    row_view<const float, space_t> bias{};
    if (o_.router.expert_bias)  // make() refuses the option for a user router
      bias = bias_->bias();
    return router_.route(*exec_, {.logits = rows(logits, E),
                                  .expert_bias = bias,
                                  .indices = rows(std::span<int>(out.indices), k),
                                  .probs = rows(std::span<R>(out.probs), k)});
  }

  // The shared scratch only grows; in-flight handles keep views of it, so a growth is counted
  // and their backward refuses (see reserve).
  void grow_scratch(std::size_t bytes) {
    if (scratch_ws_.size() >= bytes) return;
    scratch_ws_.resize(bytes);
    ++scratch_epoch_;
  }

  // A forward that failed after its dispatch leaves no handle behind.
  static unexpected<error> fail(context_type& ctx, const status& st) {
    ctx.handle_.reset();
    return unexpected<error>(st.error());
  }
  // The end of a backward: the context's views are released whatever the outcome.
  static status done(context_type& ctx, status st) {
    ctx.drop_activations();
    ctx.filled_ = false;
    return st;
  }

  // A buffer of the layer ([N, H] or [E, H]) as a row view in its context's space.
  // (or of another row width: the logits [N, E]).
  using space_t = typename exec_type::memory_space;
  template <class U>
  row_view<U, space_t> rows(std::span<U> v, int width = 0) const {
    if (width == 0) width = o_.hidden;
    return {v.data(), static_cast<int>(v.size() / detail::uz(width)), width};
  }

  moe_layer_options o_;
  // The context the layer runs on (host_exec), at a fixed address: the loss and bias objects'
  // buffers are freed through it.
  std::unique_ptr<exec_type> exec_ = std::make_unique<exec_type>();
  Router router_;
  Policy policy_;
  Dispatcher disp_;
  Experts experts_;
  using shared_type = shared_expert<T, exec_type, Comm>;
  std::optional<shared_type> shared_;
  // The router weight [E, H] and its gradient: views of the own buffers or of the caller's.
  std::vector<T> own_w_;
  std::vector<grad_type> own_dw_;
  std::span<T> w_{};
  std::span<grad_type> dw_{};
  // Scratch, dead after each call (shared by the forwards in flight).
  std::vector<std::byte> scratch_ws_, shared_scratch_;
  std::uint64_t scratch_epoch_ = 0;  // growths of scratch_ws_
  // The one-in-flight form's context and storage.
  context_type own_ctx_{};
  std::vector<std::byte> own_saved_, own_host_;
  using load_balancing_type = load_balancing_losses<R, exec_t>;
  using z_loss_type = router_z_loss<R, exec_t>;
  load_balancing_type lb_{};
  z_loss_type z_{};
  std::optional<moefold::expert_bias<exec_t>> bias_{};
  std::vector<std::byte> loss_ws_;  // the load-balancing losses' forward workspace
  bool training_ = true;
  // Forward scratch: the logits [N, E] (until the saved part is sized), the experts' rows, the
  // shared output.
  std::vector<R> logits_;
  std::vector<T> y_;
  // The experts' workspace (expert_workspace_bytes), sized at make for the receive bound and
  // grown only when a pad-mode forward passes it; dead after each experts call.
  std::vector<std::byte> experts_ws_;
  void grow_experts_ws(int rows) {
    const std::size_t bytes = expert_workspace_bytes(experts_, rows);
    if (experts_ws_.size() < bytes) experts_ws_.resize(bytes);
  }
  std::vector<std::byte> drop_ws_;  // the drop policy's workspace (host_exec: host memory)
  struct backward_scratch {
    std::vector<T> dy, dx_rows;
    std::vector<Pt> dp_rows, dprobs;  // [M], [N, k]
    std::vector<T> dx_experts, dout_seeded;
  } scratch_;
  struct router_backward_scratch {  // in R
    std::vector<R> dprobs_r, dlogits, dx_router;
  } router_scratch_;
  gating_type gating_{};
  std::vector<std::byte> gating_ws_;  // the gating GEMMs' workspace (host_exec: host memory)
};

}  // namespace v0_1
}  // namespace moefold
