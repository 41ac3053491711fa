// The GPU check's `layer` and `graph` steps (scripts/gpu-check.sh; docs/gpu.md): the fast layer in
// bf16, the one a trainer runs (cuda_exec's default GEMM policy, tensor_core_gemms: CUTLASS's
// grouped GEMM for dropless experts, one strided cuBLAS batch in pad mode, dense cuBLAS for the
// router and the shared expert), on one GPU.
//   - layer: over the loopback world (8 ranks, EP 4 x ETP 2, TP 2) dropless, sub-sequence pad
//     mode and full-sequence by position with order keys, against the same layer on simt_gemm
//     (the bitwise CPU = GPU reference): the same routing and kept record, outputs, input
//     gradients and reduced router and expert gradients within 1e-2 normwise.
//   - graph: forward + backward captured once in a CUDA graph after two eager steps and replayed
//     twice, the replays bitwise equal to eager steps 3 and 4 from the same state (outputs, input
//     gradients, the losses, every gradient), in pad mode with EP = 1 and dropless with
//     EP = ETP = 1 (one GPU, world 1), with the expert bias and the global-batch loss, whose
//     running average moves every step: a count frozen at capture would show. The replays start
//     from poisoned outputs and zeroed gradients, so a node the capture missed would show too.
// Without a device: exit 77 (skipped), which the check counts as a failure where a GPU is present.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <moefold/comm/cuda/loopback_world.cuh>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>
#include <moefold/exec/gemm_policy.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "device_layer_rank.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using T = bfloat16;
using fast_gemms = default_gemms<cuda_exec>;  // tensor_core_gemms<simt_gemms>
static_assert(std::is_same_v<fast_gemms, tensor_core_gemms<simt_gemms>>);

