//! @file moe_layer.hpp
//! @brief One MoE layer on the host: gating -> router -> drop policy -> dispatcher -> experts ->
//! combine (+ an optional shared expert), forward and backward, with the load-balancing losses
//! (per micro-batch, per sequence, per global batch), the z-loss and the expert bias. It owns its
//! router weight, its experts, its running statistics and its workspace, and nothing global;
//! gradient reduction across ranks is an explicit step (reduce_gradients), with the group of each
//! parameter stated, and so is the end of a global batch (end_global_batch).
//!
//! Gradient groups (the class of bug users hit in Megatron-Core with ETP > 1 is reducing expert
//! gradients over the wrong group):
//!   - expert weights: edp (replicated over EDP; each tp-ep group sees different tokens)
//!   - router weight: tp-dp-cp (a sequence-parallel parameter: each rank saw only its own tokens)
//!   - shared-expert MLP: dp-cp (sharded over TP, each shard saw its TP group's tokens)
//!   - shared-expert gate: tp-dp-cp (replicated over TP, saw only this rank's tokens)
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../dispatch/dispatch_args.hpp"
#include "../dispatch/drop_policy.hpp"
#include "../experts/expert_fn.hpp"
#include "../experts/shared_expert.hpp"
#include "../mesh/groups.hpp"
#include "../routing/aux_loss.hpp"
#include "../routing/expert_bias.hpp"
#include "../routing/gating.hpp"
#include "../routing/group_losses.hpp"
#include "../routing/routing_view.hpp"
#include "../routing/topk_router.hpp"

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

//! This rank's communicators for one layer. `tp` is needed with a shared expert, `tp_dp_cp` with
//! the global load-balancing loss.
template <class Comm>
struct moe_layer_groups {
  Comm& tp_cp;                       //!< router statistics and full-sequence dropping
  dispatch_groups<Comm> dispatch{};  //!< ep, etp, tp-ep
  Comm* tp = nullptr;                //!< attention TP (the shared expert)
  Comm* tp_dp_cp = nullptr;          //!< the pipeline stage's data ranks (the global aux loss)
};

//! What a forward reports: this rank's partial losses (each sums over tp-cp to the layer's; zero
//! in evaluation) and what the drop policy dropped (views of the layer's counts, valid until its
//! next forward; `dropped.to_report()` copies them).
struct moe_forward_stats {
  double aux_loss = 0.0;         //!< per micro-batch
  double seq_aux_loss = 0.0;     //!< per sequence
  double global_aux_loss = 0.0;  //!< per global batch (running average of the counts)
  double z_loss = 0.0;
  drop_counts dropped{};
};

//! The gradient group of each parameter kind of an MoE layer.
inline constexpr group_kind expert_gradient_group = group_kind::edp;
inline constexpr group_kind router_gradient_group = group_kind::tp_dp_cp;
inline constexpr group_kind shared_expert_gradient_group = group_kind::dp_cp;
inline constexpr group_kind shared_gate_gradient_group = group_kind::tp_dp_cp;

template <class T, communicator Comm, class Policy, class Dispatcher, class Experts>
requires expert_fn<Experts, T> && drop_policy<Policy, T, Comm> &&
    communicator_for<Comm, typename Dispatcher::exec_type, T>
class moe_layer {
 public:
  //! The execution context the layer's row operations run on (its dispatcher's).
  using exec_type = typename Dispatcher::exec_type;

