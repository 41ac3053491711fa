// The MoE layer on the CPU executor from kernels (simt_moe_layer: simt_router, the router losses
// as device values, a dispatcher on cpu_exec, simt_mlp experts) over the device-space thread
// world, EP 4 x ETP 2 and other folds, both dispatchers: every rank's output, input gradient,
// reduced router and expert gradients and losses against the host layer (moe_layer on host_exec
// with reference_mlp experts holding the same weights: the same routing, values within the two
// layers' fp32 error) and against the single-rank fp64 reference of layer_harness.hpp.
#include <moefold/comm/thread_world.hpp>
#include <moefold/core/cpu_exec.hpp>
#include <moefold/core/exec_buffer.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/experts/simt_mlp.hpp>
#include <moefold/layer/simt_moe_layer.hpp>

#include <doctest/doctest.h>

#include <span>
#include <string>
#include <vector>

#include "../dispatch/device_round_trip.hpp"
#include "layer_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using dev_comm = thread_device_communicator;
using space = cpu_device_space;

template <class T, template <class, class, class, class> class Disp>
using simt_layer_t = simt_moe_layer<T, cpu_exec, dev_comm, Disp<T, dev_comm, cpu_exec, float>,
                                    simt_mlp<T, cpu_exec, main_grad_t<T>, float>>;

template <class T>
std::vector<double> widen_all(const std::vector<T>& v) {
  return widen(std::span<const T>(v));
}

// The options both layers run with (layer_harness.hpp's: softmax top-k, aux and z-loss).
moe_layer_options options_of(const problem& p, const dynamic_folded_mesh& fold) {
  return {.hidden = p.hidden,
          .max_tokens = p.tokens,
          .ep = fold.ep(),
          .etp = fold.etp(),
          .router = {.num_experts = p.experts, .topk = p.topk},
          .aux_loss_coeff = aux_coeff,
          .z_loss_coeff = z_coeff};
}

// One rank's simt_moe_layer: the weights of layer_harness.hpp uploaded to the context, forward,
// backward (seed 1), gradients reduced; everything read back and widened.
template <class T, template <class, class, class, class> class Disp>
expected<layer_result> run_simt_rank(const problem& p, dev_comm& world, cpu_exec& x) {
  using G = main_grad_t<T>;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int r = world.rank(), H = p.hidden, E = p.experts, L = E / fold.ep();
  auto get = [&](group_kind k) { return group_communicator(world, groups, {k}).value(); };
  auto ep = get(group_kind::ep), etp = get(group_kind::etp), tp_ep = get(group_kind::tp_ep);
  auto tp_cp = get(group_kind::tp_cp), stage = get(group_kind::tp_dp_cp),
       edp = get(group_kind::edp);
  // The experts' weights in the library's layout, from the host reference expert's loader.
  const data w = make_weights(p);
  TRY_ASSIGN(ref, (rank_experts<T, float>(p, fold, r, w.w1, w.w2)));
  const int fs = p.ffn / fold.etp();
  const std::vector<T> fc1(ref->weights_fc1().begin(), ref->weights_fc1().end());
  const std::vector<T> fc2(ref->weights_fc2().begin(), ref->weights_fc2().end());
  TRY_ASSIGN(d_fc1, upload(x, fc1, L * 2 * fs, H));
  TRY_ASSIGN(d_fc2, upload(x, fc2, L * H, fs));
  TRY_ASSIGN(d_g1, upload(x, std::vector<G>(fc1.size(), G(0)), L * 2 * fs, H));
  TRY_ASSIGN(d_g2, upload(x, std::vector<G>(fc2.size(), G(0)), L * H, fs));
  TRY_ASSIGN(mlp, (simt_mlp<T, cpu_exec, G, float>::make(x,
                                                         {.hidden = H,
                                                          .ffn = p.ffn,
                                                          .num_local_experts = L,
                                                          .etp = fold.etp(),
                                                          .etp_rank = fold.moe_coord_of(r).etp,
                                                          .act = activation::swiglu},
                                                         {d_fc1->cview(), d_fc2->cview()},
                                                         {d_g1->view(), d_g2->view()})));
  const auto wr = router_weight(p);
  TRY_ASSIGN(d_w, upload(x, cast<T>(wr), E, H));
  TRY_ASSIGN(d_dw, upload(x, std::vector<G>(wr.size(), G(0)), E, H));
  TRY_ASSIGN(layer, (simt_layer_t<T, Disp>::make(x, options_of(p, fold), d_w->cview(), d_dw->view(),
                                                 std::move(*mlp))));
  std::vector<T> xs, douts;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    for (double v : d.x) xs.push_back(static_cast<T>(v));
    for (double v : d.dout) douts.push_back(static_cast<T>(v));
  }
  TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
  TRY_ASSIGN(d_dout, upload(x, douts, p.tokens, H));
  TRY_ASSIGN(d_out, (exec_buffer<T, cpu_exec>::make(x, p.tokens, H)));
  TRY_ASSIGN(d_dx, (exec_buffer<T, cpu_exec>::make(x, p.tokens, H)));
  const moe_layer_groups<dev_comm> g{tp_cp, {ep, etp, tp_ep}};
  TRY_ASSIGN(stats, layer->forward(d_x->cview(), g, d_out->view()));
  layer_result res;
  TRY_ASSIGN(aux, (download<float>(x, stats->aux_loss)));
  TRY_ASSIGN(z, (download<float>(x, stats->z_loss)));
  if (aux->size() != 1 || z->size() != 1)
    return make_error(errc::invalid_argument, "the training forward gave no loss values");
  res.aux = (*aux)[0];
  res.z = (*z)[0];
  TRY_ASSIGN(idx, (download<int>(x, layer->last_indices())));
  res.indices = *idx;
  res.kept = *idx;  // dropless
  TRY(layer->backward(d_dout->cview(), 1.0f, g, d_dx->view()));
  TRY(layer->reduce_gradients(stage, edp, d_dw->view(), {d_g1->view(), d_g2->view()}));
  TRY_ASSIGN(out, (download<T>(x, d_out->cview())));
  TRY_ASSIGN(dx, (download<T>(x, d_dx->cview())));
  TRY_ASSIGN(dw, (download<G>(x, d_dw->cview())));
  TRY_ASSIGN(g1, (download<G>(x, d_g1->cview())));
  TRY_ASSIGN(g2, (download<G>(x, d_g2->cview())));
  res.out = widen_all(*out);
  res.dx = widen_all(*dx);
  res.dw_router = widen_all(*dw);
  res.dw1 = widen_all(*g1);
  res.dw2 = widen_all(*g2);
  return res;
}

