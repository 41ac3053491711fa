// The MoE layer over user types, written from the concepts' documentation alone:
//  - a user router (routing::router) that assigns fixed experts and probabilities whatever the
//    logits, on EP 2, against the fp64 reference of dispatch_harness.hpp fed that assignment
//    (outputs, input gradients, expert gradients; the router weight gets no gradient);
//  - a user dispatcher (token_dispatcher) for one rank that sorts the kept pairs by expert in its
//    own workspace, against the same layer with all_to_all_dispatcher, dropless and dropping;
//  - both built-in dispatchers satisfy the concept, and the rules a user router must keep are
//    errors at make().
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/dispatch/token_dispatcher.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "../dispatch/dispatch_harness.hpp"
#include "fixed_router.hpp"

using namespace moefold;
using namespace moefold::test;

static_assert(
    token_dispatcher<all_to_all_dispatcher<float, thread_communicator>, thread_communicator>);
static_assert(
    token_dispatcher<all_gather_dispatcher<double, thread_communicator>, thread_communicator>);
static_assert(!token_dispatcher<reference_mlp<float>, thread_communicator>);

namespace {

// The user router of fixed_router.hpp (a kernel body: on host_exec a loop).
static_assert(routing::router<fixed_router<double>, host_exec>);

// A dispatcher for a single rank (EP = ETP = 1): the kept pairs, sorted by expert (token order
// within one), become the rows; a token's rows are summed back in slot order.
template <class T, class Comm>
class local_dispatcher {
 public:
  using value_type = T;
  using prob_type = T;  // the probabilities travel as T
  using exec_type = host_exec;

  class handle_type {
   public:
    [[nodiscard]] expert_batch<T> batch() const {
      const int m = static_cast<int>(p_.size());
      return {.counts = counts_,
              .x = row_view<const T>(x_.data(), m, hidden_),
              .probs = row_view<const T>(p_.data(), m, 1)};
    }
    [[nodiscard]] int num_rows() const { return static_cast<int>(p_.size()); }

   private:
    friend local_dispatcher;
    const local_dispatcher* owner_ = nullptr;
    int hidden_ = 0, tokens_ = 0, k_ = 0;
    std::span<const int> counts_, row_of_, token_of_;  // [E], [N*k] (-1: dropped), [M]
    std::span<const T> x_, p_;                         // [M, H], [M]
  };

  [[nodiscard]] static expected<local_dispatcher> make(const dispatch_shape& s) {
    if (s.ep != 1 || s.etp != 1)
      return make_error(errc::invalid_argument, "local_dispatcher: one rank (EP = ETP = 1) only");
    local_dispatcher d;
    d.s_ = s;
    return d;
  }
  [[nodiscard]] const dispatch_shape& shape() const { return s_; }
  [[nodiscard]] dispatch_workspace_bytes workspace_sizes(std::optional<int>) const {
    workspace_carver c;
    (void)carve(c);
    return {c.required(), 0, 0};
  }