  [[nodiscard]] static expected<moe_layer> make(const moe_layer_options& o, Policy policy,
                                                Experts experts) {
    using detail::to_decimal;
    auto router = topk_router<T>::make(o.router);
    if (!router) return unexpected<error>(router.error());
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
    std::optional<shared_expert<T, Comm>> shared;
    if (o.shared_expert.ffn > 0) {
      const shared_expert_shape ss{.max_tokens = o.max_tokens,
                                   .hidden = o.hidden,
                                   .ffn = o.shared_expert.ffn,
                                   .tp = o.shared_expert.tp,
                                   .tp_rank = o.shared_expert.tp_rank,
                                   .act = o.shared_expert.act,
                                   .gate = o.shared_expert.gate};
      auto se = shared_expert<T, Comm>::make(ss);
      if (!se) return unexpected<error>(se.error());
      shared.emplace(std::move(*se));
    } else if (o.shared_expert.ffn < 0) {
      return make_error(errc::invalid_size, "moe_layer: shared_expert.ffn must be >= 0");
    }
    moe_layer l(o, std::move(*router), std::move(policy), std::move(*disp), std::move(experts));
    const auto E = static_cast<std::size_t>(o.router.num_experts), H = detail::uz(o.hidden);
    const auto N = detail::uz(o.max_tokens);
    l.w_.assign(E * H, T(0));
    l.dw_.assign(E * H, T(0));
    const dispatch_workspace_bytes wsb = l.disp_.workspace_sizes();
    l.saved_ws_.resize(wsb.saved);
    l.scratch_ws_.resize(wsb.scratch);
    l.host_ws_.resize(wsb.host);
    if (o.router.expert_bias) l.bias_ = expert_bias_state::zeros(o.router.num_experts);
    if (shared) {
      l.shared_ = std::move(shared);
      l.shared_ws_.resize(l.shared_->workspace_bytes());
      l.shared_out_.reserve(N * H);
    }
    // Saved between forward and backward, sized once (nothing is allocated per step here; the
    // router and policy reference code allocate their own records).
    l.x_.reserve(N * H);
    l.logits_.reserve(N * E);
    // The experts' output rows: at most the receive bound (pad mode may grow them).
    l.y_.reserve(detail::uz(o.max_recv_rows.value_or(detail::worst_recv_rows(l.disp_.shape()))) *
                 H);
    return l;
  }

  //! The dispatcher shape of a layer.
  [[nodiscard]] static dispatch_shape dispatch_shape_of(const moe_layer_options& o) noexcept {
    const dispatch_shape shape{.max_tokens = o.max_tokens,
                               .hidden = o.hidden,
                               .topk = o.router.topk,
                               .num_experts = o.router.num_experts,
                               .ep = o.ep,
                               .etp = o.etp,
                               .max_recv_rows = o.max_recv_rows};
    return shape;
  }
  //! The dispatcher workspace a layer of these options holds, per part (saved for the backward;
  //! scratch, which layers of a model could share), without making the layer or allocating.
  [[nodiscard]] static expected<dispatch_workspace_bytes> workspace_sizes(
      const moe_layer_options& o, std::optional<int> capacity = {}) {
    auto d = Dispatcher::make(dispatch_shape_of(o));
    if (!d) return unexpected<error>(d.error());
    return d->workspace_sizes(capacity);
  }
  //! What this layer's dispatcher workspace holds now, per part (pad mode grows it).
  [[nodiscard]] dispatch_workspace_bytes workspace_sizes() const noexcept {
    return {saved_ws_.size(), scratch_ws_.size(), host_ws_.size()};
  }

  //! The router weight [E, H] (logits = x W^T) and its gradient.
  [[nodiscard]] std::span<T> router_weight() noexcept { return w_; }
  [[nodiscard]] std::span<T> router_weight_grad() noexcept { return dw_; }
  [[nodiscard]] Experts& experts() noexcept { return experts_; }
  //! The shared expert, or nullptr without one.
  [[nodiscard]] shared_expert<T, Comm>* shared() noexcept { return shared_ ? &*shared_ : nullptr; }
  //! The expert bias and this global batch's routed-token counts (empty unless the router options
  //! enable the bias). Load a checkpointed bias into bias.
  [[nodiscard]] expert_bias_state& expert_bias() noexcept { return bias_; }
  //! The running counts of the global load-balancing loss.
  [[nodiscard]] const global_aux_state& global_aux() const noexcept { return global_; }
  [[nodiscard]] const Dispatcher& dispatcher() const noexcept { return disp_; }
  //! The dispatch handle of the last forward (rows per local expert, byte accounting).
  [[nodiscard]] const auto& last_dispatch() const noexcept { return *handle_; }
  //! The routing of the last forward (every selected expert), its keep mask [N*k] (what the drop
  //! policy kept) and the record the dispatcher took: expert [N*k], -1 for a dropped pair.
  [[nodiscard]] const topk_routing<T>& last_routing() const noexcept { return routing_; }
  [[nodiscard]] std::span<const std::uint8_t> last_keep() const noexcept { return keep_; }
  [[nodiscard]] std::span<const int> last_kept_experts() const noexcept { return kept_experts_; }

