//! @file moe_layer.hpp
//! @brief The MoE layer, one for every execution context (host_exec, cpu_exec, cuda_exec):
//! gating -> router -> drop policy -> dispatcher -> experts -> combine (+ an optional shared
//! expert), forward and backward, with the load-balancing losses (per micro-batch, per sequence,
//! per global batch), the z-loss and the expert bias.
//!
//! What it holds and what it does not: its communicators by reference (the bundle given to make
//! outlives it), its router, drop policy, dispatcher and experts, its state across micro-batches
//! (the expert bias and its counts, the global loss's running counts) and its router and
//! shared-expert parameters until bind_parameters() points it at a caller's (read in place,
//! gradients accumulated into the caller's buffers). It never holds an execution context: every
//! call takes the context it runs on (a stream on a GPU), and everything a forward or its
//! backward writes belongs to that forward's context or to the caller's storage, so two forwards
//! may run on two streams at once. What they share is ordered by the caller, as on any two
//! streams: the state a training forward adds to (the expert bias's counts, the global loss's
//! running counts, when enabled) and the gradient buffers the backwards accumulate into. Its
//! buffers live in the memory of the context given to make.
//!
//! Forwards in flight: forward(exec, x, keys, out, context, storage) fills a moe_forward_context
//! whose saved activations live in the caller's storage (saved_sizes() tells how much), and
//! backward(exec, context, ...) consumes it, in any order; recompute() refills a context whose
//! activations were dropped. forward(exec, x, keys, out) / backward(exec, dout, ...) are the
//! one-in-flight form over a context and storage the layer holds.
//!
//! The host waits for nothing a forward computes: the losses and drop counts are values in the
//! context's memory (moe_forward_stats; read_forward_stats copies them when a trainer logs). The
//! dispatcher reads the routed counts back when the collectives or the experts' row ranges need
//! them (not in pad mode, not dropless with EP = ETP = 1); the backward reads nothing back.
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
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../dispatch/all_to_all_dispatcher.hpp"
#include "../dispatch/capacity_keep.hpp"
#include "../dispatch/dispatch_args.hpp"
#include "../dispatch/drop_args.hpp"
#include "../dispatch/drop_policy_variant.hpp"
#include "../dispatch/token_dispatcher.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"
#include "../exec/gemm_policy.hpp"
#include "../experts/expert_fn.hpp"
#include "../experts/mlp_experts.hpp"
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
  int hidden = 0;                      //!< H
  int max_tokens = 0;                  //!< upper bound of N on every rank
  std::optional<int> max_recv_rows{};  //!< dispatch_shape::max_recv_rows (unset: worst case)
  //! dispatch_shape::kind: the dispatcher a dispatcher_variant layer makes; a concrete
  //! dispatcher refuses the other kind (unset: the layer type's dispatcher)
  std::optional<dispatcher_kind> dispatcher{};
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

//! The dispatcher shape of a layer of these options (the layer and its tools).
[[nodiscard]] inline dispatch_shape moe_dispatch_shape(const moe_layer_options& o) noexcept {
  const dispatch_shape shape{.max_tokens = o.max_tokens,
                             .hidden = o.hidden,
                             .topk = o.router.topk,
                             .num_experts = o.router.num_experts,
                             .ep = o.ep,
                             .etp = o.etp,
                             .max_recv_rows = o.max_recv_rows,
                             .kind = o.dispatcher};
  return shape;
}

//! The load-balancing losses of a layer of these options (the layer and its tools).
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

//! Types: `T` is the tokens' and the experts' element type (bf16, float, double); `Exec` the
//! execution context every call takes (host_exec, cpu_exec, cuda_exec); `Comm` the communicator
//! type of the bundle (thread_communicator, mpi_communicator, nccl_communicator, a user's).
//! `Policy` is any drop_policy, by default drop_policy_variant (dropless, sub-sequence or
//! full-sequence dropping chosen at run time). `Router` is any routing::router, moefold's
//! topk_router by default, whose element type R (`router_value_type`) is the type of the logits,
//! the scores, the probabilities the router gives and the losses (Megatron-Core's
//! moe_router_dtype; the default, accumulator_t<T>, is fp32 for bf16 tokens). The gating GEMM
//! (router_gating, for every router) reads the T tokens and weight and accumulates in fp32 (fp64
//! for fp64 operands) into R, on the router's GEMM policy (topk_router's Gemms; the experts' for
//! a router that names none). `Dispatcher` is any token_dispatcher of token type T on Exec, by
//! default all_to_all_dispatcher with fp32 probabilities for bf16 tokens; its probability type
//! Pt (`prob_type`) is the type the kept probabilities are converted to once (exactly when Pt is
//! R), travel in to the experts, who apply them (Experts must be an expert_fn of T and Pt on Exec,
//! e.g. mlp_experts, the default, or reference_mlp), and whose gradients come back in (widened
//! to R for the router's backward). With Pt = R = fp32 for bf16 tokens the probabilities are
//! never rounded to 16 bits, as in Megatron-Core with moe_router_dtype='fp32'. The router weight
//! is a T parameter with a main_grad_t<T> gradient.
template <class T, execution_context Exec, communicator Comm, class Policy = drop_policy_variant,
          class Dispatcher = all_to_all_dispatcher<T, Comm, Exec, accumulator_t<T>>,
          class Experts =
              mlp_experts<T, Exec, default_gemms<Exec>, main_grad_t<T>, accumulator_t<T>>,
          class Router = topk_router<T, Exec>>
