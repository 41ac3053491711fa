// layer_api over moefold's layer of one element type T on host_exec, its dispatcher chosen at run
// time (dispatcher_variant) and its drop policy too (drop_policy_variant): one layer type per T.
// Included by the units that instantiate it (layer_f32_f64.cpp, layer_bf16.cpp), none of which
// includes a torch header.
#pragma once

#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/dispatcher_variant.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/experts/mlp_experts.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "layer_api.hpp"

namespace moefold_torch {

template <class T>
class layer_impl final : public layer_api {
  using comm = moefold::exchange_communicator;
  using exec = moefold::host_exec;
  using R = moefold::accumulator_t<T>;  // the router's type: fp32 for bf16 and fp32, fp64 for fp64
  using G = moefold::main_grad_t<T>;    // gradients: fp32 for bf16
  using dispatcher = moefold::dispatcher_variant<moefold::all_to_all_dispatcher<T, comm, exec, R>,
                                                 moefold::all_gather_dispatcher<T, comm, exec, R>>;
  using experts = moefold::mlp_experts<T, exec, moefold::default_gemms<exec>, G, R>;
  using layer = moefold::moe_layer<T, exec, comm, moefold::drop_policy_variant, dispatcher, experts,
                                   moefold::topk_router<T, exec, R>>;
  using context = typename layer::context_type;

  // One forward in flight: its context and the storage its saved activations live in.
  struct slot {
    context ctx;
    std::vector<std::byte> saved, host;
  };

 public:
  static moefold::expected<std::unique_ptr<layer_api>> make(const layer_spec& spec,
                                                            layer_communicators comms) {
    // The object owns the communicators the layer holds by reference: made on the heap, never
    // moved afterwards.
    std::unique_ptr<layer_impl> self(new layer_impl(std::move(comms)));
    const auto& o = spec.options;
    if (o.router.num_experts < 1 || self->comms_.ep.size() < 1 ||
        o.router.num_experts % self->comms_.ep.size() != 0)
      return moefold::make_error(moefold::errc::invalid_argument,
                                 "num_experts must be a positive multiple of EP = " +
                                     std::to_string(self->comms_.ep.size()));
    self->shape_ = {.hidden = o.hidden,
                    .ffn = spec.ffn,
                    .num_local_experts = o.router.num_experts / self->comms_.ep.size(),
                    .etp = self->comms_.etp.size(),
                    .etp_rank = self->comms_.etp.rank(),
                    .act = spec.act};
    if (auto st = moefold::check_mlp_shape(self->shape_, "experts"); !st)
      return moefold::unexpected<moefold::error>(st.error());
    // Placeholders until the caller's first bind() (the layer needs buffers to be made).
    const moefold::mlp_param_sizes n = moefold::mlp_sizes(self->shape_);
    self->own_w_.resize(n.total());
    self->own_g_.resize(n.total());
    const std::span<T> w(self->own_w_);
    const std::span<G> g(self->own_g_);
    auto ex = experts::make(self->shape_, {w.first(n.fc1), w.subspan(n.fc1)},
                            {g.first(n.fc1), g.subspan(n.fc1)});
    if (!ex) return moefold::unexpected<moefold::error>(ex.error());
    auto l = layer::make(self->x_, o, self->comms_, spec.policy, std::move(*ex));
    if (!l) return moefold::unexpected<moefold::error>(l.error());
    self->layer_.emplace(std::move(*l));
    const moefold::moe_layer_param_sizes p = self->layer_->param_sizes();
    const param_counts& c = self->counts_ = {.router = p.router,
                                             .fc1 = n.fc1,
                                             .fc2 = n.fc2,
                                             .shared_fc1 = p.shared.fc1,
                                             .shared_fc2 = p.shared.fc2,
                                             .shared_gate = p.shared_gate};
    // Gradient placeholders for every parameter until the caller binds its own buffers (a
    // forward binds the weights alone): the experts' are own_g_, which they already point at
    // (never resized: a reallocation would leave them pointing at freed memory), the others'
    // own_rest_g_.
    self->own_rest_g_.assign(c.router + c.shared_fc1 + c.shared_fc2 + c.shared_gate, G(0));
    G* at = self->own_rest_g_.data();
    const auto next = [&](std::size_t k) -> void* {
      return k ? std::exchange(at, at + k) : nullptr;
    };
    self->grads_ = {.router = next(c.router),
                    .fc1 = self->own_g_.data(),
                    .fc2 = self->own_g_.data() + n.fc1,
                    .shared_fc1 = next(c.shared_fc1),
                    .shared_fc2 = next(c.shared_fc2),
                    .shared_gate = next(c.shared_gate)};
    return std::unique_ptr<layer_api>(std::move(self));
  }