  //! Training (default) or evaluation. In evaluation the forward computes no auxiliary losses
  //! and does not count tokens for the expert bias (Megatron-Core does both only with gradients
  //! enabled); the output is the same.
  void set_training(bool training) noexcept { training_ = training; }
  [[nodiscard]] bool training() const noexcept { return training_; }

  //! out [N, H] for x [N, H]. `order_keys` [N] (or empty) are the tokens' true sequence positions
  //! for full-sequence dropping by position (see sequence_order_keys).
  [[nodiscard]] expected<moe_forward_stats> forward(int n, std::span<const T> x,
                                                    std::span<const std::int64_t> order_keys,
                                                    const moe_layer_groups<Comm>& g,
                                                    std::span<T> out) {
    const int E = o_.router.num_experts;
    const auto H = detail::uz(o_.hidden);
    if (n < 0 || n > o_.max_tokens || x.size() != detail::uz(n) * H ||
        out.size() != detail::uz(n) * H)
      return make_error(errc::shape_mismatch,
                        "moe_layer: x and out must be [N, H] with N <= "
                        "max_tokens");
    if (shared_ && g.tp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the layer has a shared expert; pass the attention TP "
                        "communicator in moe_layer_groups::tp");
    if (training_ && o_.global_aux_loss_coeff > 0 && g.tp_dp_cp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the global load-balancing loss needs the tp-dp-cp "
                        "communicator in moe_layer_groups::tp_dp_cp");
    handle_.reset();  // a failed forward leaves nothing for backward to use
    n_ = n;
    x_.assign(x.begin(), x.end());
    logits_.resize(detail::uz(n) * detail::uz(E));
    moe_forward_stats stats;
    const gating_shape gs{.num_tokens = n, .hidden = o_.hidden, .num_experts = E};
    if (auto st = gating_forward<T, T, T>(gs, x, std::span<const T>(w_), {}, logits_); !st)
      return unexpected<error>(st.error());
    if (auto st = router_.route(logits_, routing_, std::span<const float>(bias_.bias), router_ws_);
        !st)
      return unexpected<error>(st.error());
    // Load-balancing losses: each on its own statistics group, all on the same aux scores.
    aux_active_ = {};
    z_active_ = training_ && o_.z_loss_coeff > 0;
    const bool any_aux = training_ && (o_.aux_loss_coeff > 0 || o_.seq_aux_loss_coeff > 0 ||
                                       o_.global_aux_loss_coeff > 0);
    if (any_aux)
      if (auto st = compute_aux_scores<T>(o_.router.score, o_.router.topk, E, logits_, {}, aux_);
          !st)
        return unexpected<error>(st.error());
    if (any_aux && o_.aux_loss_coeff > 0) {
      if (auto st = load_balancing_loss(g.tp_cp, aux_, o_.aux_loss_coeff, aux_terms_[0]); !st)
        return unexpected<error>(st.error());
      aux_active_[0] = true;
      stats.aux_loss = static_cast<double>(aux_terms_[0].loss);
    }
    if (any_aux && o_.seq_aux_loss_coeff > 0) {
      if (auto st = seq_load_balancing_loss(g.tp_cp, aux_, o_.batch, o_.seq_aux_loss_coeff,
                                            aux_terms_[1]);
          !st)
        return unexpected<error>(st.error());
      aux_active_[1] = true;
      stats.seq_aux_loss = static_cast<double>(aux_terms_[1].loss);
    }
    if (any_aux && o_.global_aux_loss_coeff > 0) {
      if (auto st = global_load_balancing_loss(*g.tp_dp_cp, aux_, o_.global_aux_loss_coeff, global_,
                                               aux_terms_[2]);
          !st)
        return unexpected<error>(st.error());
      aux_active_[2] = true;
      stats.global_aux_loss = static_cast<double>(aux_terms_[2].loss);
    }
    if (z_active_) {
      auto z = group_z_loss(g.tp_cp, std::span<const T>(logits_), E, o_.z_loss_coeff);
      if (!z) return unexpected<error>(z.error());
      stats.z_loss = static_cast<double>(*z);
    }
    // The drop policy marks what each expert keeps in the routing record's mask; the selection
    // stays whole for the router backward.
    const auto pairs = routing_.indices.size();
    keep_.resize(pairs);
    const routing_view<T> rv = view_of(routing_, std::span<std::uint8_t>(keep_));
    drop_counts counts = counts_into(report_, E);
    if (auto st = policy_.apply(g.tp_cp, order_keys, rv, counts, drop_ws_); !st)
      return unexpected<error>(st.error());
    stats.dropped = counts;
    // The bias learns from what was dispatched (the post-drop map), once per training forward.
    if (training_ && o_.router.expert_bias)
      if (auto st = add_dispatched_counts(counts, bias_.local_tokens_per_expert); !st)
        return unexpected<error>(st.error());
    kept_experts_.resize(pairs);
    kept_probs_.resize(pairs);
    detail::write_kept_pairs(rv, std::span<int>(kept_experts_), std::span<T>(kept_probs_));
    const host_dispatch_input<T> din{.num_tokens = n,
                                     .x = x,
                                     .expert = kept_experts_,
                                     .probs = kept_probs_,
                                     .capacity = counts.pad_rows};
    // Pad mode sizes the rows from the capacity (the workspace grows to the largest one seen),
    // once the capacity is known to be sane.
    if (auto st =
            detail::check_dispatch_input(disp_.shape(), din.to_views(o_.hidden, o_.router.topk));
        !st)
      return unexpected<error>(st.error());
    const auto need = disp_.workspace_sizes(counts.pad_rows);
    if (saved_ws_.size() < need.saved) saved_ws_.resize(need.saved);
    if (scratch_ws_.size() < need.scratch) scratch_ws_.resize(need.scratch);
    if (host_ws_.size() < need.host) host_ws_.resize(need.host);
    const dispatch_workspace dws{.saved = saved_ws_, .scratch = scratch_ws_, .host = host_ws_};
    auto h = disp_.dispatch(din, g.dispatch, dws);
    if (!h) return unexpected<error>(h.error());
    handle_.emplace(std::move(*h));
    y_.resize(detail::uz(handle_->num_rows()) * H);
    if (auto st = experts_.forward(handle_->batch(), y_); !st) return unexpected<error>(st.error());
    if (auto st = disp_.combine(*handle_, y_, g.dispatch, out); !st)
      return unexpected<error>(st.error());
    if (shared_) {  // out += shared(x), the sum Megatron-Core forms in combine_postprocess
      shared_out_.resize(detail::uz(n) * H);
      if (auto st = shared_->forward(n, x, *g.tp, shared_out_, shared_ws_); !st)
        return unexpected<error>(st.error());
      if (auto st = exec_.template add<T>(rows(std::span<const T>(shared_out_)), rows(out)); !st)
        return unexpected<error>(st.error());
    }
    return stats;
  }

