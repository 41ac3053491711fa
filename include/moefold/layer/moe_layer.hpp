//! @file moe_layer.hpp
//! @brief One MoE layer on the host: gating -> router -> drop policy -> dispatcher -> experts ->
//! combine, forward and backward, with the auxiliary load-balancing loss and the z-loss. It owns
//! its router weight, its experts and its workspace, and nothing global; gradient reduction across
//! ranks is an explicit step (reduce_gradients), with the group of each parameter stated.
//!
//! Gradient groups (the class of bug users hit in Megatron-Core with ETP > 1 is reducing expert
//! gradients over the wrong group):
//!   - expert weights: edp (replicated over EDP; each tp-ep group sees different tokens)
//!   - router weight: tp-dp-cp (a sequence-parallel parameter: each rank saw only its own tokens)
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/expected.hpp"
#include "../dispatch/dispatch_args.hpp"
#include "../dispatch/drop_policy.hpp"
#include "../experts/expert_fn.hpp"
#include "../mesh/groups.hpp"
#include "../routing/aux_loss.hpp"
#include "../routing/gating.hpp"
#include "../routing/group_losses.hpp"
#include "../routing/topk_router.hpp"

namespace moefold {

struct moe_layer_options {
  int hidden = 0;                //!< H
  int max_tokens = 0;            //!< upper bound of N on every rank
  int ep = 1;                    //!< EP of the fold
  int etp = 1;                   //!< ETP of the fold
  topk_router_options router{};  //!< E, k, score function, ...
  double aux_loss_coeff = 0.0;   //!< per-micro-batch load-balancing loss (0: off)
  double z_loss_coeff = 0.0;     //!< z-loss (0: off)
};

//! This rank's communicators for one layer.
template <class Comm>
struct moe_layer_groups {
  Comm& tp_cp;                       //!< router statistics and full-sequence dropping
  dispatch_groups<Comm> dispatch{};  //!< ep, etp, tp-ep
};

//! What a forward reports: this rank's partial losses (they sum over tp-cp to the layer's) and
//! what the drop policy dropped.
struct moe_forward_stats {
  double aux_loss = 0.0;
  double z_loss = 0.0;
  drop_report dropped{};
};

//! The gradient group of each parameter kind of an MoE layer.
inline constexpr group_kind expert_gradient_group = group_kind::edp;
inline constexpr group_kind router_gradient_group = group_kind::tp_dp_cp;

template <class T, communicator Comm, class Policy, class Dispatcher, class Experts>
requires expert_fn<Experts, T> && drop_policy<Policy, T, Comm>
class moe_layer {
 public:
  [[nodiscard]] static expected<moe_layer> make(const moe_layer_options& o, Policy policy,
                                                Experts experts) {
    auto router = topk_router<T>::make(o.router);
    if (!router) return unexpected<error>(router.error());
    const dispatch_shape shape{.max_tokens = o.max_tokens,
                               .hidden = o.hidden,
                               .topk = o.router.topk,
                               .num_experts = o.router.num_experts,
                               .ep = o.ep,
                               .etp = o.etp};
    auto disp = Dispatcher::make(shape);
    if (!disp) return unexpected<error>(disp.error());
    if (experts.hidden() != o.hidden || experts.num_local_experts() * o.ep != o.router.num_experts)
      return make_error(errc::shape_mismatch, "moe_layer: the experts hold " +
                                                  detail::to_decimal(experts.num_local_experts()) +
                                                  " local experts of hidden size " +
                                                  detail::to_decimal(experts.hidden()) +
                                                  "; the layer needs num_experts / ep = " +
                                                  detail::to_decimal(o.router.num_experts / o.ep) +
                                                  " of size " + detail::to_decimal(o.hidden));
    moe_layer l(o, std::move(*router), std::move(policy), std::move(*disp), std::move(experts));
    const auto E = static_cast<std::size_t>(o.router.num_experts), H = uz(o.hidden);
    const auto N = uz(o.max_tokens), K = uz(o.router.topk);
    l.w_.assign(E * H, T(0));
    l.dw_.assign(E * H, T(0));
    l.ws_.resize(l.disp_.workspace_bytes());
    // Saved between forward and backward, sized once (nothing is allocated per step here; the
    // router and policy reference code allocate their own records).
    l.x_.reserve(N * H);
    l.logits_.reserve(N * E);
    l.y_.reserve(N * K * uz(o.ep) * uz(o.etp) * H);
    return l;
  }