template <class T, template <class, class, class, class> class Disp>
std::vector<layer_result> run_simt(const problem& p) {
  const int W = p.fold.world;
  std::vector<layer_result> res(static_cast<std::size_t>(W));
  const auto st = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<space>();
    cpu_exec x(static_cast<std::uint64_t>(7 + dw.rank()));
    auto r = run_simt_rank<T, Disp>(p, dw, x);
    if (!r) return unexpected<error>(r.error());
    res[static_cast<std::size_t>(dw.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

// The host layer, the same problem (moe_layer on host_exec, reference_mlp experts, dropless).
template <class T, template <class, class, class, class> class Disp>
std::vector<layer_result> run_host(const problem& p) {
  using D = Disp<T, thread_communicator, host_exec, float>;
  const int W = p.fold.world;
  std::vector<layer_result> res(static_cast<std::size_t>(W));
  const auto st = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto r = run_layer_rank<T, dropless, D>(p, dropless{}, world);
    if (!r) return unexpected<error>(r.error());
    res[static_cast<std::size_t>(world.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

// Each rank of the two layers: the same routing, values within `tol` normwise.
void check_same_layer(const std::vector<layer_result>& dev, const std::vector<layer_result>& host,
                      double tol) {
  REQUIRE(dev.size() == host.size());
  for (std::size_t r = 0; r < dev.size(); ++r) {
    CAPTURE(r);
    const layer_result &a = dev[r], &b = host[r];
    CHECK(a.indices == b.indices);
    CHECK(rel_err(a.out, b.out) <= tol);
    CHECK(rel_err(a.dx, b.dx) <= tol);
    CHECK(rel_err(a.dw_router, b.dw_router) <= tol);
    CHECK(rel_err(a.dw1, b.dw1) <= tol);
    CHECK(rel_err(a.dw2, b.dw2) <= tol);
    CHECK(a.aux == doctest::Approx(b.aux).epsilon(tol));
    CHECK(a.z == doctest::Approx(b.z).epsilon(tol));
  }
}

const fold_config simt_layer_folds[] = {
    {.world = 8, .tp = 2, .ep = 4, .etp = 2},  // EP 4 x ETP 2
    {.world = 4, .cp = 2, .ep = 4, .etp = 1},
    {.world = 8, .tp = 4, .pp = 2, .ep = 2, .etp = 2},
};

template <template <class, class, class, class> class Disp>
void check_fp32(const std::string& name, std::span<const fold_config> folds) {
  CAPTURE(name);
  for (const auto& f : folds) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f};
    p.experts = 2 * fold.ep();
    p.topk = 2;
    p.hidden = 12;
    p.ffn = 2 * fold.etp();
    p.tokens = 5;
    const auto dev = run_simt<float, Disp>(p);
    // Against the fp64 reference (normwise 1e-5, the float layer's bound there) ...
    layer_check judge;
    CHECK(check_layer_results<float>(p, dev, drop_mode::none, &judge) == 0);
    CHECK(judge.worst > 0);  // fp32 is not exact: the comparison is not vacuous
    // ... and against the host layer: the same routing, within both layers' error.
    check_same_layer(dev, run_host<float, Disp>(p), 2e-5);
  }
}

}  // namespace

TEST_CASE("simt_moe_layer on cpu_exec equals the host layer and the fp64 reference: All-to-All") {
  check_fp32<all_to_all_dispatcher>("all_to_all", simt_layer_folds);
}

TEST_CASE("simt_moe_layer on cpu_exec equals the host layer and the fp64 reference: AllGather") {
  // EP 4 x ETP 2 only: the dispatchers are compared fold by fold in dispatch-device-dispatcher,
  // and each fold of the thread world on cpu_exec costs seconds under the sanitizers.
  check_fp32<all_gather_dispatcher>("all_gather", std::span(simt_layer_folds).first(1));
}

TEST_CASE("simt_moe_layer in bf16 (fp32 router and probabilities) against the fp64 reference") {
  const fold_config f{.world = 8, .tp = 2, .ep = 4, .etp = 2};
  const auto fold = make_folded(f).value();
  problem p{.fold = f};
  p.experts = 8;
  p.topk = 2;
  p.hidden = 16;
  p.ffn = 4;
  p.tokens = 6;
  p.bf16_values = true;
  const auto dev = run_simt<bfloat16, all_to_all_dispatcher>(p);
  layer_check judge;
  CHECK(check_layer_results<bfloat16>(p, dev, drop_mode::none, &judge) == 0);
  MESSAGE("bf16 simt layer, worst normwise error against fp64: ", judge.worst);
  CHECK(judge.worst > 0);
  (void)fold;
}

TEST_CASE("simt_moe_layer refuses what it does not run and misuse, naming the rule") {
  cpu_exec x(1);
  using layer_t = simt_layer_t<float, all_to_all_dispatcher>;
  using mlp_t = simt_mlp<float, cpu_exec, float, float>;
  const int H = 4, E = 2, F = 2;
  auto fc1 = exec_buffer<float, cpu_exec>::make(x, E * 2 * F, H).value();
  auto fc2 = exec_buffer<float, cpu_exec>::make(x, E * H, F).value();
  auto g1 = exec_buffer<float, cpu_exec>::make(x, E * 2 * F, H).value();
  auto g2 = exec_buffer<float, cpu_exec>::make(x, E * H, F).value();
  auto w = exec_buffer<float, cpu_exec>::make(x, E, H).value();
  auto dw = exec_buffer<float, cpu_exec>::make(x, E, H).value();
  const auto experts = [&] {
    return mlp_t::make(x, {.hidden = H, .ffn = F, .num_local_experts = E},
                       {fc1.cview(), fc2.cview()}, {g1.view(), g2.view()})
        .value();
  };
  const moe_layer_options ok{.hidden = H, .max_tokens = 3, .router = {.num_experts = E, .topk = 2}};
  const auto refused = [&](moe_layer_options o, const std::string& words) {
    auto l = layer_t::make(x, o, w.cview(), dw.view(), experts());
    REQUIRE_FALSE(l.has_value());
    CHECK_MESSAGE(l.error().message.find(words) != std::string::npos, l.error().message);
  };
  {
    auto o = ok;
    o.seq_aux_loss_coeff = 0.1;
    refused(o, "per-sequence and global load-balancing losses");
  }
  {
    auto o = ok;
    o.router.expert_bias = true;
    o.router.score = score_function::sigmoid;
    refused(o, "expert bias");
  }
  {
    auto o = ok;
    o.shared_expert.ffn = 4;
    refused(o, "shared expert");
  }
  {
    auto o = ok;
    o.aux_loss_coeff = -1;
    refused(o, "finite and >= 0");
  }
  {
    auto o = ok;
    o.hidden = 8;
    refused(o, "the experts hold");
  }
  {
    auto o = ok;
    o.router.topk = 3;  // k > E: the router's own rule
    auto l = layer_t::make(x, o, w.cview(), dw.view(), experts());
    CHECK_FALSE(l.has_value());
  }
  // Misuse of a made layer: a backward with no forward, shapes that do not fit.
  const auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
    auto d = std::move(world).in_space<space>();
    cpu_exec xx(2);
    auto l = layer_t::make(xx, ok, w.cview(), dw.view(), experts());
    if (!l) return unexpected<error>(l.error());
    auto in = exec_buffer<float, cpu_exec>::make(xx, 4, H).value();
    auto out = exec_buffer<float, cpu_exec>::make(xx, 4, H).value();
    const moe_layer_groups<dev_comm> g{d, {d, d, d}};
    auto b = l->backward(in.cview().first(2), 1.0f, g, out.view().first(2));
    REQUIRE_FALSE(b.has_value());
    CHECK(b.error().message.find("backward without a forward") != std::string::npos);
    auto f = l->forward(in.cview(), g, out.view());  // 4 tokens > max_tokens 3
    REQUIRE_FALSE(f.has_value());
    CHECK(f.error().message.find("N <= max_tokens") != std::string::npos);
    auto f2 = l->forward(in.cview().first(2), g, out.view().first(3));
    REQUIRE_FALSE(f2.has_value());
    CHECK(f2.error().code == errc::shape_mismatch);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
}