template <class Gemms>
std::vector<layer_result> run_on_gpu(const problem& p,
                                     const std::optional<drop_policy_variant>& drop, bool keys) {
  std::vector<layer_result> res(static_cast<std::size_t>(p.fold.world));
  const auto st = run_loopback_world(p.fold.world, [&](loopback_communicator& c) -> status {
    TRY_ASSIGN(x, cuda_exec::make(c.stream()));
    TRY_ASSIGN(r, (run_device_rank<T, all_to_all_dispatcher, Gemms>(p, c, *x, drop, keys)));
    TRY(x->device_status());
    res[static_cast<std::size_t>(c.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

// One rank of a one-GPU world: its layer, inputs and gradient buffers, and the stats of its last
// forward.
struct graph_rank {
  using layer_t =
      device_layer_t<T, all_to_all_dispatcher, cuda_exec, loopback_communicator, fast_gemms>;
  std::optional<layer_rank_setup<T, cuda_exec, loopback_communicator, fast_gemms>> in;
  std::optional<layer_t> layer;
  typename layer_t::stats_type stats{};
};

// What a step leaves: output, input gradient, losses, every gradient (raw bits).
struct step_bits {
  std::vector<T> out, dx;
  std::vector<float> losses, dw, g1, g2;
  bool operator==(const step_bits& o) const {
    const auto same = []<class V>(const std::vector<V>& a, const std::vector<V>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0;
    };
    return same(out, o.out) && same(dx, o.dx) && same(losses, o.losses) && same(dw, o.dw) &&
           same(g1, o.g1) && same(g2, o.g2);
  }
};

// Before a step: the outputs poisoned (NaN), the gradients zeroed, so each step's are its own.
status reset(cuda_exec& x, graph_rank& g) {
  auto& in = *g.in;
  return first_error({x.fill<T>(in.out.view(), T(NAN)), x.fill<T>(in.dx.view(), T(NAN)),
                      x.fill<float>(in.par.dw.view(), 0.0f), x.fill<float>(in.par.g1.view(), 0.0f),
                      x.fill<float>(in.par.g2.view(), 0.0f)});
}
status step(cuda_exec& x, graph_rank& g) {
  TRY_ASSIGN(s, g.layer->forward(x, g.in->x.cview(), g.in->key_view(), g.in->out.view()));
  g.stats = *s;
  return g.layer->backward(x, g.in->dout.cview(), 1.0f, g.in->dx.view());
}
expected<step_bits> read(cuda_exec& x, graph_rank& g) {
  auto& in = *g.in;
  step_bits b;
  TRY_ASSIGN(out, (download<T>(x, in.out.cview())));
  TRY_ASSIGN(dx, (download<T>(x, in.dx.cview())));
  TRY_ASSIGN(losses, (download<float>(x, g.stats.losses)));
  TRY_ASSIGN(dw, (download<float>(x, in.par.dw.cview())));
  TRY_ASSIGN(g1, (download<float>(x, in.par.g1.cview())));
  TRY_ASSIGN(g2, (download<float>(x, in.par.g2.cview())));
  b.out = std::move(*out);
  b.dx = std::move(*dx);
  b.losses = std::move(*losses);
  b.dw = std::move(*dw);
  b.g1 = std::move(*g1);
  b.g2 = std::move(*g2);
  return b;
}

struct graph_result {
  step_bits eager[2], replay[2];
  moe_layer_state after_eager, after_replays;  // the layer's state after step 4 each way
  bool finite = true;
};

// The options of the graph runs: the layer's state across steps on (the expert bias's counts, the
// global-batch loss's running counts and micro-batches), so a replay that froze a count the host
// passed at capture would differ from the eager step it stands for.
moe_layer_options graph_options(const problem& p, const dynamic_folded_mesh& fold) {
  moe_layer_options o = options_of(p, fold);
  o.router.score = score_function::sigmoid;
  o.router.expert_bias = true;
  o.global_aux_loss_coeff = 0.03;
  return o;
}

// Eager steps 1-2 (step 1 sizes everything), the state saved, eager steps 3-4 (the reference),
// the state loaded back, then a step captured and replayed twice (standing for steps 3 and 4),
// each step after a reset outside the graph.
expected<graph_result> capture_and_replay(const problem& p, const drop_policy_variant& drop,
                                          loopback_communicator& c) {
  TRY_ASSIGN(xp, cuda_exec::make(c.stream()));
  cuda_exec& x = *xp;
  graph_rank g;
  TRY_ASSIGN(in, (make_layer_rank_setup<T, fast_gemms>(p, c, x, false)));
  g.in.emplace(std::move(*in));
  TRY_ASSIGN(layer, graph_rank::layer_t::make(x, graph_options(p, g.in->fold), g.in->comms, drop,
                                              std::move(*g.in->mlp)));
  g.layer.emplace(std::move(*layer));
  TRY(g.layer->bind_parameters(
      {.router_weight = g.in->par.w.view(), .router_grad = g.in->par.dw.view()}));
  graph_result res;
  for (int i = 0; i < 2; ++i) {
    TRY(reset(x, g));
    TRY(step(x, g));
  }
  TRY_ASSIGN(after_two, g.layer->save_state(x));
  for (int i = 0; i < 2; ++i) {
    TRY(reset(x, g));
    TRY(step(x, g));
    TRY_ASSIGN(eager, read(x, g));
    res.eager[i] = std::move(*eager);
    for (T v : res.eager[i].out) res.finite = res.finite && std::isfinite(static_cast<float>(v));
  }
  TRY_ASSIGN(after_eager, g.layer->save_state(x));
  res.after_eager = std::move(*after_eager);
  TRY(g.layer->load_state(x, *after_two));
  // The capture: the layer's host code runs once, its work becomes the graph's nodes.
  TRY(reset(x, g));
  TRY(x.synchronize());
  cudaGraph_t graph = nullptr;
  TRY(detail::cuda_check(cudaStreamBeginCapture(x.stream(), cudaStreamCaptureModeRelaxed),
                         "cudaStreamBeginCapture"));
  const status captured = step(x, g);
  const status ended =
      detail::cuda_check(cudaStreamEndCapture(x.stream(), &graph), "cudaStreamEndCapture");
  if (!captured) {
    if (graph) (void)cudaGraphDestroy(graph);
    return unexpected<error>(captured.error());
  }
  TRY(ended);
  cudaGraphExec_t exec = nullptr;
  const status made =
      detail::cuda_check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  (void)cudaGraphDestroy(graph);
  TRY(made);
  const auto replay = [&](int i) -> status {
    TRY(reset(x, g));
    TRY(detail::cuda_check(cudaGraphLaunch(exec, x.stream()), "cudaGraphLaunch"));
    TRY_ASSIGN(b, read(x, g));
    res.replay[i] = std::move(*b);
    return {};
  };
  const status replays = first_error({replay(0), replay(1)});
  (void)cudaGraphExecDestroy(exec);
  TRY(replays);
  TRY(x.device_status());
  TRY_ASSIGN(after_replays, g.layer->save_state(x));
  res.after_replays = std::move(*after_replays);
  return res;
}

}  // namespace

TEST_CASE(
    "layer: the fast layer (tensor-core GEMMs) equals the SIMT layer in bf16 within 1e-2, "
    "EP 4 x ETP 2: dropless, sub-sequence pad mode, full-sequence by position") {
  problem p{.fold = {.world = 8, .tp = 2, .ep = 4, .etp = 2}};
  p.experts = 8;
  p.topk = 2;
  p.hidden = 64;
  p.ffn = 64;
  p.tokens = 48;
  p.bf16_values = true;
  const std::pair<std::optional<drop_policy_variant>, bool> runs[] = {
      {std::nullopt, false},
      {sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true}, false},
      {full_sequence{.capacity_factor = 1.0, .by = drop_by::position}, true}};
  for (const auto& [drop, keys] : runs) {
    CAPTURE(drop.has_value() ? drop->policy.index() : 99);
    const auto fast = run_on_gpu<fast_gemms>(p, drop, keys);
    const auto simt = run_on_gpu<simt_gemms>(p, drop, keys);
    double worst = 0;
    for (std::size_t r = 0; r < fast.size(); ++r) {
      CAPTURE(r);
      const layer_result &a = fast[r], &b = simt[r];
      CHECK(a.indices == b.indices);
      CHECK(a.kept == b.kept);
      using field = std::vector<double> layer_result::*;
      for (field v : {&layer_result::out, &layer_result::dx, &layer_result::dw_router,
                      &layer_result::dw1, &layer_result::dw2}) {
        const double e = rel_err(a.*v, b.*v);
        worst = std::max(worst, e);
        CHECK(e <= 1e-2);
      }
      CHECK(a.aux == doctest::Approx(b.aux).epsilon(1e-2));
      CHECK(a.z == doctest::Approx(b.z).epsilon(1e-2));
    }
    MESSAGE("fast layer vs SIMT layer, worst normwise difference: ", worst);
    CHECK(worst > 0);  // the backends differ: the fast one ran
  }
}

TEST_CASE(
    "graph: forward + backward captured once and replayed twice equal eager steps bitwise, the "
    "layer's state advancing (pad mode with EP = 1, dropless with EP = ETP = 1)") {
  problem q{.fold = {.world = 1}};
  q.experts = 8;
  q.topk = 2;
  q.hidden = 64;
  q.ffn = 64;
  q.tokens = 64;
  q.bf16_values = true;
  for (const drop_policy_variant& drop :
       {drop_policy_variant{},
        drop_policy_variant{sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true}}}) {
    CAPTURE(drop.policy.index());
    graph_result res;
    const auto st = run_loopback_world(1, [&](loopback_communicator& c) -> status {
      TRY_ASSIGN(r, capture_and_replay(q, drop, c));
      res = std::move(*r);
      return {};
    });
    REQUIRE_MESSAGE(st[0].has_value(), st[0].error().message);
    CHECK(res.finite);
    CHECK(!res.eager[0].out.empty());
    CHECK(res.replay[0] == res.eager[0]);
    CHECK(res.replay[1] == res.eager[1]);
    // The replays advanced the state on the device as the eager steps did: 4 micro-batches in the
    // global loss's running counts (a count frozen at capture would also have made replay 2's
    // loss differ), the expert bias's counts.
    CHECK(res.after_eager.global_aux_steps == 4);
    CHECK(res.after_replays.global_aux_steps == 4);
    CHECK(res.after_replays.global_aux_counts == res.after_eager.global_aux_counts);
    CHECK(res.after_replays.expert_bias_counts == res.after_eager.expert_bias_counts);
  }
}

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