  //! The router weight [E, H] (logits = x W^T) and its gradient.
  [[nodiscard]] std::span<T> router_weight() noexcept { return w_; }
  [[nodiscard]] std::span<T> router_weight_grad() noexcept { return dw_; }
  [[nodiscard]] Experts& experts() noexcept { return experts_; }
  [[nodiscard]] const Dispatcher& dispatcher() const noexcept { return disp_; }
  //! The dispatch handle of the last forward (rows per local expert, byte accounting).
  [[nodiscard]] const auto& last_dispatch() const noexcept { return *handle_; }

  //! out [N, H] for x [N, H]. `order_keys` [N] (or empty) are the tokens' true sequence positions
  //! for full-sequence dropping by position (see sequence_order_keys).
  [[nodiscard]] expected<moe_forward_stats> forward(int n, std::span<const T> x,
                                                    std::span<const std::int64_t> order_keys,
                                                    const moe_layer_groups<Comm>& g,
                                                    std::span<T> out) {
    const int E = o_.router.num_experts;
    const auto H = uz(o_.hidden);
    if (n < 0 || n > o_.max_tokens || x.size() != uz(n) * H || out.size() != uz(n) * H)
      return make_error(errc::shape_mismatch,
                        "moe_layer: x and out must be [N, H] with N <= "
                        "max_tokens");
    n_ = n;
    x_.assign(x.begin(), x.end());
    logits_.resize(uz(n) * uz(E));
    moe_forward_stats stats;
    const gating_shape gs{.num_tokens = n, .hidden = o_.hidden, .num_experts = E};
    if (auto st = gating_forward<T, T, T>(gs, x, std::span<const T>(w_), {}, logits_); !st)
      return unexpected<error>(st.error());
    if (auto st = router_.route(logits_, routing_); !st) return unexpected<error>(st.error());
    if (o_.aux_loss_coeff > 0) {
      if (auto st = compute_aux_scores<T>(o_.router.score, o_.router.topk, E, logits_, {}, aux_);
          !st)
        return unexpected<error>(st.error());
      auto term = load_balancing_loss(g.tp_cp, aux_, o_.aux_loss_coeff);
      if (!term) return unexpected<error>(term.error());
      aux_term_ = std::move(*term);
      stats.aux_loss = static_cast<double>(aux_term_.loss);
    }
    if (o_.z_loss_coeff > 0) {
      auto z = group_z_loss(g.tp_cp, std::span<const T>(logits_), E, o_.z_loss_coeff);
      if (!z) return unexpected<error>(z.error());
      stats.z_loss = static_cast<double>(*z);
    }
    if (auto st = policy_.apply(g.tp_cp, order_keys, routing_, drop_); !st)
      return unexpected<error>(st.error());
    stats.dropped = drop_.report;
    kept_experts_ = drop_.kept_experts(routing_);
    kept_probs_ = drop_.kept_probs(routing_);
    const dispatch_input<T> din{.num_tokens = n,
                                .x = x,
                                .expert = kept_experts_,
                                .probs = kept_probs_,
                                .capacity = drop_.pad_rows};
    // Pad mode sizes the rows from the capacity (the workspace grows to the largest one seen).
    if (const auto need = disp_.workspace_bytes(drop_.pad_rows); ws_.size() < need)
      ws_.resize(need);
    auto h = disp_.dispatch(din, g.dispatch, ws_);
    if (!h) return unexpected<error>(h.error());
    handle_.emplace(std::move(*h));
    y_.resize(uz(handle_->num_rows()) * H);
    if (auto st = experts_.forward(handle_->batch(), y_); !st) return unexpected<error>(st.error());
    if (auto st = disp_.combine(*handle_, y_, g.dispatch, out); !st)
      return unexpected<error>(st.error());
    return stats;
  }