  param_counts counts() const override { return counts_; }

  moefold::status bind(const param_pointers& w, const param_pointers& given) override {
    const bool weights_only = !given.router && !given.fc1 && !given.fc2 && !given.shared_fc1 &&
                              !given.shared_fc2 && !given.shared_gate;
    const param_pointers& g = weights_only ? grads_ : given;
    const auto missing = [](const param_pointers& p, const param_counts& n) -> const char* {
      if (!p.router) return "router";
      if (!p.fc1 || !p.fc2) return "experts";
      if ((n.shared_fc1 && !p.shared_fc1) || (n.shared_fc2 && !p.shared_fc2))
        return "shared expert";
      if (n.shared_gate && !p.shared_gate) return "shared expert gate";
      return nullptr;
    };
    if (const char* m = missing(w, counts_))
      return moefold::make_error(moefold::errc::invalid_argument,
                                 std::string("bind: no weight for the ") + m);
    if (const char* m = missing(g, counts_))
      return moefold::make_error(moefold::errc::invalid_argument,
                                 std::string("bind: no gradient buffer for the ") + m);
    const auto tw = [](void* p, std::size_t n) { return std::span<T>(static_cast<T*>(p), n); };
    const auto tg = [](void* p, std::size_t n) { return std::span<G>(static_cast<G*>(p), n); };
    const param_counts& n = counts_;
    typename layer::params_type p{.router_weight = tw(w.router, n.router),
                                  .router_grad = tg(g.router, n.router)};
    if (n.shared_fc1) {
      p.shared.mlp = {tw(w.shared_fc1, n.shared_fc1), tw(w.shared_fc2, n.shared_fc2)};
      p.shared.mlp_grad = {tg(g.shared_fc1, n.shared_fc1), tg(g.shared_fc2, n.shared_fc2)};
      if (n.shared_gate) {
        p.shared.gate = tw(w.shared_gate, n.shared_gate);
        p.shared.gate_grad = tg(g.shared_gate, n.shared_gate);
      }
    }
    if (auto st = layer_->bind_parameters(p); !st) return st;
    if (auto st =
            layer_->experts().bind(moefold::mlp_weights<T>{tw(w.fc1, n.fc1), tw(w.fc2, n.fc2)},
                                   moefold::mlp_grads<G>{tg(g.fc1, n.fc1), tg(g.fc2, n.fc2)});
        !st)
      return st;
    own_w_ = {};  // the weight placeholders are no longer read
    if (!weights_only) {
      grads_ = given;
      own_g_ = {};  // nor the gradient placeholders
      own_rest_g_ = {};
    }
    return {};
  }