  //! dx [N, H] from dout [N, H] of the last forward; `loss_seed` is d(training loss) / d(each
  //! auxiliary loss) (Megatron's aux-loss scale). Adds the router weight, expert and shared-expert
  //! gradients. After an evaluation forward no auxiliary loss contributes.
  [[nodiscard]] status backward(std::span<const T> dout, T loss_seed,
                                const moe_layer_groups<Comm>& g, std::span<T> dx) {
    if (!handle_) return make_error(errc::invalid_argument, "moe_layer: backward before forward");
    const int E = o_.router.num_experts;
    const auto H = detail::uz(o_.hidden), M = detail::uz(handle_->num_rows()), N = detail::uz(n_),
               K = detail::uz(o_.router.topk);
    if (dout.size() != N * H || dx.size() != N * H)
      return make_error(errc::shape_mismatch, "moe_layer: dout and dx must be [N, H]");
    if (shared_ && g.tp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the layer has a shared expert; pass the attention TP "
                        "communicator in moe_layer_groups::tp");
    // Experts' path. The scratch buffers are members, zeroed each step: their capacity is reused,
    // so steady-state steps allocate nothing here.
    auto& [dy, dx_rows, dp_rows, dprobs, dx_experts, dlogits, dx_router, dw, dx_shared, rows_e] =
        scratch_;
    dy.assign(M * H, T(0));
    dx_rows.assign(M * H, T(0));
    dp_rows.assign(M, T(0));
    dprobs.assign(N * K, T(0));
    dx_experts.assign(N * H, T(0));
    if (auto st = disp_.combine_backward(*handle_, dout, g.dispatch, dy); !st) return st;
    if (auto st = experts_.backward(handle_->batch(), dy, dx_rows, dp_rows); !st) return st;
    if (auto st =
            disp_.dispatch_backward(*handle_, dx_rows, dp_rows, g.dispatch, dx_experts, dprobs);
        !st)
      return st;
    // Router's path: dropped pairs have no gradient (their probabilities were not renormalised),
    // then the router Jacobian, the auxiliary losses, the gating GEMM.
    dlogits.assign(N * detail::uz(E), T(0));
    dx_router.assign(N * H, T(0));
    dw.assign(detail::uz(E) * H, T(0));
    if (auto st = router_.backward(logits_, routing_, dprobs, dlogits, router_ws_); !st) return st;
    rows_e.resize(3 * detail::uz(E));  // the loss gradients' per-token rows
    const gating_shape gbs{.num_tokens = n_, .hidden = o_.hidden, .num_experts = E};
    // The three load-balancing terms (micro-batch, per sequence, global), each when active.
    // (dlogits is passed, not captured: clang 14 cannot capture a structured binding.)
    const auto add_term = [&](std::size_t i, std::vector<T>& dl, std::vector<T>& work) -> status {
      if (!aux_active_[i]) return {};
      return add_aux_loss_gradient<T>(o_.router.score, logits_, E, {}, aux_terms_[i], loss_seed, dl,
                                      work);
    };
    if (auto st = add_term(0, dlogits, rows_e); !st) return st;
    if (auto st = add_term(1, dlogits, rows_e); !st) return st;
    if (auto st = add_term(2, dlogits, rows_e); !st) return st;
    if (z_active_)
      if (auto st =
              add_group_z_loss_gradient(g.tp_cp, std::span<const T>(logits_), E, o_.z_loss_coeff,
                                        {}, loss_seed, std::span<T>(dlogits), std::span<T>(rows_e));
          !st)
        return st;
    if (auto st =
            gating_backward<T, T, T>(gbs, x_, std::span<const T>(w_), dlogits, dx_router, dw, {});
        !st)
      return st;
    if (auto st = exec_.template add<T>(rows(std::span<const T>(dw)), rows(std::span<T>(dw_))); !st)
      return st;
    // dx = dx_experts + dx_router (+ dx_shared).
    if (auto st = exec_.copy(rows(std::span<const T>(dx_experts)), rows(dx)); !st) return st;
    if (auto st = exec_.template add<T>(rows(std::span<const T>(dx_router)), rows(dx)); !st)
      return st;
    if (shared_) {
      dx_shared.assign(N * H, T(0));
      if (auto st = shared_->backward(dout, *g.tp, dx_shared); !st) return st;
      if (auto st = exec_.template add<T>(rows(std::span<const T>(dx_shared)), rows(dx)); !st)
        return st;
    }
    return {};
  }

