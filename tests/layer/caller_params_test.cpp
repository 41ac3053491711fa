// The MoE layer on parameters the caller owns (issue: "The MoE layer as trainers use it", part 2):
// the router weight, the shared expert (MLP and gate) and the routed experts (mlp_experts) run on
// the caller's buffers and accumulate into the caller's gradient buffers. Checked on 8 thread
// ranks, EP 2 x ETP 2 x EDP 2 over attention TP 2, with a gated shared expert and two losses:
//   - bitwise equal to the layer that owns its parameters (same weights);
//   - beta = 1: a second backward without zeroing doubles every gradient;
//   - weights are read in place: a weight the optimizer changes between steps is seen by the next
//     forward, which equals a layer bound to a fresh copy of the changed weights;
//   - nothing is copied: no live heap block allocated from before make() to after five steps holds
//     a copy of any weight tensor or of a step's gradient (the owning layer, whose parameters are
//     such blocks, is the control that shows the search finds copies);
//   - a binding of the wrong size is refused, naming the rule, and changes nothing.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/experts/mlp_experts.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "../dispatch/dispatch_harness.hpp"
#include "../support/count_new.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using Comm = thread_communicator;
using disp_t = all_to_all_dispatcher<double, Comm>;
using owning_t = moe_layer<double, host_exec, Comm, dropless, disp_t, reference_mlp<double>>;
using bound_t =
    moe_layer<double, host_exec, Comm, dropless, disp_t, mlp_experts<double, host_exec>>;

constexpr int shared_ffn = 8;

const problem& the_problem() {
  static const problem p = [] {
    problem q{.fold = {.world = 8, .tp = 2, .ep = 2, .etp = 2}};
    q.experts = 4;
    q.topk = 2;
    q.hidden = 8;
    q.ffn = 8;
    q.tokens = 4;
    return q;
  }();
  return p;
}

moe_layer_options base_options() {
  const problem& p = the_problem();
  return {.hidden = p.hidden,
          .max_tokens = p.tokens,
          .router = {.num_experts = p.experts, .topk = p.topk},
          .aux_loss_coeff = 0.01,
          .z_loss_coeff = 0.001,
          .shared_expert = {.ffn = shared_ffn, .gate = true}};
}

// One rank's parameters as a trainer holds them: weights and fp64 gradient buffers.
struct rank_params {
  std::vector<double> router, router_g, fc1, fc2, fc1_g, fc2_g, s1, s2, s1_g, s2_g, gate, gate_g;
  moe_layer_params<double> views() {
    return {
        .router_weight = router,
        .router_grad = router_g,
        .shared = {.mlp = {s1, s2}, .mlp_grad = {s1_g, s2_g}, .gate = gate, .gate_grad = gate_g}};
  }
  void zero_grads() {
    for (auto* v : {&router_g, &fc1_g, &fc2_g, &s1_g, &s2_g, &gate_g})
      std::fill(v->begin(), v->end(), 0.0);
  }
};

// The weights of rank r, taken from an owning layer set up the way the other layer tests set
// theirs up (so the two forms start from the same values).
void fill_owning(owning_t& l, int r) {
  for (std::size_t i = 0; i < l.router_weight().flat().size(); ++i)
    l.router_weight().flat()[i] = unit(9, static_cast<std::uint64_t>(i), 0);
  auto* se = l.shared();
  for (std::size_t i = 0; i < se->own().gate.flat().size(); ++i)
    se->own().gate.flat()[i] = unit(10, i, 0);
  for (std::size_t i = 0; i < se->own().fc1.flat().size(); ++i)
    se->own().fc1.flat()[i] = 0.5 * unit(11, static_cast<std::uint64_t>(r), i);
  for (std::size_t i = 0; i < se->own().fc2.flat().size(); ++i)
    se->own().fc2.flat()[i] = 0.5 * unit(12, static_cast<std::uint64_t>(r), i);
}

rank_params params_of(owning_t& l) {
  auto v = [](auto s) { return std::vector<double>(s.begin(), s.end()); };
  auto z = [](auto s) { return std::vector<double>(s.size(), 0.0); };
  auto* se = l.shared();
  rank_params q;
  q.router = v(l.router_weight().flat());
  q.router_g = z(l.router_weight().flat());
  q.fc1 = v(l.experts().weights_fc1());
  q.fc2 = v(l.experts().weights_fc2());
  q.fc1_g = z(q.fc1);
  q.fc2_g = z(q.fc2);
  q.s1 = v(se->own().fc1.flat());
  q.s2 = v(se->own().fc2.flat());
  q.s1_g = z(q.s1);
  q.s2_g = z(q.s2);
  q.gate = v(se->own().gate.flat());
  q.gate_g = z(q.gate);
  return q;
}