requires std::same_as<typename Dispatcher::exec_type, Exec> &&
    std::same_as<typename Dispatcher::value_type, T> && token_dispatcher<Dispatcher, Comm> &&
    expert_fn<Experts, Exec, T, typename Dispatcher::prob_type> && routing::router<Router, Exec> &&
    std::floating_point<typename Router::value_type> &&
    drop_policy<Policy, typename Router::value_type, Exec, Comm> && communicator_for<Comm, Exec, T>
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
  // moefold's router (any of its GEMM policies), which takes the expert bias.
  static constexpr bool is_topk_router = is_topk_router_v<Router>;
  // The gating linear for every router (topk_router's own runs the same code), on the router's
  // GEMM policy, else the experts' (so a layer on one policy runs every GEMM on it: the SIMT
  // layer on cuda_exec stays bitwise the cpu_exec layer).
  using gating_type =
      router_gating<T, Exec, R,
                    detail::gemms_of_t<Router, Exec, detail::gemms_of_t<Experts, Exec>>>;
  template <class U>
  using buffer = exec_buffer<U, Exec>;

 public:
  //! The element type of the router's and the shared expert's gradients (fp32 for bf16 weights).
  using grad_type = main_grad_t<T>;
  using params_type = moe_layer_params<T, grad_type>;
  using dispatcher_type = Dispatcher;
  using router_type = Router;
  using policy_type = Policy;
  using experts_type = Experts;
  using communicator_type = Comm;
  using communicators_type = moe_layer_communicators<Comm>;
  //! The execution context every call takes.
  using exec_type = Exec;
  //! Its memory space: tokens, gradients, parameters, storage and the layer's buffers live there.
  using space = typename Exec::memory_space;
  using param_views_type = moe_layer_param_views<T, space, grad_type>;
  //! One forward in flight (see moe_forward_context).
  using context_type = moe_forward_context<moe_layer>;
  using stats_type = moe_forward_stats<R, space>;
  //! The shared expert, on the GEMM policy of the routed experts (where they name one).
  using shared_type =
      shared_expert<T, Exec, Comm, main_grad_t<T>, detail::gemms_of_t<Experts, Exec>>;

  //! A layer with moefold's top-k router made from `o.router`. Its buffers are allocated on
  //! `exec` (in its memory; for cuda_exec on its stream, which must outlive the layer, and the
  //! layer waits for them before it returns). EP, ETP, the attention TP and this rank's TP
  //! position are taken from `comms` (see options_for), which the layer holds by reference: it
  //! must outlive the layer, neither moved nor freed.
  [[nodiscard]] static expected<moe_layer> make(Exec& exec, const moe_layer_options& o,
                                                communicators_type& comms, Policy policy,
                                                Experts experts) requires is_topk_router {
    auto full = options_for(o, comms);
    if (!full) return unexpected<error>(full.error());
    auto router = Router::make(full->router, full->hidden);
    if (!router) return unexpected<error>(router.error());
    return made(exec, *full, comms, std::move(policy), std::move(experts), std::move(*router));
  }
  //! A layer with the caller's router, which must select `o.router.topk` of
  //! `o.router.num_experts` experts; the load-balancing losses score the logits with
  //! `o.router.score`; the expert bias is topk_router's alone.
  [[nodiscard]] static expected<moe_layer> make(Exec& exec, const moe_layer_options& o,
                                                communicators_type& comms, Policy policy,
                                                Experts experts, Router router) {
    auto full = options_for(o, comms);
    if (!full) return unexpected<error>(full.error());
    return made(exec, *full, comms, std::move(policy), std::move(experts), std::move(router));
  }

  //! `o` with EP, ETP, the attention TP and this rank's TP position taken from the communicators
  //! (options left at their defaults take them; a differing value is an error naming both).
  [[nodiscard]] static expected<moe_layer_options> options_for(moe_layer_options o,
                                                               const communicators_type& c) {
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

  //! The options it was made with (EP, ETP and TP as the communicators gave them).
  [[nodiscard]] const moe_layer_options& options() const noexcept { return o_; }
  //! The communicators it runs on.
  [[nodiscard]] communicators_type& communicators() const noexcept { return *comms_; }

  //! The dispatcher shape of a layer.
  [[nodiscard]] static dispatch_shape dispatch_shape_of(const moe_layer_options& o) noexcept {
    return moe_dispatch_shape(o);
  }
  //! The dispatcher workspace a layer of these options needs, per part (saved for the backward;
  //! scratch, which each forward in flight holds in its context), without making the layer or
  //! allocating.
  [[nodiscard]] static expected<dispatch_workspace_bytes> workspace_sizes(
      const moe_layer_options& o, std::optional<int> capacity = {}) {
    auto d = Dispatcher::make(dispatch_shape_of(o));
    if (!d) return unexpected<error>(d.error());
    return d->workspace_sizes(capacity);
  }
  //! What this layer's one-in-flight form holds, per part (sized at make for every forward).
  [[nodiscard]] dispatch_workspace_bytes workspace_sizes() const noexcept {
    return {bytes_of(own_saved_).size(), bytes_of(own_ctx_.disp_scratch_).size(), own_host_.size()};
  }
  //! The storage one forward in flight needs until its backward: the input copy [N, H], the
  //! logits [N, E], the dispatcher's, the experts' and the shared expert's saved parts (`saved`,
  //! in the layer's memory), the dispatcher's host part (`host`), for N = max_tokens and the
  //! most rows the experts may receive: the receive bound, or in pad mode C * E * ETP rows for the
  //! largest capacity C the drop policy states (drop_pad_rows_bound). Storage of this size holds
  //! every forward of the layer. With a capacity, the storage for a pad-mode forward of exactly
  //! that capacity (moe_forward_stats::pad_rows), for a caller that sizes it per step.
  [[nodiscard]] moe_saved_bytes saved_sizes(std::optional<int> capacity) const {
    const dispatch_workspace_bytes d = disp_.workspace_sizes(capacity);
    workspace_carver c;
    (void)carve_saved(c, d, received_rows(capacity));
    return {c.required(), d.host};
  }
  [[nodiscard]] moe_saved_bytes saved_sizes() const {
    moe_saved_bytes most = saved_sizes(std::nullopt);
    if (pad_bound_) {
      const moe_saved_bytes p = saved_sizes(pad_bound_);
      most = {std::max(most.saved, p.saved), std::max(most.host, p.host)};
    }
    return most;
  }
  //! What one forward in flight keeps per row its experts receive and per token (see
  //! moe_saved_rates); the experts' part is 0 for experts that keep nothing (mlp_experts with
  //! recompute_fc1, a functor without saved_bytes).
  [[nodiscard]] expected<moe_saved_rates> saved_bytes_per_row() const {
    // Measured as the growth of the saved part between two receive bounds (whole multiples of
    // the carver's alignment, so no padding blurs it), not restated from the parts' layouts.
    constexpr int r1 = 4096, r2 = 8192;
    dispatch_shape s = disp_.shape();
    const auto dispatch_saved = [&](int rows) -> expected<std::size_t> {
      s.max_recv_rows = rows;
      auto d = Dispatcher::make(s);
      if (!d) return unexpected<error>(d.error());
      return d->workspace_sizes().saved;
    };
    auto d1 = dispatch_saved(r1);
    if (!d1) return unexpected<error>(d1.error());
    auto d2 = dispatch_saved(r2);
    if (!d2) return unexpected<error>(d2.error());
    moe_saved_rates r;
    r.experts_per_row =
        (expert_saved_bytes(experts_, r2) - expert_saved_bytes(experts_, r1)) / (r2 - r1);
    r.per_received_row = (*d2 - *d1) / (r2 - r1) + r.experts_per_row;
    const std::size_t all = saved_sizes(std::nullopt).saved,
                      rows = r.per_received_row * detail::uz(recv_rows_);
    const std::size_t N = detail::uz(std::max(o_.max_tokens, 1));
    r.per_token = all > rows ? (all - rows + N - 1) / N : 0;
    return r;
  }

  //! The router weight [E, H] (logits = x W^T) and its gradient, in the layer's memory: its own,
  //! or the caller's after bind_parameters().
  [[nodiscard]] row_view<T, space> router_weight() const noexcept { return w_; }
  [[nodiscard]] row_view<grad_type, space> router_weight_grad() const noexcept { return dw_; }

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
  [[nodiscard]] status bind_parameters(const param_views_type& p) {
    const auto fits = [&](const auto& v) {
      return v.rows() == o_.router.num_experts && v.width() == o_.hidden && v.contiguous();
    };
    if (!fits(p.router_weight) || !fits(p.router_grad))
      return make_error(errc::shape_mismatch,
                        "moe_layer: bind_parameters: the router weight and its gradient must be "
                        "contiguous [E, H] = [" +
                            detail::to_decimal(o_.router.num_experts) + ", " +
                            detail::to_decimal(o_.hidden) + "]");
    const auto& sp = p.shared;
    return bind_all(p.router_weight, p.router_grad, sp,
                    !sp.mlp.fc1.empty() || !sp.mlp.fc2.empty() || !sp.grads.fc1.empty() ||
                        !sp.grads.fc2.empty() || !sp.gate.empty() || !sp.gate_grad.empty());
  }
  //! The same over host spans (host memory contexts), checked against param_sizes().
  [[nodiscard]] status bind_parameters(const params_type& p) requires host_accessible_v<space> {
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
    const int E = o_.router.num_experts, H = o_.hidden;
    return bind_all(row_view<T, space>(p.router_weight.data(), E, H),
                    row_view<grad_type, space>(p.router_grad.data(), E, H), sp,
                    !sp.mlp.fc1.empty() || !sp.mlp.fc2.empty() || !sp.mlp_grad.fc1.empty() ||
                        !sp.mlp_grad.fc2.empty() || !sp.gate.empty() || !sp.gate_grad.empty());
  }
  [[nodiscard]] Experts& experts() noexcept { return experts_; }
  //! The shared expert, or nullptr without one.
  [[nodiscard]] shared_type* shared() noexcept { return shared_ ? &*shared_ : nullptr; }
  //! The expert bias and this global batch's routed-token counts (null unless the router options
  //! enable the bias). Load a checkpointed bias into bias.
  [[nodiscard]] moefold::expert_bias<Exec>* expert_bias() noexcept {
    return bias_ ? &*bias_ : nullptr;
  }
  //! The running counts of the global load-balancing loss.
  [[nodiscard]] const load_balancing_losses<R, Exec>& load_balancing() const noexcept {
    return lb_;
  }
  [[nodiscard]] const Dispatcher& dispatcher() const noexcept { return disp_; }
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
  //! The context the one-in-flight form fills (its routing, keep mask, kept record, dispatch,
  //! stats).
  [[nodiscard]] const context_type& last_context() const noexcept { return own_ctx_; }
  //! The dispatch handle of the last one-in-flight forward (rows per local expert, bytes).
  [[nodiscard]] const auto& last_dispatch() const noexcept { return own_ctx_.dispatch(); }
  //! The routing of the last one-in-flight forward (every selected expert; host memory
  //! contexts), its keep mask [N, k] (what the drop policy kept) and the record the dispatcher
  //! took: expert [N, k], -1 for a dropped pair. A caller's context has the same accessors.
  [[nodiscard]] topk_routing<R> last_routing() const requires host_accessible_v<space> {
    return own_ctx_.routing();
  }
  [[nodiscard]] row_view<const std::uint8_t, space> last_keep() const noexcept {
    return own_ctx_.keep();
  }
  [[nodiscard]] row_view<const int, space> last_kept_experts() const noexcept {
    return own_ctx_.kept_experts();
  }

  //! What the drop decisions left in their sticky fault words since the last call, on contexts
  //! that do not read them at once (cpu_exec, cuda_exec: a device-to-host copy, a wait; host_exec
  //! refuses a bad routing or bad keys at the forward): a routing pair naming an expert outside
  //! [0, E) or twice, full-sequence order keys that were not a permutation of the group's [0, M)
  //! (those forwards dropped in the group's rank order). The words are then cleared. Then the
  //! dispatch of `ctx` (its dispatcher's device_status) while it is in flight, else the
  //! context's error word.
  [[nodiscard]] status device_status(Exec& x, const context_type& ctx) {
    using detail::to_decimal;
    if (!detail::reads_faults_at_once<Exec>) {
      int f[3] = {0, 0, 0};
      if (auto st = x.copy(faults_.cview(), row_view<int>(f, 1, 3)); !st) return st;
      if (auto st = x.synchronize(); !st) return st;
      constexpr int none = kernels::order_fault_none;
      if (f[0] != none || f[1] != none || f[2] != none) {
        if (auto st = x.template fill<int>(faults_.view(), none); !st) return st;
        if (f[0] != none)
          return make_error(errc::invalid_argument,
                            "moe_layer: the drop decision's routing pair " + to_decimal(f[0]) +
                                " names an expert outside [0, E) or one its token already named");
        return make_error(
            errc::invalid_argument,
            "moe_layer: full-sequence dropping's order keys must be a permutation of [0, M) over "
            "the tp-cp group's M tokens (sequence_order_keys' values): " +
                (f[1] != none
                     ? "the group's token " + to_decimal(f[1]) + " has a key outside [0, M)"
                     : "no token or more than one token has key " + to_decimal(f[2])) +
                "; those forwards dropped in the group's rank order");
      }
    }
    if (ctx.ready()) return disp_.device_status(x, ctx.dispatch());
    return device_status_of(x);
  }
  //! The one-in-flight form's.
  [[nodiscard]] status device_status(Exec& x) { return device_status(x, own_ctx_); }

  //! The state besides the weights (see moe_layer_state); waits for the context.
  [[nodiscard]] expected<moe_layer_state> save_state(Exec& x) const {
    moe_layer_state st;
    if (bias_)
      if (auto s = bias_->save(x, st.expert_bias, st.expert_bias_counts); !s)
        return unexpected<error>(s.error());
    if (o_.global_aux_loss_coeff > 0) {  // [E counts, micro-batches] on the context
      const auto run = lb_.running_state();
      std::vector<double> v(detail::uz(run.width()));
      if (auto s = first_error({x.copy(run, row_view<double, host_space>(v.data(), 1, run.width())),
                                x.synchronize()});
          !s)
        return unexpected<error>(s.error());
      st.global_aux_steps = static_cast<int>(v.back());
      v.pop_back();
      st.global_aux_counts = std::move(v);
    }
    return st;
  }
  //! Loads a saved state; checked first (sizes for these options, finite values, counts and steps
  //! >= 0), so a refused state changes nothing.
  [[nodiscard]] status load_state(Exec& x, const moe_layer_state& st) {
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
      if (auto s = bias_->load(x, st.expert_bias, st.expert_bias_counts); !s) return s;
    return lb_.load_running(x, st.global_aux_counts, st.global_aux_steps);
  }

  //! Training (default) or evaluation. In evaluation the forward computes no auxiliary losses
  //! and does not count tokens for the expert bias (Megatron-Core does both only with gradients
  //! enabled); the output is the same.
  void set_training(bool training) noexcept { training_ = training; }
  [[nodiscard]] bool training() const noexcept { return training_; }

  //! out [N, H] for x [N, H], into `ctx`, whose saved activations go to `storage` (see
  //! saved_sizes()); `ctx` and `storage` stay with this forward until its backward. In training
  //! it adds the routed counts to the expert bias and the global aux loss's running counts.
  //! `order_keys` [N, 1] (contiguous, or empty) are the tokens' true sequence positions for
  //! full-sequence dropping by position (see sequence_order_keys). Collective over the layer's
  //! groups.
  [[nodiscard]] expected<stats_type> forward(Exec& ex, row_view<const T, space> x,
                                             row_view<const std::int64_t, space> order_keys,
                                             row_view<T, space> out, context_type& ctx,
                                             const moe_saved_storage& storage) {
    return run_forward(ex, x, order_keys, out, ctx, storage, /*recompute=*/false);
  }
  //! The same over host spans (host memory contexts).
  [[nodiscard]] expected<stats_type> forward(
      Exec& ex, const moe_forward_input<T>& in, std::span<T> out, context_type& ctx,
      const moe_saved_storage& storage) requires host_accessible_v<space> {
    auto v = host_views(in, out);
    if (!v) return unexpected<error>(v.error());
    return forward(ex, v->x, v->keys, v->out, ctx, storage);
  }

  //! Activation recomputation: refills `ctx` (a forward whose activations were dropped, or
  //! whose storage is to be replaced) from the same input, into `storage`, before its backward.
  //! It changes no layer state (bias counts, running counts) and reuses the losses' terms the
  //! forward kept in `ctx`, so the backward equals the stored-activation one bitwise; `out` is
  //! written again. Every rank of the layer's groups recomputes together (it is collective).
  [[nodiscard]] status recompute(Exec& ex, context_type& ctx, row_view<const T, space> x,
                                 row_view<const std::int64_t, space> order_keys,
                                 row_view<T, space> out, const moe_saved_storage& storage) {
    if (!ctx.filled_)
      return make_error(errc::invalid_argument,
                        "moe_layer: recompute needs a context its forward filled and its backward "
                        "has not consumed");
    if (x.rows() != ctx.n_)
      return make_error(errc::shape_mismatch,
                        "moe_layer: recompute with N = " + detail::to_decimal(x.rows()) +
                            " of a forward of N = " + detail::to_decimal(ctx.n_) +
                            " (recompute from the forward's own input)");
    auto st = run_forward(ex, x, order_keys, out, ctx, storage, /*recompute=*/true);
    if (!st) return unexpected<error>(st.error());
    return {};
  }
  //! The same over host spans (host memory contexts).
  [[nodiscard]] status recompute(Exec& ex, context_type& ctx, const moe_forward_input<T>& in,
                                 std::span<T> out, const moe_saved_storage& storage) requires
      host_accessible_v<space> {
    auto v = host_views(in, out);
    if (!v) return unexpected<error>(v.error());
    return recompute(ex, ctx, v->x, v->keys, v->out, storage);
  }

  //! dx [N, H] from dout [N, H] of the forward in `ctx`, which it consumes (`after`: or retains
  //! for recompute() and another backward); `seeds` weight each loss (see moe_loss_seeds). Adds
  //! the router weight, expert and shared-expert gradients. After an evaluation forward no
  //! auxiliary loss contributes. Reads nothing back to the host.
  [[nodiscard]] status backward(Exec& ex, context_type& ctx, row_view<const T, space> dout,
                                const moe_loss_seeds<R>& seeds, row_view<T, space> dx,
                                moe_context_after after = moe_context_after::consumed) {
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
    const int H = o_.hidden;
    typename Dispatcher::handle_type& hd = *ctx.handle_;
    const int n = ctx.n_, M = hd.num_rows();
    if (dout.rows() != n || dout.width() != H || dx.rows() != n || dx.width() != H)
      return make_error(errc::shape_mismatch, "moe_layer: dout and dx must be [N, H] = [" +
                                                  detail::to_decimal(n) + ", " +
                                                  detail::to_decimal(H) + "] (the forward's N)");
    const dispatch_groups<Comm> g = dispatch_groups_of();
    // The backward's scratch: the context's, sized by its forward for these M rows.
    workspace_carver c(bytes_of(ctx.scratch_));
    const scratch_views b = carve_scratch(c, M);
    if (!c.fits())
      return make_error(errc::workspace_too_small,
                        "moe_layer: the context's scratch does not hold its forward's rows");
    const auto first = [n](auto v) { return v.first(n); };
    const auto dy = b.rows, dx_rows = b.dx_rows;
    const auto dp_rows = b.dp_rows, dprobs = first(b.dprobs), dprobs_r = first(b.dprobs_r);
    const auto dx_experts = first(b.dx_experts), dout_seeded = first(b.dout_seeded);
    const auto dlogits = first(b.dlogits), dx_router = first(b.dx_router);
    row_view<const T, space> dmain = dout;  // the main output's gradient, times its seed
    if (seeds.output != R(1)) {
      if (auto st = ex.copy(dout, dout_seeded); !st) return st;
      if (auto st = ex.template scale<T>(dout_seeded, detail::narrow<T>(seeds.output)); !st)
        return st;
      dmain = dout_seeded;
    }
    if (auto st = first_error({zero<T>(ex, dy), zero<T>(ex, dx_rows), zero<Pt>(ex, dp_rows),
                               zero<Pt>(ex, dprobs), zero<T>(ex, dx_experts)});
        !st)
      return st;
    if (auto st = disp_.combine_backward(ex, hd, dmain, g, dy); !st) return st;
    ctx.filled_ = false;  // from here the backward has begun: the context is consumed
    if (auto st = detail::expert_backward(experts_, ex, hd.batch(), dy, dx_rows, dp_rows,
                                          ctx.experts_saved_, b.experts_ws);
        !st)
      return done(ctx, st, after);
    if (auto st = disp_.dispatch_backward(ex, hd, dx_rows, dp_rows, g, dx_experts, dprobs); !st)
      return done(ctx, st, after);
    // Router's path: dropped pairs have no gradient (their probabilities were not renormalised),
    // then the router Jacobian, the auxiliary losses, the gating GEMM.
    const row_view<const R, space> logits = ctx.logits_.first(n);
    const row_view<const T, space> x = ctx.x_.first(n);
    if (auto st = zero<R>(ex, dlogits); !st) return done(ctx, st, after);
    if (auto st = zero<R>(ex, dx_router); !st) return done(ctx, st, after);
    // The kept pairs' probability gradients [N, k], widened from Pt to R for the router.
    if (auto st = ex.template convert<R, Pt>(row_view<const Pt, space>(dprobs), dprobs_r); !st)
      return done(ctx, st, after);
    if (auto st = router_.backward(ex, {.logits = logits,
                                        .indices = ctx.indices(),
                                        .dprobs = row_view<const R, space>(dprobs_r),
                                        .dlogits = dlogits});
        !st)
      return done(ctx, st, after);
    // The load-balancing terms (micro-batch, per sequence, global) and the z-loss, each when its
    // forward ran it, into the same dlogits.
    {
      const std::size_t lb_bytes = ctx.lb_.any() || ctx.z_.on ? lb_.saved_bytes() : 0;
      const std::span<std::byte> saved = loss_saved(ctx);
      if (auto st = lb_.backward(ex, logits, {}, ctx.lb_, saved.first(lb_bytes),
                                 {seeds.aux, seeds.seq_aux, seeds.global_aux}, dlogits);
          !st)
        return done(ctx, st, after);
      if (auto st = z_.backward(ex, logits, {}, ctx.z_, saved.subspan(lb_bytes), seeds.z, dlogits);
          !st)
        return done(ctx, st, after);
    }
    // The router weight's gradient goes straight into its (caller's) buffer, beta = 1.
    if (auto st = gating_.backward(ex,
                                   gating_backward_args<T, R, grad_type, space>{
                                       .x = x,
                                       .weight = row_view<const T, space>(w_),
                                       .dlogits = row_view<const R, space>(dlogits),
                                       .dx = dx_router,
                                       .weight_grad = dw_},
                                   b.gating_ws);
        !st)
      return done(ctx, st, after);
    // dx = dx_experts + dx_router (+ dx_shared).
    if (auto st = ex.copy(row_view<const T, space>(dx_experts), dx); !st)
      return done(ctx, st, after);
    if (auto st = ex.template add_converted<T, R>(row_view<const R, space>(dx_router), dx); !st)
      return done(ctx, st, after);
    if (shared_)  // dx += dx_shared
      if (auto st = shared_->backward(ex, dmain, comms_->tp, dx, ctx.shared_saved_, b.shared_ws);
          !st)
        return done(ctx, st, after);
    return done(ctx, {}, after);
  }
  //! The same over host spans (host memory contexts).
  [[nodiscard]] status backward(Exec& ex, context_type& ctx, std::span<const T> dout,
                                const moe_loss_seeds<R>& seeds, std::span<T> dx,
                                moe_context_after after = moe_context_after::consumed) requires
      host_accessible_v<space> {
    const int n = ctx.n_;
    if (!ctx.ready())  // the view form names what the context lacks
      return backward(ex, ctx, row_view<const T, space>{}, seeds, row_view<T, space>{});
    if (dout.size() != detail::uz(n) * detail::uz(o_.hidden) || dx.size() != dout.size())
      return make_error(errc::shape_mismatch, "moe_layer: dout and dx must be [N, H]");
    return backward(ex, ctx, rows(dout, n), seeds, rows(dx, n), after);
  }

  //! The one-in-flight form: out [N, H] for x [N, H] into the layer's own context and storage.
  [[nodiscard]] expected<stats_type> forward(Exec& ex, row_view<const T, space> x,
                                             row_view<const std::int64_t, space> order_keys,
                                             row_view<T, space> out) {
    return run_forward(ex, x, order_keys, out, own_ctx_, {bytes_of(own_saved_), own_host_},
                       /*recompute=*/false);
  }
  //! The same over host spans: `order_keys` [N] or empty.
  [[nodiscard]] expected<stats_type> forward(Exec& ex, int n, std::span<const T> x,
                                             std::span<const std::int64_t> order_keys,
                                             std::span<T> out) requires host_accessible_v<space> {
    auto v = host_views({.num_tokens = n, .x = x, .order_keys = order_keys}, out);
    if (!v) return unexpected<error>(v.error());
    return forward(ex, v->x, v->keys, v->out);
  }

  //! dx [N, H] from dout [N, H] of the last one-in-flight forward; `loss_seed` is d(training
  //! loss) / d(each auxiliary loss) (Megatron's aux-loss scale).
  [[nodiscard]] status backward(Exec& ex, row_view<const T, space> dout, R loss_seed,
                                row_view<T, space> dx) {
    if (!own_ctx_.ready())
      return make_error(errc::invalid_argument, "moe_layer: backward before forward");
    return backward(ex, own_ctx_, dout, seeds_of(loss_seed), dx);
  }
  //! The same over host spans.
  [[nodiscard]] status backward(Exec& ex, std::span<const T> dout, R loss_seed,
                                std::span<T> dx) requires host_accessible_v<space> {
    if (!own_ctx_.ready())
      return make_error(errc::invalid_argument, "moe_layer: backward before forward");
    return backward(ex, own_ctx_, dout, seeds_of(loss_seed), dx);
  }

  //! Sums the local gradients over their groups: the router weight over tp-dp-cp, the experts'
  //! over edp (`expert_grads`: the experts' gradient buffers, e.g. {fc1 grads, fc2 grads}), and
  //! with a shared expert its MLP over dp-cp and its gate over tp-dp-cp. Collective.
  [[nodiscard]] status reduce_gradients(
      Exec& ex, std::initializer_list<row_view<grad_type, space>> expert_grads) {
    if (auto st = comms_->tp_dp_cp.all_reduce(ex, dw_, reduce_op::sum); !st) return st;
    if (auto st = all_reduce_each<grad_type>(comms_->edp, ex, expert_grads, reduce_op::sum); !st)
      return st;
    return reduce_shared(ex);
  }
  //! The same with the experts' buffers as host spans (host memory contexts).
  [[nodiscard]] status reduce_gradients(
      Exec& ex,
      std::initializer_list<std::span<grad_type>> expert_grads) requires host_accessible_v<space> {
    if (auto st = comms_->tp_dp_cp.all_reduce(ex, dw_, reduce_op::sum); !st) return st;
    if (auto st = all_reduce_each<grad_type>(comms_->edp, expert_grads, reduce_op::sum); !st)
      return st;
    return reduce_shared(ex);
  }
  //! The same with the experts' own gradient views (`grads()`, as mlp_experts and reference_mlp
  //! expose them): no list from the caller.
  [[nodiscard]] status reduce_gradients(Exec& ex) requires
      exposes_expert_grads<Experts, grad_type, space> {
    const auto& g = experts_.grads();
    return reduce_gradients(ex, {g.fc1, g.fc2});
  }

  //! Once per global batch, after the last backward: updates the expert bias from the counts of
  //! the whole stage (bias += rate * sign(mean - count), counts summed over tp-dp-cp) and restarts
  //! the global load-balancing loss's running counts. Collective over tp-dp-cp when the bias is
  //! enabled.
  [[nodiscard]] status end_global_batch(Exec& ex) {
    if (o_.router.expert_bias)
      if (auto st = bias_->update(ex, comms_->tp_dp_cp); !st) return st;
    return lb_.reset_running(ex);
  }

 private:
  moe_layer(const moe_layer_options& o, communicators_type& comms, Router r, Policy p, Dispatcher d,
            Experts e)
      : o_(o),
        comms_(&comms),
        router_(std::move(r)),
        policy_(std::move(p)),
        disp_(std::move(d)),
        experts_(std::move(e)) {}

  dispatch_groups<Comm> dispatch_groups_of() const noexcept {
    return {comms_->ep, comms_->etp, comms_->tp_ep};
  }

  // Both bind_parameters forms once their router views are checked: the shared expert's
  // parameters (its own check first), then the router's; a refused binding changes nothing.
  template <class SharedParams>
  status bind_all(row_view<T, space> w, row_view<grad_type, space> dw, const SharedParams& sp,
                  bool any_shared) {
    if (!shared_ && any_shared)
      return make_error(errc::invalid_argument,
                        "moe_layer: bind_parameters: shared-expert parameters given to a layer "
                        "without a shared expert");
    if (shared_)
      if (auto st = shared_->bind(sp); !st) return st;  // checks its shapes before changing
    w_ = w;
    dw_ = dw;
    own_w_ = {};
    own_dw_ = {};
    return {};
  }

  // The shared expert's gradients: its MLP's over dp-cp, its gate's over tp-dp-cp.
  status reduce_shared(Exec& ex) {
    if (!shared_) return {};
    const auto& sg = shared_->params();
    if (auto st = all_reduce_each<grad_type>(comms_->dp_cp, ex, {sg.grads.fc1, sg.grads.fc2},
                                             reduce_op::sum);
        !st)
      return st;
    if (!o_.shared_expert.gate) return {};
    return comms_->tp_dp_cp.all_reduce(ex, sg.gate_grad, reduce_op::sum);
  }

  // make(): the options checked, the pieces made, the buffers allocated.
  [[nodiscard]] static expected<moe_layer> made(Exec& x, const moe_layer_options& o,
                                                communicators_type& comms, Policy policy,
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
                        "moe_layer: batch (sequences per micro-batch) must be >= 1");
    if (o.router.expert_bias &&
        !(std::isfinite(o.expert_bias_update_rate) && o.expert_bias_update_rate >= 0))
      return make_error(errc::invalid_argument,
                        "moe_layer: expert_bias_update_rate must be finite and >= 0");
    if (o.shared_expert.ffn < 0)
      return make_error(errc::invalid_size, "moe_layer: shared_expert.ffn must be >= 0");
    auto gating = gating_type::make(o.router.num_experts, o.hidden);
    if (!gating) return unexpected<error>(gating.error());
    moe_layer l(o, comms, std::move(router), std::move(policy), std::move(*disp),
                std::move(experts));
    l.gating_ = *gating;
    const int E = o.router.num_experts, H = o.hidden;
    // The router weight and its gradient, zeroed (the caller loads the weight or binds its own).
    auto w = buffer<T>::make(x, E, H);
    if (!w) return unexpected<error>(w.error());
    auto dw = buffer<grad_type>::make(x, E, H);
    if (!dw) return unexpected<error>(dw.error());
    l.own_w_ = std::move(*w);
    l.own_dw_ = std::move(*dw);
    l.w_ = l.own_w_.view();
    l.dw_ = l.own_dw_.view();
    if (auto st =
            first_error({x.template fill<T>(l.w_, T(0)), x.template fill<grad_type>(l.dw_, 0)});
        !st)
      return unexpected<error>(st.error());
    auto lb = load_balancing_type::make(x, moe_load_balancing_options(o));
    if (!lb) return unexpected<error>(lb.error());
    l.lb_ = std::move(*lb);
    auto z = z_loss_type::make(o.router.num_experts, o.max_tokens, o.z_loss_coeff);
    if (!z) return unexpected<error>(z.error());
    l.z_ = *z;
    if (o.router.expert_bias) {
      auto b = moefold::expert_bias<Exec>::make(x, o.router.num_experts, o.expert_bias_update_rate);
      if (!b) return unexpected<error>(b.error());
      l.bias_.emplace(std::move(*b));
    }
    if (o.shared_expert.ffn > 0) {
      auto se = shared_type::make(x, {.max_tokens = o.max_tokens,
                                      .hidden = o.hidden,
                                      .ffn = o.shared_expert.ffn,
                                      .tp = o.shared_expert.tp,
                                      .tp_rank = o.shared_expert.tp_rank,
                                      .act = o.shared_expert.act,
                                      .gate = o.shared_expert.gate});
      if (!se) return unexpected<error>(se.error());
      l.shared_.emplace(std::move(*se));
    }
    auto faults = buffer<int>::make(x, 1, 3);
    if (!faults) return unexpected<error>(faults.error());
    l.faults_ = std::move(*faults);
    if (auto st = x.template fill<int>(l.faults_.view(), kernels::order_fault_none); !st)
      return unexpected<error>(st.error());
    l.recv_rows_ = static_cast<int>(
        o.max_recv_rows.value_or(static_cast<int>(detail::worst_recv_rows(l.disp_.shape()))));
    const drop_shape ds{.max_tokens = o.max_tokens,
                        .topk = o.router.topk,
                        .num_experts = E,
                        .group = comms.tp_cp.size()};
    // A policy that states its rules (moefold's do) is checked now, not at the first forward.
    if (auto st = check_drop_policy(l.policy_, ds); !st) return unexpected<error>(st.error());
    l.drop_ws_bytes_ = l.policy_.template workspace_bytes<R>(ds);
    // The most rows the experts may receive: the receive bound, or in pad mode what the policy's
    // largest capacity gives (the dispatcher refuses more than an explicit max_recv_rows).
    l.pad_bound_ = drop_pad_rows_bound(l.policy_, ds);
    l.rows_bound_ = l.recv_rows_;
    if (l.pad_bound_ && !o.max_recv_rows)
      l.rows_bound_ = std::max(l.rows_bound_, l.received_rows(l.pad_bound_));
    // Sized once for every forward (nothing is allocated per step): the one-in-flight form's
    // storage and context.
    const moe_saved_bytes sb = l.saved_sizes();
    if (auto st = first_error({l.ensure(x, l.own_saved_, sb.saved), l.prepare(x, l.own_ctx_)}); !st)
      return unexpected<error>(st.error());
    l.own_host_.resize(sb.host);
    // Later calls may run on other contexts (streams): the buffers are ready before they do.
    if (auto st = x.synchronize(); !st) return unexpected<error>(st.error());
    return l;
  }

  // The saved part of one forward in flight, carved by one function for its size and its views.
  struct saved_views {
    row_view<T, space> x;       // [max_tokens, H], rows 16 bytes apart
    row_view<R, space> logits;  // [max_tokens, E]
    // The dispatcher's, the experts' (for `rows` received rows) and the shared expert's parts.
    std::span<std::byte> dispatch, experts, shared_ex;
  };
  saved_views carve_saved(workspace_carver& c, const dispatch_workspace_bytes& d, int rows) const {
    const int N = o_.max_tokens, H = o_.hidden, E = o_.router.num_experts;
    saved_views v;
    v.x = take_rows<T>(c, N, H);
    v.logits = take<R>(c, N, E);
    v.dispatch = c.take<std::byte>(d.saved);
    v.experts = c.take<std::byte>(expert_saved_bytes(experts_, rows));
    v.shared_ex = c.take<std::byte>(shared_ ? shared_->saved_bytes() : 0);
    return v;
  }
  // The most rows the experts receive: pad mode's C * E * ETP for capacity C, else the receive
  // bound (capped at 2^31 - 1: the dispatcher refuses more).
  int received_rows(std::optional<int> pad_rows) const noexcept {
    if (!pad_rows) return recv_rows_;
    const long long m =
        static_cast<long long>(*pad_rows) * o_.router.num_experts * disp_.shape().etp;
    return static_cast<int>(std::min<long long>(m, max_rows));
  }
  // A context's scratch for M dispatched rows: first what the forward uses before its dispatch
  // (at the same offsets whatever M is), then the rows. The forward's and the backward's pieces
  // are disjoint, except the rows [M, H]: y in the forward, dy in the backward.
  struct scratch_views {
    row_view<R, space> logits;  // [N, E] until copied to the saved part
    std::span<std::byte> drop_ws, gating_ws, loss_ws;
    row_view<T, space> rows, dx_rows;            // [M, H]
    row_view<Pt, space> dp_rows;                 // [M, 1]
    row_view<Pt, space> dprobs;                  // [N, k]
    row_view<R, space> dprobs_r;                 // [N, k]
    row_view<T, space> dx_experts, dout_seeded;  // [N, H] contiguous
    row_view<R, space> dlogits;                  // [N, E]
    row_view<R, space> dx_router;                // [N, H]
    std::span<std::byte> experts_ws, shared_ws;
  };
  scratch_views carve_scratch(workspace_carver& c, int M) const {
    const int N = o_.max_tokens, H = o_.hidden, E = o_.router.num_experts, K = o_.router.topk;
    scratch_views v;
    v.logits = take<R>(c, N, E);
    v.drop_ws = c.take<std::byte>(drop_ws_bytes_);
    v.gating_ws = c.take<std::byte>(gating_type::workspace_bytes());
    v.loss_ws = c.take<std::byte>(lb_.workspace_bytes());
    v.dprobs = take<Pt>(c, N, K);
    v.dprobs_r = take<R>(c, N, K);
    // Contiguous: the dispatchers' dx and (AllGather's) dout are.
    v.dx_experts = take<T>(c, N, H);
    v.dout_seeded = take<T>(c, N, H);
    v.dlogits = take<R>(c, N, E);
    v.dx_router = take_rows<R>(c, N, H);
    v.shared_ws = c.take<std::byte>(shared_ ? shared_->scratch_bytes() : 0);
    v.rows = take_rows<T>(c, M, H);
    v.dx_rows = take_rows<T>(c, M, H);
    v.dp_rows = take<Pt>(c, M, 1);
    v.experts_ws = c.take<std::byte>(expert_workspace_bytes(experts_, M));
    return v;
  }
  template <class U>
  static row_view<U, space> take(workspace_carver& c, int rows, int width) {
    const std::span<U> s = c.take<U>(detail::uz(rows) * detail::uz(width));
    return row_view<U, space>(s.data(), rows, width);
  }
  // Rows of H values start 16 bytes apart (the kernels' 16-byte row accesses, the GEMMs'
  // alignment): the stride is H padded up.
  template <class U>
  static row_view<U, space> take_rows(workspace_carver& c, int rows, int H) {
    static_assert(16 % sizeof(U) == 0, "a row element must divide 16 bytes");
    constexpr int per16 = static_cast<int>(16 / sizeof(U));
    const int stride = (H + per16 - 1) / per16 * per16;
    const std::span<U> s = c.take<U>(detail::uz(rows) * detail::uz(stride));
    return row_view<U, space>(s.data(), rows, H, stride);
  }

  // The host-span forms' views, their sizes checked.
  struct views_of_spans {
    row_view<const T, space> x;
    row_view<const std::int64_t, space> keys;
    row_view<T, space> out;
  };
  expected<views_of_spans> host_views(const moe_forward_input<T>& in, std::span<T> out) const {
    const int n = in.num_tokens;
    const auto H = detail::uz(o_.hidden);
    if (n < 0 || n > o_.max_tokens || in.x.size() != detail::uz(n) * H ||
        out.size() != detail::uz(n) * H)
      return make_error(errc::shape_mismatch,
                        "moe_layer: x and out must be [N, H] with N <= max_tokens");
    if (!in.order_keys.empty() && in.order_keys.size() != detail::uz(n))
      return make_error(errc::shape_mismatch, "moe_layer: order_keys must be [N] or empty");
    return views_of_spans{.x = rows(in.x, n),
                          .keys = in.order_keys.empty() ? row_view<const std::int64_t, space>{}
                                                        : row_view<const std::int64_t, space>(
                                                              in.order_keys.data(), n, 1),
                          .out = rows(out, n)};
  }
  template <class U>
  row_view<U, space> rows(std::span<U> v, int n) const {
    return row_view<U, space>(v.data(), n, o_.hidden);
  }
  static moe_loss_seeds<R> seeds_of(R loss_seed) noexcept {
    return {.output = R(1),
            .aux = loss_seed,
            .seq_aux = loss_seed,
            .global_aux = loss_seed,
            .z = loss_seed};
  }

  // A context's buffers, allocated at its first forward for max_tokens and the receive bound
  // (or again when a layer of other options fills it). On failure the context holds none.
  status prepare(Exec& x, context_type& c) {
    using key_t = typename context_type::sizes_key;
    const key_t k{.tokens = std::max(o_.max_tokens, 1),
                  .topk = o_.router.topk,
                  .experts = o_.router.num_experts,
                  .loss_bytes = lb_.saved_bytes() + z_.saved_bytes()};
    if (c.key_ == k) return {};
    const auto alloc = [&x](auto& b, long long rows, long long width) -> status {
      using B = std::remove_reference_t<decltype(b)>;
      auto m = B::make(x, rows, width);
      if (!m) return unexpected<error>(m.error());
      b = std::move(*m);
      return {};
    };
    const long long N = k.tokens, K = k.topk, E = k.experts;
    if (auto st =
            first_error({alloc(c.indices_, N, K), alloc(c.kept_, N, K), alloc(c.counts_, 3, E),
                         alloc(c.probs_, N, K), alloc(c.keep_, N, K), alloc(c.kept_probs_, N, K),
                         alloc(c.totals_, 1, 2), alloc(c.losses_, 1, moe_loss_count),
                         alloc(c.loss_saved_, 1,
                               static_cast<long long>(std::max<std::size_t>(k.loss_bytes, 1))),
                         size_scratch(x, c), size_dispatch_scratch(x, c)});
        !st) {
      c.key_ = {};
      return st;
    }
    c.key_ = k;
    return {};
  }
  static std::span<std::byte> loss_saved(context_type& c) noexcept {
    return {c.loss_saved_.view().data(), c.key_.loss_bytes};
  }
  // The context's scratch for the most rows the experts may receive (the layer's row bound).
  status size_scratch(Exec& x, context_type& c) {
    workspace_carver m;
    (void)carve_scratch(m, rows_bound_);
    return ensure(x, c.scratch_, m.required());
  }
  // The dispatcher's scratch of the context (it lives until the backward: the handle's), for a
  // dropless forward and a pad-mode one of the policy's largest capacity.
  status size_dispatch_scratch(Exec& x, context_type& c) {
    std::size_t most = disp_.workspace_sizes(std::nullopt).scratch;
    if (pad_bound_) most = std::max(most, disp_.workspace_sizes(pad_bound_).scratch);
    return ensure(x, c.disp_scratch_, most);
  }

  // The forward, or (recompute) its side-effect-free repetition into a filled context.
  [[nodiscard]] expected<stats_type> run_forward(Exec& ex, row_view<const T, space> x,
                                                 row_view<const std::int64_t, space> keys,
                                                 row_view<T, space> out, context_type& ctx,
                                                 const moe_saved_storage& storage, bool recompute) {
    const int n = x.rows(), H = o_.hidden;
    if (n < 0 || n > o_.max_tokens || x.width() != H || out.rows() != n || out.width() != H)
      return make_error(errc::shape_mismatch,
                        "moe_layer: x and out must be [N, H] with N <= max_tokens = " +
                            detail::to_decimal(o_.max_tokens) + ", H = " + detail::to_decimal(H));
    if (!keys.empty() && (keys.rows() != n || keys.width() != 1 || !keys.contiguous()))
      return make_error(errc::shape_mismatch,
                        "moe_layer: the order keys must be contiguous [N, 1] = [" +
                            detail::to_decimal(n) + ", 1] or empty");
    const bool training = recompute ? ctx.training_ : training_;
    if (training && o_.seq_aux_loss_coeff > 0 && n % o_.batch != 0)
      return make_error(errc::shape_mismatch,
                        "moe_layer: the per-sequence loss needs N a multiple of batch (N = " +
                            detail::to_decimal(n) + ", batch = " + detail::to_decimal(o_.batch) +
                            "; token n = s * batch + b is sequence b)");
    // A failed forward leaves nothing for a backward; a failed recompute leaves the forward's
    // terms for another try.
    ctx.drop_activations();
    if (!recompute) ctx.filled_ = false;
    if (auto st = prepare(ex, ctx); !st) return unexpected<error>(st.error());
    // The saved part: its own pieces checked before anything runs, then, once the drop policy
    // has given the capacity (pad mode), with the dispatcher's part, before any side effect.
    const auto carve = [&](const dispatch_workspace_bytes& d, int rows) -> expected<saved_views> {
      workspace_carver c(storage.saved);
      saved_views v = carve_saved(c, d, rows);
      if (!c.fits() || storage.host.size() < d.host)
        return make_error(
            errc::workspace_too_small,
            "moe_layer: the saved storage has " + detail::to_decimal(storage.saved.size()) +
                " saved and " + detail::to_decimal(storage.host.size()) +
                " host bytes; saved_sizes() asks for " + detail::to_decimal(c.required()) +
                " and " + detail::to_decimal(d.host));
      return v;
    };
    if (auto pre = carve({}, 0); !pre) return unexpected<error>(pre.error());
    // What the forward uses before its dispatch, at the front of the context's scratch.
    scratch_views front;
    {
      workspace_carver c(bytes_of(ctx.scratch_));
      front = carve_scratch(c, 0);
    }
    const row_view<R, space> logits = front.logits.first(n);
    if (auto st =
            gating_.forward(ex, {.x = x, .weight = row_view<const T, space>(w_), .logits = logits},
                            front.gating_ws);
        !st)
      return unexpected<error>(st.error());
    if (auto st = route(ex, n, logits, ctx); !st) return unexpected<error>(st.error());
    // The drop policy decides on the context what each expert keeps: the keep mask, the kept
    // record the dispatcher takes, the counts; the selection stays whole for the router backward.
    const auto counts_v = ctx.counts_.view();
    auto decided = policy_.apply(
        ex, comms_->tp_cp,
        drop_input<R, space>{.experts = ctx.indices_.cview().first(n),
                             .probs = ctx.probs_.cview().first(n),
                             .order_keys = keys},
        drop_output<space>{
            .keep = ctx.keep_.view().first(n),
            .kept = ctx.kept_.view().first(n),
            .routed = counts_v.subrows(0, 1),
            .dropped = counts_v.subrows(1, 1),
            .padded = counts_v.subrows(2, 1),
            .totals = ctx.totals_.view(),
            // Contexts that read a fault at once refuse the forward instead.
            .faults = detail::reads_faults_at_once<Exec> ? row_view<int, space>{} : faults_.view()},
        front.drop_ws);
    if (!decided) return unexpected<error>(decided.error());
    const auto kept = row_view<const int, space>(ctx.kept_.view().first(n));
    if (auto st = write_kept_probs(ex, kept, ctx.probs_.cview().first(n),
                                   ctx.kept_probs_.view().first(n));
        !st)
      return unexpected<error>(st.error());
    const dispatch_input<T, space, Pt> din{
        .num_tokens = n,
        .x = x,
        .expert = kept,
        .probs = ctx.kept_probs_.cview().first(n),
        .capacity = decided->pad_rows,
        // Dropless: the record is the router's selection, k experts per token (the dispatcher
        // may take it on trust; device_status checks it).
        .every_pair_routed = !decided->capacity.has_value()};
    // Pad mode sizes the rows from the capacity, once the capacity is known to be sane.
    if (decided->pad_rows)
      if (auto st = detail::check_dispatch_input(disp_.shape(), din); !st)
        return unexpected<error>(st.error());
    // The buffers were sized at make for every forward the policy states; a user policy that
    // pads past the receive bound without stating its bound is refused before any side effect.
    const int bound_rows = received_rows(decided->pad_rows);
    const dispatch_workspace_bytes need = disp_.workspace_sizes(decided->pad_rows);
    if (bound_rows > rows_bound_ || need.scratch > bytes_of(ctx.disp_scratch_).size())
      return make_error(
          errc::receive_bound_exceeded,
          "moe_layer: pad mode with capacity " + detail::to_decimal(decided->pad_rows.value_or(0)) +
              " gives " + detail::to_decimal(bound_rows) +
              " rows to this rank's experts, more than the " + detail::to_decimal(rows_bound_) +
              " the layer sized its buffers for when it was made (the receive "
              "bound; a drop policy states its largest padding with "
              "pad_rows_bound(shape))");
    auto sv = carve(need, bound_rows);
    if (!sv) return unexpected<error>(sv.error());
    // The losses (a training forward adds to the global aux loss's running counts; nothing
    // before this point changes the layer's state, so a refused forward can be retried) and the
    // expert bias's counts of what was dispatched (the post-drop map), once per training
    // forward; a recompute reuses the forward's.
    if (!recompute) {
      if (auto st = forward_losses(ex, ctx, logits, front.loss_ws, training); !st)
        return unexpected<error>(st.error());
      if (training && o_.router.expert_bias)
        if (auto st = bias_->add_counts(ex, row_view<const int, space>(counts_v.subrows(0, 1)),
                                        row_view<const int, space>(counts_v.subrows(1, 1)),
                                        row_view<const int, space>(counts_v.subrows(2, 1)));
            !st)
          return unexpected<error>(st.error());
    }
    if (auto st = ex.copy(x, sv->x.first(n)); !st) return unexpected<error>(st.error());
    if (auto st = ex.copy(row_view<const R, space>(logits), sv->logits.first(n)); !st)
      return unexpected<error>(st.error());
    const dispatch_workspace dws{
        .saved = sv->dispatch, .scratch = bytes_of(ctx.disp_scratch_), .host = storage.host};
    auto h = disp_.dispatch(ex, din, dispatch_groups_of(), dws);
    if (!h) return unexpected<error>(h.error());
    ctx.handle_.emplace(std::move(*h));
    auto& hd = *ctx.handle_;
    const int M = hd.num_rows();
    workspace_carver c(bytes_of(ctx.scratch_));
    const scratch_views sc = carve_scratch(c, M);
    if (M > bound_rows || !c.fits())  // the dispatcher keeps to the receive bound
      return fail(
          ctx, make_error(errc::receive_bound_exceeded,
                          "moe_layer: the dispatch gave " + detail::to_decimal(M) +
                              " rows, more than the bound of " + detail::to_decimal(bound_rows)));
    const row_view<T, space> y = sc.rows;
    if (auto st = detail::expert_forward(experts_, ex, hd.batch(), y, sv->experts, sc.experts_ws);
        !st)
      return fail(ctx, st);
    if (auto st = disp_.combine(ex, hd, row_view<const T, space>(y), dispatch_groups_of(), out);
        !st)
      return fail(ctx, st);
    if (shared_)  // out += shared(x), the sum Megatron-Core forms in combine_postprocess
      if (auto st = shared_->forward(ex, x, comms_->tp, out, sv->shared_ex, sc.shared_ws); !st)
        return fail(ctx, st);
    ctx.n_ = n;
    ctx.x_ = sv->x;
    ctx.logits_ = sv->logits;
    ctx.shared_saved_ = sv->shared_ex;
    ctx.experts_saved_ = sv->experts;
    ctx.capacity_ = decided->capacity;
    ctx.pad_rows_ = decided->pad_rows;
    if (!recompute) ctx.training_ = training;
    ctx.filled_ = true;
    return ctx.stats();
  }

  // The load-balancing losses and the z-loss of a training forward: what their backward needs
  // stays in ctx (its own bytes, not the storage: a recompute reuses it); their values go to the
  // context's losses [1, 4] (zero where a loss is off and in evaluation).
  [[nodiscard]] status forward_losses(Exec& ex, context_type& ctx, row_view<R, space> logits,
                                      std::span<std::byte> ws, bool training) {
    ctx.lb_ = {};
    ctx.z_ = {};
    const row_view<R, space> values = ctx.losses_.view();
    if (auto st = ex.template fill<R>(values, R(0)); !st) return st;
    if (!training || (!lb_.any() && !z_.on())) return {};
    const std::size_t lb_bytes = lb_.saved_bytes();
    const std::span<std::byte> saved = loss_saved(ctx);
    const std::span<std::byte> lb_saved = saved.first(lb_bytes), z_saved = saved.subspan(lb_bytes);
    const row_view<const R, space> lv = logits;
    static_assert(load_balancing_terms + 1 == moe_loss_count);
    if (lb_.any()) {
      auto rec = lb_.forward(ex, lv, {}, comms_->tp_cp, &comms_->tp_dp_cp, lb_saved, ws);
      if (!rec) return unexpected<error>(rec.error());
      ctx.lb_ = *rec;
      if (auto st = ex.copy(lb_.losses(lb_saved),
                            row_view<R, space>(values.data(), 1, load_balancing_terms));
          !st)
        return st;
    }
    if (z_.on()) {
      auto rec = z_.forward(ex, lv, {}, comms_->tp_cp.size(), z_saved);
      if (!rec) return unexpected<error>(rec.error());
      ctx.z_ = *rec;
      if (auto st = ex.copy(z_.loss(z_saved),
                            row_view<R, space>(values.data() + load_balancing_terms, 1, 1));
          !st)
        return st;
    }
    return {};
  }

  // The router's routing of n tokens' logits [n, E] into the context's record (indices and
  // probabilities [n, k]): moefold's router with the expert bias, a user router without. On host
  // memory non-finite logits are refused first (a NaN would select no expert on every context).
  [[nodiscard]] status route(Exec& ex, int n, row_view<R, space> logits, context_type& ctx) {
    if (auto st = detail::check_finite_rows(row_view<const R, space>(logits), "router logits"); !st)
      return st;
    row_view<const float, space> bias{};
    if (o_.router.expert_bias)  // make() refuses the option for a user router
      bias = bias_->bias();
    return router_.route(ex, {.logits = row_view<const R, space>(logits),
                              .expert_bias = bias,
                              .indices = ctx.indices_.view().first(n),
                              .probs = ctx.probs_.view().first(n)});
  }

  // A byte buffer's bytes, and one of at least `bytes` (reallocated only to grow).
  static std::span<std::byte> bytes_of(const buffer<std::byte>& b) noexcept {
    return {b.view().data(), static_cast<std::size_t>(b.view().width())};
  }
  static status ensure(Exec& x, buffer<std::byte>& b, std::size_t bytes) {
    if (b.view().data() != nullptr && static_cast<std::size_t>(b.view().width()) >= bytes)
      return {};
    auto m =
        buffer<std::byte>::make(x, 1, static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1)));
    if (!m) return unexpected<error>(m.error());
    b = std::move(*m);
    return {};
  }
  template <class U>
  static status zero(Exec& x, row_view<U, space> v) {
    return v.empty() ? status{} : x.template fill<U>(v, U(0));
  }

  // A forward that failed after its dispatch leaves no handle behind.
  static unexpected<error> fail(context_type& ctx, const status& st) {
    ctx.handle_.reset();
    return unexpected<error>(st.error());
  }
  // The end of a backward: the context's views are released whatever the outcome; a retained
  // forward stays filled after a backward that succeeded (recompute() may refill it).
  static status done(context_type& ctx, status st,
                     moe_context_after after = moe_context_after::consumed) {
    ctx.drop_activations();
    ctx.filled_ = after == moe_context_after::retained && st.has_value();
    return st;
  }

  moe_layer_options o_;
  communicators_type* comms_ = nullptr;  // the bundle given to make (outlives the layer)
  Router router_;
  Policy policy_;
  Dispatcher disp_;
  Experts experts_;
  std::optional<shared_type> shared_;
  // The router weight [E, H] and its gradient: views of the own buffers or of the caller's.
  buffer<T> own_w_;
  buffer<grad_type> own_dw_;
  row_view<T, space> w_{};
  row_view<grad_type, space> dw_{};
  // The one-in-flight form's context and storage.
  context_type own_ctx_{};
  buffer<std::byte> own_saved_;
  std::vector<std::byte> own_host_;
  using load_balancing_type = load_balancing_losses<R, Exec>;
  using z_loss_type = router_z_loss<R, Exec>;
  load_balancing_type lb_{};
  z_loss_type z_{};
  std::optional<moefold::expert_bias<Exec>> bias_{};
  bool training_ = true;
  // The receive bound (the experts' rows a dispatch may give outside pad mode), the policy's
  // largest padding (pad mode's capacity; unset when it does not pad or states none) and the most
  // rows the experts may receive (the contexts' scratch is sized for it), the drop policy's
  // workspace for max_tokens, the drop decisions' sticky fault words [1, 3].
  int recv_rows_ = 0;
  std::optional<int> pad_bound_{};
  int rows_bound_ = 0;
  std::size_t drop_ws_bytes_ = 0;
  buffer<int> faults_;
  gating_type gating_{};
};

}  // namespace v0_1
}  // namespace moefold