  //! Sums the local gradients over their groups: the router weight over tp-dp-cp, the experts'
  //! over edp, and with a shared expert its MLP over `dp_cp` and its gate over tp-dp-cp.
  //! `expert_grads` lists the experts' gradient buffers (e.g. {grads_fc1, grads_fc2}).
  [[nodiscard]] status reduce_gradients(Comm& tp_dp_cp, Comm& edp,
                                        std::initializer_list<std::span<T>> expert_grads,
                                        Comm* dp_cp = nullptr) {
    if (shared_ && dp_cp == nullptr)
      return make_error(errc::invalid_argument,
                        "moe_layer: the shared expert's gradients are reduced over dp-cp; pass "
                        "that communicator");
    if (auto st = tp_dp_cp.template all_reduce<T>(std::span<T>(dw_), reduce_op::sum); !st)
      return st;
    if (auto st = all_reduce_each<T>(edp, expert_grads, reduce_op::sum); !st) return st;
    if (shared_) {
      if (auto st = all_reduce_each<T>(
              *dp_cp, {shared_->mlp().grads_fc1(), shared_->mlp().grads_fc2()}, reduce_op::sum);
          !st)
        return st;
      if (o_.shared_expert.gate)
        if (auto st = tp_dp_cp.template all_reduce<T>(shared_->gate_grad(), reduce_op::sum); !st)
          return st;
    }
    return {};
  }