struct step_out {
  std::vector<double> out, dx, router_g, fc1_g, fc2_g, s1_g, s2_g, gate_g;
  bool operator==(const step_out&) const = default;
};

struct step_inputs {
  std::vector<double> x, dout;
};
step_inputs inputs_of(int r) {
  const problem& p = the_problem();
  step_inputs in;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    in.x.insert(in.x.end(), d.x.begin(), d.x.end());
    in.dout.insert(in.dout.end(), d.dout.begin(), d.dout.end());
  }
  return in;
}

// One step on the layer's communicators (the bundle given to make), on the context `x`.
template <class Layer>
status step(Layer& l, host_exec& x, const step_inputs& in, step_out& o, bool reduce) {
  o.out.assign(in.x.size(), 0.0);
  o.dx.assign(in.x.size(), 0.0);
  if (auto f = l.forward(x, the_problem().tokens, in.x, {}, o.out); !f)
    return unexpected<error>(f.error());
  if (auto b = l.backward(x, in.dout, 1.0, o.dx); !b) return b;
  if (!reduce) return {};
  if constexpr (std::same_as<Layer, owning_t>)  // the caller's list of the experts' gradients
    return l.reduce_gradients(x, {l.experts().grads_fc1(), l.experts().grads_fc2()});
  else  // the experts' own gradient views (mlp_experts::grads())
    return l.reduce_gradients(x);
}

template <class Layer>
void take_grads(Layer& l, step_out& o) {
  auto v = [](auto s) { return std::vector<double>(s.begin(), s.end()); };
  o.router_g = v(l.router_weight_grad().flat());
  if constexpr (std::same_as<Layer, owning_t>) {
    o.fc1_g = v(l.experts().grads_fc1());
    o.fc2_g = v(l.experts().grads_fc2());
  } else {
    o.fc1_g = v(l.experts().grads().fc1.flat());
    o.fc2_g = v(l.experts().grads().fc2.flat());
  }
  o.s1_g = v(l.shared()->params().grads.fc1.flat());
  o.s2_g = v(l.shared()->params().grads.fc2.flat());
  o.gate_g = v(l.shared()->params().gate_grad.flat());
}

// The layer holds `c` by reference: it must outlive the layer.
expected<bound_t> make_bound(host_exec& x, moe_layer_communicators<Comm>& c, rank_params& q) {
  const problem& p = the_problem();
  const auto fold = make_folded(p.fold).value();
  const mlp_shape shape{.hidden = p.hidden,
                        .ffn = p.ffn,
                        .num_local_experts = p.experts / fold.ep(),
                        .etp = fold.etp(),
                        .etp_rank = c.etp.rank()};
  auto experts = mlp_experts<double, host_exec>::make(shape, {q.fc1, q.fc2}, {q.fc1_g, q.fc2_g});
  if (!experts) return unexpected<error>(experts.error());
  auto l = bound_t::make(x, base_options(), c, dropless{}, std::move(*experts));
  if (!l) return l;
  if (auto s = l->bind_parameters(q.views()); !s) return unexpected<error>(s.error());
  return l;
}