  [[nodiscard]] expected<handle_type> dispatch(host_exec&,
                                               const dispatch_input<T, host_space, T>& v,
                                               const dispatch_groups<Comm>&,
                                               const dispatch_workspace& ws) {
    const int N = v.num_tokens, K = s_.topk, H = s_.hidden, E = s_.num_experts;
    if (v.capacity) return make_error(errc::invalid_argument, "local_dispatcher: no pad mode");
    const auto pairs = static_cast<std::size_t>(N) * static_cast<std::size_t>(K);
    if (N < 0 || N > s_.max_tokens || v.x.rows() != N || v.x.width() != H || !v.x.contiguous() ||
        v.expert.rows() != N || v.expert.width() != K || !v.expert.contiguous() ||
        v.probs.rows() != N || v.probs.width() != K || !v.probs.contiguous())
      return make_error(errc::shape_mismatch, "local_dispatcher: x [N, H], expert/probs [N, k]");
    const struct {
      std::span<const T> x;
      std::span<const int> expert;
      std::span<const T> probs;
    } in{v.x.flat(), v.expert.flat(), v.probs.flat()};
    for (int e : in.expert)
      if (e < -1 || e >= E)
        return make_error(errc::invalid_argument, "local_dispatcher: expert outside [-1, E)");
    workspace_carver c(ws.saved);
    bufs b = carve(c);
    if (!c.fits()) return make_error(errc::workspace_too_small, "local_dispatcher: workspace");
    std::fill(b.counts.begin(), b.counts.end(), 0);
    for (int e : in.expert)
      if (e >= 0) ++b.counts[static_cast<std::size_t>(e)];
    std::vector<int> next(static_cast<std::size_t>(E), 0);  // first row of each expert
    for (int e = 1; e < E; ++e)
      next[static_cast<std::size_t>(e)] =
          next[static_cast<std::size_t>(e - 1)] + b.counts[static_cast<std::size_t>(e - 1)];
    int m = 0;
    for (std::size_t i = 0; i < pairs; ++i) {
      const int e = in.expert[i];
      b.row_of[i] = -1;
      if (e < 0) continue;
      const int r = next[static_cast<std::size_t>(e)]++;
      b.row_of[i] = r;
      const std::size_t t = i / static_cast<std::size_t>(K);
      b.token_of[static_cast<std::size_t>(r)] = static_cast<int>(t);
      for (int h = 0; h < H; ++h) b.x[static_cast<std::size_t>(r) * H + h] = in.x[t * H + h];
      b.p[static_cast<std::size_t>(r)] = in.probs[i];
      ++m;
    }
    handle_type hd;
    hd.owner_ = this;
    hd.hidden_ = H;
    hd.tokens_ = N;
    hd.k_ = K;
    hd.counts_ = b.counts;
    hd.row_of_ = b.row_of.first(pairs);
    hd.token_of_ = b.token_of.first(static_cast<std::size_t>(m));
    hd.x_ = b.x.first(static_cast<std::size_t>(m) * H);
    hd.p_ = b.p.first(static_cast<std::size_t>(m));
    return hd;
  }
  // The rows [M, H] and the tokens [N, H] are read and written row by row through their stride:
  // the layer's rows start 16 bytes apart (H padded up), and the concept asks nothing more of a
  // view than its shape.
  [[nodiscard]] status combine(host_exec&, handle_type& h, row_view<const T> y,
                               const dispatch_groups<Comm>&, row_view<T> out) const {
    if (auto st = check(h, y, out); !st) return st;
    sum_rows(h, y, out);
    return {};
  }
  [[nodiscard]] status combine_backward(host_exec&, const handle_type& h, row_view<const T> dout,
                                        const dispatch_groups<Comm>&, row_view<T> dy) const {
    if (auto st = check(h, dy, dout); !st) return st;
    for (int r = 0; r < dy.rows(); ++r)
      for (int c = 0; c < h.hidden_; ++c)
        dy(r, c) = dout(h.token_of_[static_cast<std::size_t>(r)], c);
    return {};
  }
  [[nodiscard]] status dispatch_backward(host_exec&, const handle_type& h,
                                         row_view<const T> dx_rows, row_view<const T> dprob_rows,
                                         const dispatch_groups<Comm>&, row_view<T> dx,
                                         row_view<T> dprobs) const {
    if (auto st = check(h, dx_rows, dx); !st) return st;
    if (dprob_rows.rows() != h.num_rows() || dprob_rows.width() != 1 ||
        dprobs.rows() != h.tokens_ || dprobs.width() != h.k_)
      return make_error(errc::shape_mismatch, "local_dispatcher: dprob rows [M], dprobs [N, k]");
    sum_rows(h, dx_rows, dx);
    for (int t = 0; t < h.tokens_; ++t)
      for (int j = 0; j < h.k_; ++j) {
        const int r = h.row_of_[static_cast<std::size_t>(t * h.k_ + j)];
        dprobs(t, j) = r < 0 ? T(0) : dprob_rows(r, 0);
      }
    return {};
  }