  //! Once per global batch, after the last backward: updates the expert bias from the counts of
  //! the whole stage (bias += rate * sign(mean - count), counts summed over tp-dp-cp) and restarts
  //! the global load-balancing loss's running counts. Collective over tp-dp-cp when the bias is
  //! enabled.
  [[nodiscard]] status end_global_batch(Comm& tp_dp_cp) {
    if (o_.router.expert_bias)
      if (auto st = update_expert_bias(tp_dp_cp, bias_, o_.expert_bias_update_rate); !st) return st;
    global_.reset();
    return {};
  }

 private:
  moe_layer(const moe_layer_options& o, topk_router<T> r, Policy p, Dispatcher d, Experts e)
      : o_(o),
        router_(std::move(r)),
        policy_(std::move(p)),
        disp_(std::move(d)),
        experts_(std::move(e)) {}

  // A buffer of the layer ([N, H] or [E, H]) as a row view in its context's space.
  template <class U>
  row_view<U, typename exec_type::memory_space> rows(std::span<U> v) const {
    const int width = o_.hidden;
    return {v.data(), static_cast<int>(v.size() / detail::uz(width)), width};
  }

  moe_layer_options o_;
  exec_type exec_{};
  topk_router<T> router_;
  Policy policy_;
  Dispatcher disp_;
  Experts experts_;
  std::optional<shared_expert<T, Comm>> shared_;
  std::vector<T> w_, dw_;
  std::vector<std::byte> saved_ws_, scratch_ws_, host_ws_, shared_ws_;
  expert_bias_state bias_{};
  global_aux_state global_{};
  bool training_ = true;
  // Saved by forward for backward.
  int n_ = 0;
  std::vector<T> x_, logits_, y_, shared_out_;
  topk_routing<T> routing_{};
  aux_scores<T> aux_{};
  std::array<aux_loss_term<T>, 3> aux_terms_{};  // micro-batch, per sequence, global
  std::array<bool, 3> aux_active_{};
  bool z_active_ = false;
  std::vector<std::uint8_t> keep_;  // [N*k] the drop policy's mask of routing_
  drop_report report_{};            // what the policy counted (its vectors sized once)
  drop_scratch<T> drop_ws_{};
  std::vector<int> kept_experts_;
  std::vector<T> kept_probs_;
  std::optional<typename Dispatcher::handle_type> handle_;
  struct backward_scratch {
    std::vector<T> dy, dx_rows, dp_rows, dprobs, dx_experts, dlogits, dx_router, dw, dx_shared,
        rows_e;
  } scratch_;
  topk_router_scratch<T> router_ws_{};
};

}  // namespace v0_1
}  // namespace moefold