double max_rel(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num = std::max(num, std::abs(got[i] - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return got.size() != want.size() ? 1e300 : (den == 0 ? num : num / den);
}

}  // namespace

TEST_CASE("caller-owned parameters: bitwise the owning layer, beta = 1, read in place") {
  const problem& p = the_problem();
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  struct result {
    step_out owning, bound, twice, changed_bound, changed_fresh;
    std::string refused;
    bool refused_changed_nothing = false;
  };
  std::vector<result> res(8);
  const auto st = run_thread_world(8, [&](Comm& world) -> status {
    const int r = world.rank();
    auto& R = res[static_cast<std::size_t>(r)];
    host_exec ex;
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    const step_inputs in = inputs_of(r);
    auto own = owning_t::make(ex, base_options(), *comms, dropless{},
                              rank_experts<double>(p, fold, r, w.w1, w.w2).value());
    if (!own) return unexpected<error>(own.error());
    fill_owning(*own, r);
    rank_params q = params_of(*own);
    if (auto s = step(*own, ex, in, R.owning, true); !s) return s;
    take_grads(*own, R.owning);

    auto bound = make_bound(ex, *comms, q);
    if (!bound) return unexpected<error>(bound.error());
    if (auto s = step(*bound, ex, in, R.bound, true); !s) return s;
    take_grads(*bound, R.bound);
    // The gradients are the caller's buffers.
    CHECK(bound->router_weight_grad().flat().data() == q.router_g.data());
    CHECK(bound->shared()->params().gate_grad.flat().data() == q.gate_g.data());

    // beta = 1: zero, two backwards of the same input, no reduction in between.
    q.zero_grads();
    step_out one;
    if (auto s = step(*bound, ex, in, one, false); !s) return s;
    take_grads(*bound, one);
    if (auto s = step(*bound, ex, in, R.twice, false); !s) return s;
    take_grads(*bound, R.twice);
    for (auto m : {&step_out::router_g, &step_out::fc1_g, &step_out::fc2_g, &step_out::s1_g,
                   &step_out::s2_g, &step_out::gate_g}) {
      std::vector<double> doubled = one.*m;
      for (auto& v : doubled) v *= 2;
      CHECK(max_rel(R.twice.*m, doubled) <= 1e-13);
      CHECK(max_rel(one.*m, std::vector<double>((one.*m).size(), 0.0)) > 0);
    }

    // The optimizer changes weights in place; the next forward sees them.
    for (auto& v : q.router) v *= 1.25;
    for (auto& v : q.fc1) v += 0.05;
    for (auto& v : q.s2) v *= 0.75;
    for (auto& v : q.gate) v -= 0.1;
    q.zero_grads();
    if (auto s = step(*bound, ex, in, R.changed_bound, false); !s) return s;
    take_grads(*bound, R.changed_bound);
    rank_params fresh = q;  // a copy of the changed weights, bound to a new layer
    fresh.zero_grads();
    auto other = make_bound(ex, *comms, fresh);
    if (!other) return unexpected<error>(other.error());
    if (auto s = step(*other, ex, in, R.changed_fresh, false); !s) return s;
    take_grads(*other, R.changed_fresh);

    // A binding of the wrong size is refused and changes nothing.
    rank_params bad = q;
    bad.router.pop_back();
    const auto e = bound->bind_parameters(bad.views());
    R.refused = e ? "accepted" : e.error().message;
    R.refused_changed_nothing = bound->router_weight().flat().data() == q.router.data();
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  for (const auto& R : res) {
    CHECK(R.bound == R.owning);
    CHECK(R.bound.out != std::vector<double>(R.bound.out.size(), 0.0));
    CHECK(R.changed_bound == R.changed_fresh);
    CHECK(R.changed_bound.out != R.bound.out);
    CHECK(R.refused.find("router weight and its gradient must be [E, H]") != std::string::npos);
    CHECK(R.refused_changed_nothing);
  }
}

namespace {

// The first 64 bytes of a buffer, as a needle to look for in the heap.
using needle = std::array<std::byte, 64>;
needle needle_of(const std::vector<double>& v) {
  needle n{};
  std::memcpy(n.data(), v.data(), std::min(n.size(), v.size() * sizeof(double)));
  return n;
}
long long count_copies(const std::vector<needle>& needles) {
  long long found = 0;
  for_each_tracked([&](const std::byte* p, std::size_t n) {
    for (const needle& nd : needles)
      for (std::size_t off = 0; off + nd.size() <= n; off += alignof(double))
        if (std::memcmp(p + off, nd.data(), nd.size()) == 0) ++found;
  });
  return found;
}

struct heap_report {
  long long copies = -1;  // live heap blocks holding a copy of a weight or a step's gradient
  long long news = -1;    // operator new calls in steps 3-5 (steps 1-2 size every buffer)
};

// Runs five training steps on every rank (step 1 without the gradient reduction, steps 2-5 with
// it), the layer made after `tracking` began; counts the heap blocks that hold a copy of a weight
// tensor or of the first step's gradient, and the allocations of the steps after the first
// reduction.
heap_report copies_in_heap(bool caller_owned) {
  const problem& p = the_problem();
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  // Everything the search needs is allocated before tracking starts.
  // Per rank: 6 weight tensors, a gradient (caller-owned run only), one unused; unused needles
  // hold a pattern no buffer here holds.
  std::vector<needle> needles(8 * 8);
  for (auto& n : needles) n.fill(std::byte{0x5a});
  std::vector<rank_params> params(8);
  std::vector<step_inputs> inputs(8);
  for (int r = 0; r < 8; ++r) inputs[static_cast<std::size_t>(r)] = inputs_of(r);
  heap_report rep;
  const auto st = run_thread_world(8, [&](Comm& world) -> status {
    const int r = world.rank();
    const auto ur = static_cast<std::size_t>(r);
    host_exec ex;  // stateless: it holds no memory of its own
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    {  // the weights, from an owning layer that is gone before tracking starts
      auto own = owning_t::make(ex, base_options(), *comms, dropless{},
                                rank_experts<double>(p, fold, r, w.w1, w.w2).value());
      if (!own) return unexpected<error>(own.error());
      fill_owning(*own, r);
      params[ur] = params_of(*own);
    }
    rank_params& q = params[ur];
    const std::vector<double>* weights[] = {&q.router, &q.fc1, &q.fc2, &q.s1, &q.s2, &q.gate};
    for (std::size_t i = 0; i < 6; ++i) needles[ur * 8 + i] = needle_of(*weights[i]);
    step_out o;
    o.out.reserve(inputs[ur].x.size());
    o.dx.reserve(inputs[ur].x.size());
    if (auto s = world.barrier(); !s) return s;
    if (r == 0) {
      clear_tracked();
      tracking.store(true);
    }
    if (auto s = world.barrier(); !s) return s;
    std::optional<owning_t> owning;
    std::optional<bound_t> bound;
    if (caller_owned) {
      auto l = make_bound(ex, *comms, q);
      if (!l) return unexpected<error>(l.error());
      bound.emplace(std::move(*l));
    } else {
      auto l = owning_t::make(ex, base_options(), *comms, dropless{},
                              rank_experts<double>(p, fold, r, w.w1, w.w2).value());
      if (!l) return unexpected<error>(l.error());
      owning.emplace(std::move(*l));
      fill_owning(*owning, r);
    }
    for (int s = 0; s < 5; ++s) {
      if (auto b = world.barrier(); !b) return b;  // rank 0 starts counting when all are here
      if (r == 0 && s == 2) {
        news.store(0);
        counting.store(true);
      }
      if (auto b = world.barrier(); !b) return b;
      const auto run = [&](auto& l) { return step(l, ex, inputs[ur], o, s > 0); };
      // (step 0 is not reduced, so its gradient is this rank's own)
      if (auto e = caller_owned ? run(*bound) : run(*owning); !e) return e;
      // The first step's router gradient before any reduction. Every step adds the same (same
      // input, no optimizer step), so a scratch that held a step's gradient before adding it to
      // the caller's buffer would still hold these bytes at the end. (The owning layer's own
      // gradient buffer has moved on by then: the control is the weights.)
      if (s == 0 && caller_owned)
        std::memcpy(needles[ur * 8 + 6].data(), bound->router_weight_grad().flat().data(),
                    needles[ur * 8 + 6].size());
    }
    if (auto s = world.barrier(); !s) return s;
    if (r == 0) {
      counting.store(false);
      rep.news = news.load();
      tracking.store(false);
      rep.copies = count_copies(needles);
    }
    if (auto s = world.barrier(); !s) return s;
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  CHECK_FALSE(tracked_overflow.load());
  for (const needle& n : needles) CHECK(n != needle{});  // no needle matches mere zeros
  return rep;
}

}  // namespace

TEST_CASE("caller-owned parameters: no live heap block holds a copy, no step allocates") {
  const heap_report owned = copies_in_heap(false);
  const heap_report bound = copies_in_heap(true);
  MESSAGE("heap blocks holding a parameter: owning layer ", owned.copies, ", caller-owned ",
          bound.copies, "; operator new in steps 3-5: ", owned.news, ", ", bound.news);
  CHECK(owned.copies >= 8 * 6);  // the control: the owning layers hold every tensor of every rank
  CHECK(bound.copies == 0);
  CHECK(owned.news == 0);
  CHECK(bound.news == 0);
}