 private:
  struct bufs {
    std::span<int> counts, row_of, token_of;
    std::span<T> x, p;
  };
  bufs carve(workspace_carver& c) const {
    const auto P = static_cast<std::size_t>(s_.max_tokens) * static_cast<std::size_t>(s_.topk);
    return {c.take<int>(static_cast<std::size_t>(s_.num_experts)), c.take<int>(P), c.take<int>(P),
            c.take<T>(P * static_cast<std::size_t>(s_.hidden)), c.take<T>(P)};
  }
  [[nodiscard]] status check(const handle_type& h, row_view<const T> rows,
                             row_view<const T> tokens) const {
    if (h.owner_ != this)
      return make_error(errc::invalid_argument, "local_dispatcher: a handle of another dispatcher");
    if (rows.rows() != h.num_rows() || rows.width() != h.hidden_ || tokens.rows() != h.tokens_ ||
        tokens.width() != h.hidden_)
      return make_error(errc::shape_mismatch, "local_dispatcher: rows [M, H], tokens [N, H]");
    return {};
  }
  // out[t] = the sum of token t's rows, in slot order.
  static void sum_rows(const handle_type& h, row_view<const T> rows, row_view<T> out) {
    for (int t = 0; t < h.tokens_; ++t) {
      for (int c = 0; c < h.hidden_; ++c) out(t, c) = T(0);
      for (int j = 0; j < h.k_; ++j) {
        const int r = h.row_of_[static_cast<std::size_t>(t * h.k_ + j)];
        if (r < 0) continue;
        for (int c = 0; c < h.hidden_; ++c) out(t, c) += rows(r, c);
      }
    }
  }

  dispatch_shape s_{};
};
static_assert(token_dispatcher<local_dispatcher<float, thread_communicator>, thread_communicator>);

struct run_out {
  std::vector<double> out, dx, router_grad, w1, w2;
};

using layer_comms = moe_layer_communicators<thread_communicator>;

// One rank's forward and backward with the layer `make_layer(exec, communicators, experts)`
// makes.
template <class Layer, class Make>
expected<run_out> run_rank(const problem& p, thread_communicator& world, const Make& make_layer) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int r = world.rank();
  host_exec hx;
  // The layer holds the bundle by reference: it lives (unmoved) until the layer is gone.
  auto comms = make_layer_communicators(world, groups);
  if (!comms) return unexpected<error>(comms.error());
  const data w = make_weights(p);
  auto layer = make_layer(hx, *comms, rank_experts<double>(p, fold, r, w.w1, w.w2).value());
  if (!layer) return unexpected<error>(layer.error());
  for (std::size_t i = 0; i < layer->router_weight().flat().size(); ++i)
    layer->router_weight().flat()[i] = unit(9, static_cast<std::uint64_t>(i), 0);
  std::vector<double> x, dout;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    x.insert(x.end(), d.x.begin(), d.x.end());
    dout.insert(dout.end(), d.dout.begin(), d.dout.end());
  }
  run_out res;
  res.out.resize(x.size());
  res.dx.resize(x.size());
  if (auto f = layer->forward(hx, p.tokens, x, {}, res.out); !f)
    return unexpected<error>(f.error());
  if (auto b = layer->backward(hx, dout, 1.0, res.dx); !b) return unexpected<error>(b.error());
  auto take = [](std::span<double> v) { return std::vector<double>(v.begin(), v.end()); };
  res.router_grad = take(layer->router_weight_grad().flat());
  res.w1 = take(layer->experts().grads_fc1());
  res.w2 = take(layer->experts().grads_fc2());
  return res;
}

