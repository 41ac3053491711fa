//! @file simt_moe_layer.hpp
//! @brief One MoE layer on an execution context that runs kernels (cpu_exec in CI, under the
//! sanitizers; cuda_kernel_exec on a GPU): the router (simt_router: gating GEMM, fused top-k),
//! the micro-batch load-balancing loss and the z-loss as device values (kernels/router_aux_loss,
//! kernels/router_z_loss), the dispatcher on the context (either of moefold's), the experts on
//! the context (simt_mlp, or any functor of its shape) and the combine, forward and backward,
//! dropless. Every tensor lives in the context's memory; the host sees the counts the
//! dispatcher needs for its collectives and the experts' row ranges, nothing else (no loss value
//! is read back: the stats are views the caller reads when it wants them).
//!
//! It computes what moe_layer computes on the host for the same options (tested over folds of
//! the thread world against moe_layer and the fp64 single-rank reference); what it does not take
//! yet is refused by make() with the rule named: a drop policy (pad mode), the per-sequence and
//! global load-balancing losses, the expert bias, a shared expert. One forward in flight: the
//! layer keeps the forward's activations in its own buffers until the backward.
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
#include <cmath>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if __has_include(<moefold/kernels/router_aux_loss.hpp>)
#include <moefold/kernels/router_aux_loss.hpp>
#include <moefold/kernels/router_z_loss.hpp>
#else
#include "../../../kernels/router_aux_loss.hpp"
#include "../../../kernels/router_z_loss.hpp"
#endif

#include "../comm/communicator.hpp"
#include "../core/dtype.hpp"
#include "../core/exec.hpp"
#include "../core/exec_buffer.hpp"
#include "../core/expected.hpp"
#include "../core/grouped_gemm_launch.hpp"
#include "../core/row_view.hpp"
#include "../dispatch/dispatch_args.hpp"
#include "../dispatch/exec_workspace.hpp"
#include "../experts/simt_mlp.hpp"
#include "../routing/simt_router.hpp"
#include "moe_layer.hpp"