  //! dx [N, H] from dout [N, H] of the last forward; `loss_seed` is d(training loss) / d(each
  //! auxiliary loss) (Megatron's aux-loss scale). Adds the router weight and expert gradients.
  [[nodiscard]] status backward(std::span<const T> dout, T loss_seed,
                                const moe_layer_groups<Comm>& g, std::span<T> dx) {
    if (!handle_) return make_error(errc::invalid_argument, "moe_layer: backward before forward");
    const int E = o_.router.num_experts;
    const auto H = uz(o_.hidden), M = uz(handle_->num_rows()), N = uz(n_), K = uz(o_.router.topk);
    if (dout.size() != N * H || dx.size() != N * H)
      return make_error(errc::shape_mismatch, "moe_layer: dout and dx must be [N, H]");
    // Experts' path.
    std::vector<T> dy(M * H), dx_rows(M * H), dp_rows(M), dprobs(N * K), dx_experts(N * H);
    if (auto st = disp_.combine_backward(*handle_, dout, g.dispatch, dy); !st) return st;
    if (auto st = experts_.backward(handle_->batch(), dy, dx_rows, dp_rows); !st) return st;
    if (auto st =
            disp_.dispatch_backward(*handle_, dx_rows, dp_rows, g.dispatch, dx_experts, dprobs);
        !st)
      return st;
    // Router's path: dropped pairs have no gradient (their probabilities were not renormalised),
    // then the router Jacobian, the auxiliary losses, the gating GEMM.
    std::vector<T> dlogits(N * uz(E)), dx_router(N * H), dw(uz(E) * H);
    if (auto st = router_.backward(logits_, routing_, dprobs, dlogits); !st) return st;
    const gating_shape gbs{.num_tokens = n_, .hidden = o_.hidden, .num_experts = E};
    if (o_.aux_loss_coeff > 0)
      if (auto st = add_aux_loss_gradient<T>(o_.router.score, logits_, E, {}, aux_term_, loss_seed,
                                             dlogits);
          !st)
        return st;
    if (o_.z_loss_coeff > 0)
      if (auto st =
              add_group_z_loss_gradient(g.tp_cp, std::span<const T>(logits_), E, o_.z_loss_coeff,
                                        {}, loss_seed, std::span<T>(dlogits));
          !st)
        return st;
    if (auto st =
            gating_backward<T, T, T>(gbs, x_, std::span<const T>(w_), dlogits, dx_router, dw, {});
        !st)
      return st;
    for (std::size_t i = 0; i < dw.size(); ++i) dw_[i] += dw[i];
    for (std::size_t i = 0; i < N * H; ++i) dx[i] = dx_experts[i] + dx_router[i];
    return {};
  }

  //! Sums the local gradients over their groups: the router weight over tp-dp-cp, the experts'
  //! over edp. `expert_grads` lists the experts' gradient buffers (e.g. {grads_fc1, grads_fc2}).
  [[nodiscard]] status reduce_gradients(Comm& tp_dp_cp, Comm& edp,
                                        std::initializer_list<std::span<T>> expert_grads) {
    if (auto st = tp_dp_cp.template all_reduce<T>(std::span<T>(dw_), reduce_op::sum); !st)
      return st;
    for (auto s : expert_grads)
      if (auto st = edp.template all_reduce<T>(s, reduce_op::sum); !st) return st;
    return {};
  }

 private:
  static constexpr std::size_t uz(long long v) noexcept { return static_cast<std::size_t>(v); }
  moe_layer(const moe_layer_options& o, topk_router<T> r, Policy p, Dispatcher d, Experts e)
      : o_(o),
        router_(std::move(r)),
        policy_(std::move(p)),
        disp_(std::move(d)),
        experts_(std::move(e)) {}

  moe_layer_options o_;
  topk_router<T> router_;
  Policy policy_;
  Dispatcher disp_;
  Experts experts_;
  std::vector<T> w_, dw_;
  std::vector<std::byte> ws_;
  // Saved by forward for backward.
  int n_ = 0;
  std::vector<T> x_, logits_, y_;
  topk_routing<T> routing_{};
  aux_scores<T> aux_{};
  aux_loss_term<T> aux_term_{};
  drop_result<T> drop_{};
  std::vector<int> kept_experts_;
  std::vector<T> kept_probs_;
  std::optional<typename Dispatcher::handle_type> handle_;
};

}  // namespace moefold