template <class Layer, class Make>
std::vector<run_out> run_world(const problem& p, const Make& make_layer) {
  std::vector<run_out> res(static_cast<std::size_t>(p.fold.world));
  const auto st = run_thread_world(p.fold.world, [&](thread_communicator& world) -> status {
    auto r = run_rank<Layer>(p, world, make_layer);
    if (!r) return unexpected<error>(r.error());
    res[static_cast<std::size_t>(world.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

}  // namespace

TEST_CASE("MoE layer with a user router: fixed experts against the fp64 reference") {
  problem p{.fold = {.world = 2, .ep = 2, .etp = 1}, .experts = 4, .topk = 2};
  p.tokens = 6;
  using layer_t = moe_layer<double, host_exec, thread_communicator, dropless,
                            all_to_all_dispatcher<double, thread_communicator>,
                            reference_mlp<double>, fixed_router<double>>;
  const moe_layer_options o{.hidden = p.hidden,
                            .max_tokens = p.tokens,
                            .ep = 2,
                            .router = {.num_experts = p.experts, .topk = p.topk}};
  const fixed_router<double> router{.experts = p.experts, .k = p.topk};
  const auto res =
      run_world<layer_t>(p, [&](host_exec& hx, layer_comms& comms, reference_mlp<double> mlp) {
        return layer_t::make(hx, o, comms, dropless{}, std::move(mlp), router);
      });
  // The reference, fed the router's assignment.
  const fixed_reference ref = fixed_assignment_reference(p, 2);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    const auto& got = res[i];
    CHECK(rel_err(got.out, ref.out[i]) <= 1e-12);
    CHECK(rel_err(got.dx, ref.dx[i]) <= 1e-12);  // no router part: the logits are ignored
    CHECK(got.router_grad == std::vector<double>(got.router_grad.size(), 0.0));
    CHECK(rel_err(got.w1, ref.dw1[i]) <= 1e-12);  // each rank's experts saw both ranks' tokens
    CHECK(rel_err(got.w2, ref.dw2[i]) <= 1e-12);
  }
}

TEST_CASE("MoE layer with a user dispatcher equals the built-in one") {
  problem p{.fold = {.world = 1}, .experts = 4, .topk = 2};
  p.tokens = 8;
  const moe_layer_options o{.hidden = p.hidden,
                            .max_tokens = p.tokens,
                            .router = {.num_experts = p.experts, .topk = p.topk},
                            .aux_loss_coeff = 0.01,
                            .z_loss_coeff = 0.001};
  for (double cap : {0.0, 0.5}) {
    CAPTURE(cap);
    const sub_sequence policy{.capacity_factor = cap > 0 ? cap : 100.0};
    using user_t = moe_layer<double, host_exec, thread_communicator, sub_sequence,
                             local_dispatcher<double, thread_communicator>, reference_mlp<double>>;
    using builtin_t =
        moe_layer<double, host_exec, thread_communicator, sub_sequence,
                  all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
    const auto a =
        run_world<user_t>(p, [&](host_exec& hx, layer_comms& comms, reference_mlp<double> mlp) {
          return user_t::make(hx, o, comms, policy, std::move(mlp));
        });
    const auto b =
        run_world<builtin_t>(p, [&](host_exec& hx, layer_comms& comms, reference_mlp<double> mlp) {
          return builtin_t::make(hx, o, comms, policy, std::move(mlp));
        });
    CHECK(rel_err(a[0].out, b[0].out) <= 1e-13);
    CHECK(rel_err(a[0].dx, b[0].dx) <= 1e-13);
    CHECK(rel_err(a[0].router_grad, b[0].router_grad) <= 1e-13);
    CHECK(rel_err(a[0].w1, b[0].w1) <= 1e-13);
    CHECK(rel_err(a[0].w2, b[0].w2) <= 1e-13);
    CHECK(a[0].out != std::vector<double>(a[0].out.size(), 0.0));
  }
}

TEST_CASE("MoE layer with a user router: the rules it must keep are errors at make()") {
  problem p{.fold = {.world = 1}, .experts = 4, .topk = 2};
  using layer_t = moe_layer<double, host_exec, thread_communicator, dropless,
                            all_to_all_dispatcher<double, thread_communicator>,
                            reference_mlp<double>, fixed_router<double>>;
  const fold_config f{.world = 1};
  const auto fold = make_folded(f).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  moe_layer_options o{
      .hidden = p.hidden, .max_tokens = 4, .router = {.num_experts = p.experts, .topk = p.topk}};
  auto experts = [&] { return rank_experts<double>(p, fold, 0, w.w1, w.w2).value(); };
  // make() takes the communicators, which a world of one rank gives; each make's outcome (a
  // made layer is dropped with its communicators) is checked on the test's thread.
  status wrong_k, bias, fine;
  const auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
    host_exec hx;
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    const auto outcome = [&](const fixed_router<double>& router) -> status {
      auto l = layer_t::make(hx, o, *comms, dropless{}, experts(), router);
      if (!l) return unexpected<error>(l.error());
      return {};
    };
    wrong_k = outcome(fixed_router<double>{.experts = 4, .k = 3});
    o.router.expert_bias = true;
    bias = outcome(fixed_router<double>{.experts = 4, .k = 2});
    o.router.expert_bias = false;
    fine = outcome(fixed_router<double>{.experts = 4, .k = 2});
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  REQUIRE(!wrong_k);
  CHECK(wrong_k.error().code == errc::shape_mismatch);
  CHECK(wrong_k.error().message.find("selects 3 of 4") != std::string::npos);
  REQUIRE(!bias);
  CHECK(bias.error().message.find("expert_bias needs moefold's topk_router") != std::string::npos);
  CHECK(fine.has_value());
}

TEST_CASE("MoE layer communicators: one named bundle from a world and a fold runs the layer") {
  // EP 2 x ETP 2 x EDP 2 over TP 2 on 8 ranks with a shared expert: the bundle's groups have the
  // sizes and rank orders of megatron_groups, and the layer made from it (EP, ETP, TP and the TP
  // position taken from it) equals the one made with them spelled out in its options over a
  // bundle filled by hand, one group_communicator per member (the layer takes its groups only
  // from a bundle now, so the positional communicators the reduction once took are these).
  problem p{.fold = {.world = 8, .tp = 2, .ep = 2, .etp = 2}, .experts = 4, .topk = 2};
  p.ffn = 4;
  p.tokens = 4;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  using layer_t =
      moe_layer<double, host_exec, thread_communicator, dropless,
                all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
  struct both {
    run_out bundle, spelled;
    std::vector<std::string> errors;
  };
  std::vector<both> res(8);
  const auto st = run_thread_world(8, [&](thread_communicator& world) -> status {
    const int r = world.rank();
    host_exec hx;
    // Each layer holds its bundle by reference: both bundles outlive the layers, unmoved.
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    const std::pair<thread_communicator*, group_kind> named[] = {
        {&comms->tp, group_kind::tp},
        {&comms->tp_cp, group_kind::tp_cp},
        {&comms->tp_dp_cp, group_kind::tp_dp_cp},
        {&comms->dp_cp, group_kind::dp_cp},
        {&comms->ep, group_kind::ep},
        {&comms->etp, group_kind::etp},
        {&comms->tp_ep, group_kind::tp_ep},
        {&comms->edp, group_kind::edp}};
    for (auto [c, k] : named) {
      const auto at = groups(k).find(r);
      CHECK(c->rank() == at.position);
      CHECK(c->size() == groups(k)[at.group].size());
    }
    const moe_layer_options base{.hidden = p.hidden,
                                 .max_tokens = p.tokens,
                                 .router = {.num_experts = p.experts, .topk = p.topk},
                                 .aux_loss_coeff = 0.01,
                                 .shared_expert = {.ffn = 4, .gate = true}};
    auto& out = res[static_cast<std::size_t>(r)];
    auto run = [&](layer_t& layer, auto&& reduce) -> expected<run_out> {
      for (std::size_t i = 0; i < layer.router_weight().flat().size(); ++i)
        layer.router_weight().flat()[i] = unit(9, static_cast<std::uint64_t>(i), 0);
      auto* se = layer.shared();
      for (std::size_t i = 0; i < se->own().gate.flat().size(); ++i)
        se->own().gate.flat()[i] = unit(10, i, 0);
      std::vector<double> s1, s2;  // [H, 2F] [gate | up], [F, H]; load_full's layout below
      for (int i = 0; i < p.hidden * 2 * 4; ++i) s1.push_back(0.5 * unit(11, 0, i));
      for (int i = 0; i < 4 * p.hidden; ++i) s2.push_back(0.5 * unit(12, 0, i));
      if (auto s = se->load_full(megatron_fc1_from_columns(s1, p.hidden, 2, 4),
                                 megatron_fc2_from_rows(s2, 4, p.hidden));
          !s)
        return unexpected<error>(s.error());
      std::vector<double> x, dout;
      for (int t = 0; t < p.tokens; ++t) {
        const auto d = make_token(p, r, t);
        x.insert(x.end(), d.x.begin(), d.x.end());
        dout.insert(dout.end(), d.dout.begin(), d.dout.end());
      }
      run_out ro;
      ro.out.resize(x.size());
      ro.dx.resize(x.size());
      if (auto f = layer.forward(hx, p.tokens, x, {}, ro.out); !f)
        return unexpected<error>(f.error());
      if (auto b = layer.backward(hx, dout, 1.0, ro.dx); !b) return unexpected<error>(b.error());
      if (auto s = reduce(); !s) return unexpected<error>(s.error());
      auto take = [](std::span<double> v) { return std::vector<double>(v.begin(), v.end()); };
      ro.router_grad = take(layer.router_weight_grad().flat());
      ro.w1 = take(layer.experts().grads_fc1());
      ro.w2 = take(layer.experts().grads_fc2());
      ro.w1.insert(ro.w1.end(), se->params().grads.fc1.flat().begin(),
                   se->params().grads.fc1.flat().end());
      ro.w2.insert(ro.w2.end(), se->params().gate_grad.flat().begin(),
                   se->params().gate_grad.flat().end());
      return ro;
    };
    {
      auto layer = layer_t::make(hx, base, *comms, dropless{},
                                 rank_experts<double>(p, fold, r, w.w1, w.w2).value());
      if (!layer) return unexpected<error>(layer.error());
      auto ro = run(*layer, [&] {
        return layer->reduce_gradients(
            hx, {layer->experts().grads_fc1(), layer->experts().grads_fc2()});
      });
      if (!ro) return unexpected<error>(ro.error());
      out.bundle = std::move(*ro);
    }
    {
      moe_layer_options o = base;
      o.ep = fold.ep();
      o.etp = fold.etp();
      o.shared_expert.tp = fold.tp();
      o.shared_expert.tp_rank = groups(group_kind::tp).find(r).position;
      auto get = [&](group_kind k) { return group_communicator(world, groups, {k}).value(); };
      moe_layer_communicators<thread_communicator> by_hand{.tp = get(group_kind::tp),
                                                           .tp_cp = get(group_kind::tp_cp),
                                                           .tp_dp_cp = get(group_kind::tp_dp_cp),
                                                           .dp_cp = get(group_kind::dp_cp),
                                                           .ep = get(group_kind::ep),
                                                           .etp = get(group_kind::etp),
                                                           .tp_ep = get(group_kind::tp_ep),
                                                           .edp = get(group_kind::edp)};
      auto layer = layer_t::make(hx, o, by_hand, dropless{},
                                 rank_experts<double>(p, fold, r, w.w1, w.w2).value());
      if (!layer) return unexpected<error>(layer.error());
      auto ro = run(*layer, [&] {
        return layer->reduce_gradients(
            hx, {layer->experts().grads_fc1(), layer->experts().grads_fc2()});
      });
      if (!ro) return unexpected<error>(ro.error());
      out.spelled = std::move(*ro);
    }
    moe_layer_options wrong = base;
    wrong.ep = 4;
    const auto e = layer_t::options_for(wrong, *comms);
    out.errors.push_back(e ? "ok" : e.error().message);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  for (const auto& b : res) {
    CHECK(b.bundle.out == b.spelled.out);
    CHECK(b.bundle.dx == b.spelled.dx);
    CHECK(b.bundle.router_grad == b.spelled.router_grad);
    CHECK(b.bundle.w1 == b.spelled.w1);
    CHECK(b.bundle.w2 == b.spelled.w2);
    CHECK(b.bundle.out != std::vector<double>(b.bundle.out.size(), 0.0));
    REQUIRE(b.errors.size() == 1);
    CHECK(b.errors[0] == "moe_layer: the options say ep = 4, the communicators 2");
  }
}