namespace moefold {
inline namespace v0_1 {

//! Experts on a context: simt_mlp's forward and backward over a device_expert_batch with fp32
//! probabilities.
template <class E, class T, class S>
concept device_experts = requires(E& e, const device_expert_batch<T, float, S>& b,
                                  row_view<T, S> rows, row_view<const T, S> crows,
                                  row_view<float, S> probs) {
  { e.num_local_experts() } -> std::same_as<int>;
  { e.hidden() } -> std::same_as<int>;
  { e.forward(b, rows) } -> std::same_as<status>;
  { e.backward(b, crows, rows, probs) } -> std::same_as<status>;
};

//! The loss values of a forward, each a [1, 1] view in the context's memory (empty when the loss
//! is off or in evaluation): valid until the next forward.
template <class S>
struct simt_moe_forward_stats {
  row_view<const float, S> aux_loss{};  //!< this rank's part of the micro-batch loss
  row_view<const float, S> z_loss{};    //!< this rank's part of the z-loss
};

template <class T, execution_context Exec, class Comm, class Dispatcher, class Experts>
requires std::same_as<typename Dispatcher::value_type, T> &&
    std::same_as<typename Dispatcher::prob_type, float> &&
    std::same_as<typename Dispatcher::exec_type, Exec> &&
    device_experts<Experts, T, typename Exec::memory_space> &&
    communicator_for<Comm, Exec, double> && communicator_for<Comm, Exec, float>
class simt_moe_layer {
 public:
  using value_type = T;
  using space = typename Exec::memory_space;
  //! The router weight's gradient type (fp32 for fp32 and bf16 weights).
  using grad_type = main_grad_t<T>;
  using dispatcher_type = Dispatcher;
  using handle_type = typename Dispatcher::handle_type;

  //! Checks the options (what moe_layer checks, and what this layer does not take yet), makes
  //! the router and the dispatcher and allocates every buffer of one forward in flight. `exec`,
  //! the router weight and its gradient buffer must outlive the layer.
  [[nodiscard]] static expected<simt_moe_layer> make(Exec& exec, const moe_layer_options& o,
                                                     row_view<const T, space> router_weight,
                                                     row_view<grad_type, space> router_grad,
                                                     Experts experts) {
    using detail::to_decimal;
    const auto refuse = [](const std::string& what, errc code = errc::not_supported) {
      return unexpected<error>(make_error(code, "simt_moe_layer: " + what));
    };
    if (o.seq_aux_loss_coeff != 0 || o.global_aux_loss_coeff != 0)
      return refuse(
          "the per-sequence and global load-balancing losses do not run on a context yet "
          "(seq_aux_loss_coeff and global_aux_loss_coeff must be 0; moe_layer has them)");
    if (o.router.expert_bias)
      return refuse("the expert bias does not run on a context yet (moe_layer has it)");
    if (o.shared_expert.ffn != 0)
      return refuse("a shared expert does not run on a context yet (moe_layer has it)");
    if (!(std::isfinite(o.aux_loss_coeff) && o.aux_loss_coeff >= 0 &&
          std::isfinite(o.z_loss_coeff) && o.z_loss_coeff >= 0))
      return refuse("loss coefficients must be finite and >= 0 (0 turns one off)",
                    errc::invalid_argument);
    if (o.max_tokens < 1 || o.hidden < 1)
      return unexpected<error>(
          make_error(errc::invalid_size, "simt_moe_layer: max_tokens and hidden must be >= 1"));
    if (experts.hidden() != o.hidden || experts.num_local_experts() * o.ep != o.router.num_experts)
      return unexpected<error>(
          make_error(errc::shape_mismatch,
                     "simt_moe_layer: the experts hold " + to_decimal(experts.num_local_experts()) +
                         " local experts of hidden size " + to_decimal(experts.hidden()) +
                         "; the layer needs num_experts / ep = " +
                         to_decimal(o.ep > 0 ? o.router.num_experts / o.ep : 0) + " of size " +
                         to_decimal(o.hidden)));
    auto router =
        simt_router<T, Exec, grad_type>::make(exec, o.router, o.hidden, router_weight, router_grad);
    if (!router) return unexpected<error>(router.error());
    auto disp = Dispatcher::make(moe_dispatch_shape(o));
    if (!disp) return unexpected<error>(disp.error());
    simt_moe_layer l(exec, o, std::move(*router), std::move(*disp), std::move(experts));
    if (auto st = l.allocate(); !st) return unexpected<error>(st.error());
    return l;
  }

  [[nodiscard]] const moe_layer_options& options() const noexcept { return o_; }
  [[nodiscard]] Experts& experts() noexcept { return experts_; }
  [[nodiscard]] const Dispatcher& dispatcher() const noexcept { return disp_; }
  //! The last forward's routing (selected experts and probabilities [N, k]) and logits [N, E].
  [[nodiscard]] row_view<const int, space> last_indices() const noexcept {
    return indices_.cview().first(n_);
  }
  [[nodiscard]] row_view<const float, space> last_probs() const noexcept {
    return probs_.cview().first(n_);
  }
  [[nodiscard]] row_view<const float, space> last_logits() const noexcept {
    return logits_.cview().first(n_);
  }
  //! The last forward's dispatch (rows per local expert on the host, the batch's rows).
  [[nodiscard]] const handle_type* last_dispatch() const noexcept {
    return handle_ ? &*handle_ : nullptr;
  }

  //! Training (default): the forward computes the losses. Evaluation: it does not.
  void set_training(bool training) noexcept { training_ = training; }
  [[nodiscard]] bool training() const noexcept { return training_; }

  //! out [N, H] for x [N, H]; keeps what the backward needs until it runs.
  [[nodiscard]] expected<simt_moe_forward_stats<space>> forward(row_view<const T, space> x,
                                                                const moe_layer_groups<Comm>& g,
                                                                row_view<T, space> out) {
    handle_.reset();
    n_ = 0;
    const int n = x.rows();
    if (n < 0 || n > o_.max_tokens || x.width() != o_.hidden || out.rows() != n ||
        out.width() != o_.hidden)
      return make_error(errc::shape_mismatch,
                        "simt_moe_layer: x and out must be [N, H] with N <= max_tokens = " +
                            detail::to_decimal(o_.max_tokens) +
                            ", H = " + detail::to_decimal(o_.hidden));
    // The input is kept for the router's weight gradient (the caller may reuse its buffer).
    const auto xs = input_.view().first(n);
    if (auto st = x_->copy(x, xs); !st) return unexpected<error>(st.error());
    if (auto st = router_.forward({.x = xs,
                                   .logits = logits_.view().first(n),
                                   .indices = indices_.view().first(n),
                                   .probs = probs_.view().first(n)});
        !st)
      return unexpected<error>(st.error());
    simt_moe_forward_stats<space> stats;
    aux_on_ = training_ && o_.aux_loss_coeff > 0;
    z_on_ = training_ && o_.z_loss_coeff > 0;
    if (aux_on_) {
      if (auto st = aux_forward(g.tp_cp, n); !st) return unexpected<error>(st.error());
      stats.aux_loss = aux_loss_.cview();
    }
    if (z_on_) {
      if (auto st = z_forward(g.tp_cp, n); !st) return unexpected<error>(st.error());
      stats.z_loss = z_loss_.cview();
    }
    const dispatch_input<T, space, float> din{.num_tokens = n,
                                              .x = xs,
                                              .expert = indices_.cview().first(n),
                                              .probs = probs_.cview().first(n)};
    auto h = disp_.dispatch(*x_, din, g.dispatch, ws_.view());
    if (!h) return unexpected<error>(h.error());
    const int M = h->num_rows();
    const auto y = rows_a_.view().first(M);
    if (auto st = experts_.forward(batch_of(*h), y); !st) return unexpected<error>(st.error());
    if (auto st = disp_.combine(*x_, *h, y, g.dispatch, out); !st)
      return unexpected<error>(st.error());
    handle_.emplace(std::move(*h));
    n_ = n;
    return stats;
  }

  //! dx [N, H] from dout [N, H] of the last forward, which it consumes; `loss_seed` is d(training
  //! loss) / d(each auxiliary loss). Adds the router weight's and the experts' gradients.
  [[nodiscard]] status backward(row_view<const T, space> dout, float loss_seed,
                                const moe_layer_groups<Comm>& g, row_view<T, space> dx) {
    if (!handle_)
      return make_error(errc::invalid_argument,
                        "simt_moe_layer: backward without a forward (or its backward already ran)");
    if (!std::isfinite(loss_seed))
      return make_error(errc::invalid_argument, "simt_moe_layer: the loss seed must be finite");
    const int n = n_;
    if (dout.rows() != n || dout.width() != o_.hidden || dx.rows() != n || dx.width() != o_.hidden)
      return make_error(errc::shape_mismatch,
                        "simt_moe_layer: dout and dx must be [N, H] = [" + detail::to_decimal(n) +
                            ", " + detail::to_decimal(o_.hidden) + "] (the forward's N)");
    const handle_type h = std::move(*handle_);
    handle_.reset();  // consumed, whatever the outcome
    const int M = h.num_rows();
    const auto dy = rows_a_.view().first(M), dx_rows = rows_b_.view().first(M);
    const auto dprob_rows = prob_rows_.view().first(M);
    // Experts' path: dout -> dy rows -> dx rows, dprob rows -> dx [N, H], dprobs [N, k].
    if (auto st = disp_.combine_backward(*x_, h, dout, g.dispatch, dy); !st) return st;
    if (auto st = experts_.backward(batch_of(h), dy, dx_rows, dprob_rows); !st) return st;
    if (auto st = disp_.dispatch_backward(*x_, h, dx_rows, dprob_rows, g.dispatch, dx,
                                          dprobs_.view().first(n));
        !st)
      return st;
    // Router's path: the Jacobian, the losses' gradients added to dlogits, the gating GEMM.
    const auto dlogits = dlogits_.view().first(n);
    if (auto st = router_.backward_logits({.logits = logits_.cview().first(n),
                                           .indices = indices_.cview().first(n),
                                           .dprobs = dprobs_.cview().first(n),
                                           .dlogits = dlogits});
        !st)
      return st;
    if (aux_on_)
      if (auto st = by_team([&]<class Team>() { return aux_backward<Team>(n, loss_seed); }); !st)
        return st;
    if (z_on_)
      if (auto st = by_team([&]<class Team>() { return z_backward<Team>(n, loss_seed); }); !st)
        return st;
    const auto dxr = dx_router_.view().first(n);
    if (auto st = router_.backward_gating(
            {.x = input_.cview().first(n), .dlogits = dlogits_.cview().first(n), .dx = dxr});
        !st)
      return st;
    return x_->template add_converted<T, float>(dx_router_.cview().first(n), dx);
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

 private:
  simt_moe_layer(Exec& x, const moe_layer_options& o, simt_router<T, Exec, grad_type> r,
                 Dispatcher d, Experts e)
      : x_(&x), o_(o), router_(std::move(r)), disp_(std::move(d)), experts_(std::move(e)) {}

  template <class U>
  using buffer = exec_buffer<U, Exec>;

  status allocate() {
    const long long N = o_.max_tokens, H = o_.hidden, E = o_.router.num_experts, K = o_.router.topk;
    // The experts' rows: the receive bound (by default every routed pair of the tp-ep group).
    const long long M = o_.max_recv_rows.value_or(detail::worst_recv_rows(disp_.shape()));
    const auto make = [&]<class U>(buffer<U>& b, long long rows, long long width) -> status {
      auto v = buffer<U>::make(*x_, rows, width);
      if (!v) return unexpected<error>(v.error());
      b = std::move(*v);
      return {};
    };
    for (status st :
         {make(input_, N, H), make(logits_, N, E), make(indices_, N, K), make(probs_, N, K),
          make(dprobs_, N, K), make(dlogits_, N, E), make(dx_router_, N, H),
          make(rows_a_, std::max(M, 1LL), H), make(rows_b_, std::max(M, 1LL), H),
          make(prob_rows_, std::max(M, 1LL), 1), make(scores_, N, E), make(map_, N, E),
          make(column_sums_, 1, E), make(counts_, 1, E), make(dscores_, 1, E),
          make(aux_loss_, 1, 1), make(lse_, 1, N), make(z_loss_, 1, 1), make(valid_, 1, 1)})
      if (!st) return st;
    auto ws = make_exec_workspace(*x_, disp_.workspace_sizes(std::nullopt));
    if (!ws) return unexpected<error>(ws.error());
    ws_ = std::move(*ws);
    return {};
  }

  device_expert_batch<T, float, space> batch_of(const handle_type& h) const {
    return {.counts = h.batch_counts(), .x = h.batch_rows(), .probs = h.batch_probs()};
  }

  // Runs f.template operator()<Team>() with the team the router's E takes: a warp per token up
  // to E = 256, a block per token above.
  template <class F>
  status by_team(F&& f) const {
    return o_.router.num_experts <= kernels::detail_router::warp_per_token::max_experts
               ? f.template operator()<kernels::detail_router::warp_per_token>()
               : f.template operator()<kernels::detail_router::block_per_token>();
  }
  template <class Team, class K>
  status per_token(const K& kernel, int n) const {
    const int per_block = Team::width == 32 ? K::block_threads / 32 : 1;
    return launch(*x_, capped_grid<Exec, K>(n, per_block), kernel);
  }

  // The micro-batch loss: scores and top-k map over all E, their column sums and counts, the
  // counts summed over tp-cp (on the context), the loss and d loss / d scores. T = N |tp-cp|.
  status aux_forward(Comm& tp_cp, int n) {
    const int E = o_.router.num_experts;
    if (auto st = by_team([&]<class Team>() {
          const kernels::basic_aux_scores_kernel<Team> k{
              .logits = logits_.view().data(),
              .padding = nullptr,
              .num_tokens = n,
              .num_experts = E,
              .topk = o_.router.topk,
              .score = static_cast<kernels::router_score>(static_cast<int>(o_.router.score)),
              .scores = scores_.view().data(),
              .map = map_.view().data()};
          return per_token<Team>(k, n);
        });
        !st)
      return st;
    const kernels::aux_column_sums_kernel sums{.scores = scores_.view().data(),
                                               .map = map_.view().data(),
                                               .rows = n,
                                               .columns = E,
                                               .sums = column_sums_.view().data(),
                                               .counts = counts_.view().data()};
    if (auto st =
            launch(*x_, launch_grid{.blocks = capped_blocks<Exec>(E, sums.block_threads)}, sums);
        !st)
      return st;
    if (tp_cp.size() > 1)
      if (auto st = tp_cp.all_reduce(*x_, counts_.view(), reduce_op::sum); !st) return st;
    const kernels::switch_loss_kernel loss{.column_sums = column_sums_.view().data(),
                                           .counts = counts_.view().data(),
                                           .columns = E,
                                           .total_tokens = static_cast<double>(n) * tp_cp.size(),
                                           .per_token = static_cast<double>(o_.router.topk),
                                           .topk = o_.router.topk,
                                           .num_experts = E,
                                           .coeff = o_.aux_loss_coeff,
                                           .divide_by = 1.0,
                                           .running = nullptr,
                                           .steps = 0,
                                           .used = nullptr,
                                           .loss = aux_loss_.view().data(),
                                           .dscores = dscores_.view().data()};
    return launch(*x_, launch_grid{.blocks = 1}, loss);
  }
  template <class Team>
  status aux_backward(int n, float seed) {
    const kernels::basic_aux_loss_backward_kernel<Team> k{
        .logits = logits_.view().data(),
        .padding = nullptr,
        .num_tokens = n,
        .num_experts = o_.router.num_experts,
        .score = static_cast<kernels::router_score>(static_cast<int>(o_.router.score)),
        .dscores = dscores_.view().data(),
        .columns = o_.router.num_experts,
        .seed = seed,
        .dlogits = dlogits_.view().data()};
    return per_token<Team>(k, n);
  }

  // The z-loss with the coefficient divided by |tp-cp| (the group's parts sum to its mean).
  float z_coeff(const Comm& tp_cp) const {
    return static_cast<float>(o_.z_loss_coeff / tp_cp.size());
  }
  status z_forward(Comm& tp_cp, int n) {
    z_coeff_ = z_coeff(tp_cp);
    if (auto st = by_team([&]<class Team>() {
          const kernels::basic_logsumexp_kernel<Team> k{.logits = logits_.view().data(),
                                                        .padding = nullptr,
                                                        .num_tokens = n,
                                                        .num_experts = o_.router.num_experts,
                                                        .lse = lse_.view().data()};
          return per_token<Team>(k, n);
        });
        !st)
      return st;
    const kernels::z_loss_total_kernel total{.lse = lse_.view().data(),
                                             .padding = nullptr,
                                             .num_tokens = n,
                                             .coeff = z_coeff_,
                                             .loss = z_loss_.view().data(),
                                             .valid = valid_.view().data()};
    return launch(*x_, launch_grid{.blocks = 1, .smem_bytes = total.smem_bytes}, total);
  }
  template <class Team>
  status z_backward(int n, float seed) {
    const kernels::basic_z_loss_backward_kernel<Team> k{.logits = logits_.view().data(),
                                                        .padding = nullptr,
                                                        .lse = lse_.view().data(),
                                                        .valid = valid_.view().data(),
                                                        .num_tokens = n,
                                                        .num_experts = o_.router.num_experts,
                                                        .coeff = z_coeff_,
                                                        .seed = seed,
                                                        .dlogits = dlogits_.view().data()};
    return per_token<Team>(k, n);
  }

  Exec* x_;
  moe_layer_options o_;
  simt_router<T, Exec, grad_type> router_;
  Dispatcher disp_;
  Experts experts_;
  bool training_ = true, aux_on_ = false, z_on_ = false;
  float z_coeff_ = 0;
  int n_ = 0;
  std::optional<handle_type> handle_{};
  // One forward's activations and the backward's scratch, in the context's memory.
  buffer<T> input_;                                          // [max_tokens, H] the forward's input
  buffer<float> logits_, probs_, dprobs_;                    // [N, E], [N, k], [N, k]
  buffer<int> indices_;                                      // [N, k]
  buffer<float> dlogits_, dx_router_;                        // [N, E], [N, H]
  buffer<T> rows_a_, rows_b_;                                // [M, H]: y then dy; dx rows
  buffer<float> prob_rows_;                                  // [M, 1] dprob rows
  buffer<float> scores_, column_sums_, dscores_, aux_loss_;  // [N, E], [1, E], [1, E], [1, 1]
  buffer<std::uint8_t> map_;                                 // [N, E]
  buffer<double> counts_;                                    // [1, E]
  buffer<float> lse_, z_loss_;                               // [1, N], [1, 1]
  buffer<int> valid_;                                        // [1, 1]
  exec_workspace<Exec> ws_{};
};

}  // namespace v0_1
}  // namespace moefold