  moefold::expected<int> forward(const void* x, int n, const std::int64_t* order_keys, void* out,
                                 bool keep, forward_values& v) override {
    const std::size_t elems = static_cast<std::size_t>(n) * static_cast<std::size_t>(hidden());
    const moefold::moe_forward_input<T> in{
        .num_tokens = n,
        .x = {static_cast<const T*>(x), elems},
        .order_keys = order_keys ? std::span<const std::int64_t>(order_keys, std::size_t(n))
                                 : std::span<const std::int64_t>()};
    const std::span<T> o(static_cast<T*>(out), elems);
    if (!keep) {  // evaluation or no gradient: the layer's own one-in-flight context
      auto st = layer_->forward(x_, n, in.x, in.order_keys, o);
      if (!st) return moefold::unexpected<moefold::error>(st.error());
      if (auto s = values_of(*st, layer_->last_dispatch(), v); !s)
        return moefold::unexpected<moefold::error>(s.error());
      return -1;
    }
    std::unique_ptr<slot> s = take_slot();
    auto st = layer_->forward(x_, in, o, s->ctx, storage_of(*s));
    if (!st) {
      give_back(std::move(s));
      return moefold::unexpected<moefold::error>(st.error());
    }
    if (auto e = values_of(*st, s->ctx.dispatch(), v); !e) {
      give_back(std::move(s));
      return moefold::unexpected<moefold::error>(e.error());
    }
    const std::lock_guard lock(slots_m_);
    const int id = next_id_++;
    held_.emplace(id, std::move(s));
    return id;
  }

  moefold::status drop_activations(int id) override {
    slot* found = held(id);
    if (!found) return unknown(id);
    slot& s = *found;
    s.ctx.drop_activations();
    s.saved = {};  // freed: the memory a checkpointed forward gives back until its recompute
    s.host = {};
    return {};
  }

  moefold::status recompute(int id, const void* x, int n, const std::int64_t* order_keys,
                            void* out) override {
    slot* s = held(id);
    if (!s) return unknown(id);
    if (n != s->ctx.num_tokens())
      return moefold::make_error(moefold::errc::invalid_argument,
                                 "recompute: x has " + std::to_string(n) + " tokens, forward " +
                                     std::to_string(id) + " had " +
                                     std::to_string(s->ctx.num_tokens()));
    size_storage(*s);
    const std::size_t elems = static_cast<std::size_t>(n) * static_cast<std::size_t>(hidden());
    const moefold::moe_forward_input<T> in{
        .num_tokens = n,
        .x = {static_cast<const T*>(x), elems},
        .order_keys = order_keys ? std::span<const std::int64_t>(order_keys, std::size_t(n))
                                 : std::span<const std::int64_t>()};
    return layer_->recompute(x_, s->ctx, in, std::span<T>(static_cast<T*>(out), elems),
                             storage_of(*s));
  }

  moefold::status backward(int id, const void* dout, int n, const std::array<double, 5>& seeds,
                           void* dx) override {
    slot* found = held(id);
    if (!found) return unknown(id);
    slot& s = *found;
    if (n != s.ctx.num_tokens())  // dout and dx are read and written as the forward's [n, H]
      return moefold::make_error(moefold::errc::invalid_argument,
                                 "backward: dout has " + std::to_string(n) + " tokens, forward " +
                                     std::to_string(id) + " had " +
                                     std::to_string(s.ctx.num_tokens()));
    const std::size_t elems =
        static_cast<std::size_t>(s.ctx.num_tokens()) * static_cast<std::size_t>(hidden());
    const moefold::moe_loss_seeds<R> sd{.output = static_cast<R>(seeds[0]),
                                        .aux = static_cast<R>(seeds[1]),
                                        .seq_aux = static_cast<R>(seeds[2]),
                                        .global_aux = static_cast<R>(seeds[3]),
                                        .z = static_cast<R>(seeds[4])};
    // Retained: the forward stays until release() (autograd frees its node), so a second backward
    // of it (retain_graph) recomputes and runs again with the same bits.
    return layer_->backward(x_, s.ctx, std::span<const T>(static_cast<const T*>(dout), elems), sd,
                            std::span<T>(static_cast<T*>(dx), elems),
                            moefold::moe_context_after::retained);
  }

  void release(int id) noexcept override {
    // Its context keeps the buffers its first forward allocated: the next forward reuses them.
    const std::lock_guard lock(slots_m_);
    auto it = held_.find(id);
    if (it == held_.end()) return;
    free_.push_back(std::move(it->second));
    held_.erase(it);
  }
  int in_flight() const noexcept override {
    const std::lock_guard lock(slots_m_);
    return static_cast<int>(held_.size());
  }
  bool ready(int id) const noexcept override {
    const slot* s = held(id);
    return s && s->ctx.ready();
  }

  moefold::status reduce_gradients() override { return layer_->reduce_gradients(x_); }
  moefold::status end_global_batch() override { return layer_->end_global_batch(x_); }
  void set_training(bool training) noexcept override { layer_->set_training(training); }
  moefold::expected<moefold::moe_layer_state> save_state() override {
    return layer_->save_state(x_);
  }
  moefold::status load_state(const moefold::moe_layer_state& s) override {
    return layer_->load_state(x_, s);
  }
  const moefold::moe_layer_options& options() const noexcept override { return layer_->options(); }

 private:
  explicit layer_impl(layer_communicators&& c) : comms_(std::move(c)) {}

  int hidden() const noexcept { return layer_->options().hidden; }

  static moefold::status unknown(int id) {
    return moefold::make_error(moefold::errc::invalid_argument,
                               "no forward in flight has id " + std::to_string(id) +
                                   " (its backward already ran, or it was released)");
  }

  // The slots' bookkeeping (held_, free_, next_id_) is locked: Python's garbage collector may
  // release a forward from any thread, also while this layer's thread runs a forward without the
  // GIL. Only the bookkeeping: a forward's collectives never run under the lock.
  slot* held(int id) const {
    const std::lock_guard lock(slots_m_);
    auto it = held_.find(id);
    return it == held_.end() ? nullptr : it->second.get();
  }
  void give_back(std::unique_ptr<slot> s) {
    const std::lock_guard lock(slots_m_);
    free_.push_back(std::move(s));
  }
  // A slot from the pool (a new one when none is free), its storage sized for every forward.
  std::unique_ptr<slot> take_slot() {
    std::unique_ptr<slot> s;
    {
      const std::lock_guard lock(slots_m_);
      if (!free_.empty()) {
        s = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!s) s = std::make_unique<slot>();
    size_storage(*s);
    return s;
  }
  void size_storage(slot& s) const {
    const moefold::moe_saved_bytes b = layer_->saved_sizes();
    if (s.saved.size() < b.saved) s.saved.resize(b.saved);
    if (s.host.size() < b.host) s.host.resize(b.host);
  }
  static moefold::moe_saved_storage storage_of(slot& s) { return {s.saved, s.host}; }

  template <class Handle>
  moefold::status values_of(const typename layer::stats_type& st, const Handle& h,
                            forward_values& v) {
    auto r = moefold::read_forward_stats(x_, st);
    if (!r) return moefold::unexpected<moefold::error>(r.error());
    v.losses = {r->aux_loss, r->seq_aux_loss, r->global_aux_loss, r->z_loss};
    const auto& d = r->dropped;
    v.routed.assign(d.routed.begin(), d.routed.end());
    v.kept.resize(d.routed.size());
    for (std::size_t e = 0; e < d.routed.size(); ++e) v.kept[e] = d.routed[e] - d.dropped[e];
    v.dropped_pairs = d.dropped_pairs;
    const auto c = h.batch_counts();
    v.rows_per_local_expert.assign(c.begin(), c.end());
    return {};
  }

  layer_communicators comms_;
  exec x_{};
  moefold::mlp_shape shape_{};
  std::vector<T> own_w_;
  std::vector<G> own_g_, own_rest_g_;
  std::optional<layer> layer_;
  param_counts counts_{};
  param_pointers grads_{};  // the gradient buffers bound last (placeholders at first)
  mutable std::mutex slots_m_;
  std::map<int, std::unique_ptr<slot>> held_;
  std::vector<std::unique_ptr<slot>> free_;
  int next_id_ = 0;
};

}  // namespace moefold_torch
