// The MoE layer on one GPU against its GEMMs (docs/performance.md, "The layer against its GEMMs"):
// moefold's layer in bf16 (cuda_exec, EP = ETP = 1, dropless: router, permute, the experts'
// grouped GEMMs, un-permute), forward and forward + backward, timed from the router's input to the
// layer's output, on the three shapes of gpu-baselines at 8,192 tokens, with balanced routing and
// skewed routing (one expert at 4x the mean, a quarter of the experts at 5% of it, the rest even).
// The routing is set by the input: token t's chosen experts hold 4 in their columns of x and the
// router weight is the identity on the first E columns, so the router picks exactly them; the
// PyTorch peer (benchmarks/layer/torch_peer.py) builds the same tokens and routes them through the
// same gating. In the same run:
//   - the ceiling: the six dense cuBLAS GEMMs of the experts over the same total rows (fc1 and fc2
//     forward, their data and weight gradients; the forward's two for the forward);
//   - the layer on each GEMM policy: cuda_exec's default (tensor_core_gemms: CUTLASS's grouped
//     GEMM, cuBLAS) on every shape, the portable SIMT kernel (simt_gemms) at a small shape only,
//     beside the default at that shape.
// One forward + backward of the default layer runs with CUDA events around each GEMM (a policy of
// this program's that wraps the default, timed_gemms): the router's GEMMs' share of that step, the
// experts', and what is left for everything else together.
// FLOPs: 6 T k H F forward on the kept rows (dropless: all T k), 3x that for forward + backward.
// Each time: the median of 10 event-timed steps after 3 warm-ups (the first sizes every buffer).
// Output: one JSON object per line ("bench": "layer"), then a table of TFLOP/s and ratios.
//
//   build/benchmarks/layer/bench-layer [--quick]      (--quick: the small shape only)
#include <moefold/comm/cuda/loopback_world.cuh>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/exec/cublas_dense.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/gemm_policy.hpp>
#include <moefold/layer/moe_layer.hpp>

#include "step_timer.cuh"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

using namespace moefold;
namespace k = moefold::kernels;
using moefold::bench::keep;
using moefold::bench::median_seconds;

// Outside the anonymous namespace: nvcc warns about members of its templates that a concept check
// instantiates and nothing calls.
namespace clocked {

// Events around every GEMM of one step, by kind (this program's own clock, on for one step of
// each layer): how much of a step the router's GEMMs and the experts' take, and what is left for
// everything else (router kernels, permute, un-permute, bookkeeping, the host's launches).
struct gemm_clock {
  static inline bool on = false;
  struct mark {
    gemm_kind kind;
    cudaEvent_t a, b;
  };
  static inline std::vector<mark> marks;
};
template <gemm_kind K, class G>
struct timed_gemm : G {
  template <execution_context Exec>
  [[nodiscard]] status run(Exec& x) {
    if (!gemm_clock::on) return G::run(x);
    gemm_clock::mark m{K, nullptr, nullptr};
    cudaEventCreate(&m.a);
    cudaEventCreate(&m.b);
    cudaEventRecord(m.a, x.stream());
    const status st = G::run(x);
    cudaEventRecord(m.b, x.stream());
    gemm_clock::marks.push_back(m);
    return st;
  }
};
// cuda_exec's default policy (tensor_core_gemms), each GEMM on the clock.
struct timed_gemms {
  template <gemm_kind K, gemm_mode M, class A, class B, class C>
  using backend = timed_gemm<K, typename default_gemms<cuda_exec>::template backend<K, M, A, B, C>>;
};
}  // namespace clocked

namespace {

using T = bfloat16;
using comm_t = loopback_communicator;

using fast_layer = moe_layer<T, cuda_exec, comm_t, drop_policy_variant,
                             all_to_all_dispatcher<T, comm_t, cuda_exec, float>,
                             mlp_experts<T, cuda_exec, clocked::timed_gemms, float, float>,
                             topk_router<T, cuda_exec, float, clocked::timed_gemms>>;
using simt_layer = moe_layer<T, cuda_exec, comm_t, drop_policy_variant,
                             all_to_all_dispatcher<T, comm_t, cuda_exec, float>,
                             mlp_experts<T, cuda_exec, simt_gemms, float, float>,
                             topk_router<T, cuda_exec, float, simt_gemms>>;

struct shape {
  const char* name;
  int tokens, hidden, ffn, experts, topk;
};
const shape shapes[] = {
    {"mixtral-8x22b", 8192, 6144, 16384, 8, 2},
    {"qwen2-57b-a14b", 8192, 3584, 2560, 64, 8},
    {"dsv3-like-32local", 8192, 7168, 2048, 32, 8},
};
const shape small_shape{"small", 1024, 1024, 512, 8, 2};

// Routed pairs per expert: balanced (T k / E each) or skewed (expert 0 at 4x the mean, the last
// quarter at 5% of it, the rest even), summing to T k; every count at most T.
std::vector<int> pair_counts(const shape& s, bool skewed) {
  const long long total = static_cast<long long>(s.tokens) * s.topk;
  const int E = s.experts;
  std::vector<int> c(static_cast<std::size_t>(E), static_cast<int>(total / E));
  if (skewed) {
    const double mean = static_cast<double>(total) / E;
    const int low = std::max(1, static_cast<int>(0.05 * mean)), quarter = std::max(1, E / 4);
    c[0] = std::min(s.tokens, static_cast<int>(4 * mean));
    for (int e = E - quarter; e < E; ++e) c[static_cast<std::size_t>(e)] = low;
    const long long rest = total - c[0] - static_cast<long long>(low) * quarter;
    const int even = E - 1 - quarter;
    for (int e = 1; e <= even; ++e)
      c[static_cast<std::size_t>(e)] = static_cast<int>(rest / even + (e <= rest % even ? 1 : 0));
  } else {
    for (int e = 0; e < static_cast<int>(total % E); ++e) ++c[static_cast<std::size_t>(e)];
  }
  return c;
}

// Token t's experts: slot i of the expert-sorted list of pairs goes to token i mod T, so each
// token gets k distinct experts (no count exceeds T). [T, k]
std::vector<int> routing_of(const shape& s, const std::vector<int>& counts) {
  std::vector<int> idx(static_cast<std::size_t>(s.tokens) * s.topk, -1);
  std::vector<int> filled(static_cast<std::size_t>(s.tokens), 0);
  long long slot = 0;
  for (int e = 0; e < s.experts; ++e)
    for (int j = 0; j < counts[static_cast<std::size_t>(e)]; ++j, ++slot) {
      const auto t = static_cast<std::size_t>(slot % s.tokens);
      idx[t * static_cast<std::size_t>(s.topk) + static_cast<std::size_t>(filled[t]++)] = e;
    }
  return idx;
}

struct times {
  double fwd = 0, fwdbwd = 0;
  // One forward + backward on the clock: its time, and the router's and the experts' GEMMs in it.
  double clocked = 0, router_gemms = 0, expert_gemms = 0;
};

template <class V>
expected<exec_buffer<V, cuda_exec>> filled(cuda_exec& x, long long rows, long long width, V v) {
  auto b = exec_buffer<V, cuda_exec>::make(x, rows, width);
  if (!b) return b;
  if (auto st = x.fill<V>(b->view(), v); !st) return unexpected<error>(st.error());
  return b;
}

// The layer of type Layer on shape s and the routing `idx`: forward and forward + backward.
template <class Layer>
expected<times> time_layer(cuda_exec& x, comm_t& world, const shape& s,
                           const std::vector<int>& idx) {
  const int H = s.hidden, E = s.experts, Fh = s.ffn, Tn = s.tokens;
  auto comms = make_layer_communicators(world, megatron_groups(make_folded({.world = 1}).value()));
  if (!comms) return unexpected<error>(comms.error());
  // Expert weights (small values: the SwiGLU stays in range), fp32 gradients.
  auto fc1 = filled<T>(x, static_cast<long long>(E) * 2 * Fh, H, T(0.01f));
  auto fc2 = filled<T>(x, static_cast<long long>(E) * H, Fh, T(0.01f));
  auto g1 = filled<float>(x, static_cast<long long>(E) * 2 * Fh, H, 0.0f);
  auto g2 = filled<float>(x, static_cast<long long>(E) * H, Fh, 0.0f);
  for (const auto* b : {&fc1, &fc2})
    if (!*b) return unexpected<error>(b->error());
  for (const auto* b : {&g1, &g2})
    if (!*b) return unexpected<error>(b->error());
  using experts_t = typename Layer::experts_type;
  auto mlp =
      experts_t::make({.hidden = H, .ffn = Fh, .num_local_experts = E, .act = activation::swiglu},
                      {fc1->cview(), fc2->cview()}, {g1->view(), g2->view()});
  if (!mlp) return unexpected<error>(mlp.error());
  const moe_layer_options o{
      .hidden = H, .max_tokens = Tn, .router = {.num_experts = E, .topk = s.topk}};
  auto layer = Layer::make(x, o, *comms, dropless{}, std::move(*mlp));
  if (!layer) return unexpected<error>(layer.error());
  // The router weight: the identity on the first E columns; the tokens: 4 in their experts'
  // columns, 0 in the other first E, a small value elsewhere.
  std::vector<T> w(static_cast<std::size_t>(E) * H, T(0.0f)), xs(static_cast<std::size_t>(Tn) * H);
  for (int e = 0; e < E; ++e) w[static_cast<std::size_t>(e) * H + e] = T(1.0f);
  for (int t = 0; t < Tn; ++t)
    for (int h = 0; h < H; ++h)
      xs[static_cast<std::size_t>(t) * H + h] =
          T(h < E ? 0.0f : 0.01f * static_cast<float>((t + h) % 7));
  for (std::size_t p = 0; p < idx.size(); ++p)
    xs[(p / static_cast<std::size_t>(s.topk)) * H + static_cast<std::size_t>(idx[p])] = T(4.0f);
  auto dw = filled<float>(x, E, H, 0.0f);
  auto wd = exec_buffer<T, cuda_exec>::make(x, E, H);
  auto xd = exec_buffer<T, cuda_exec>::make(x, Tn, H);
  auto out = filled<T>(x, Tn, H, T(0.0f));
  auto dout = filled<T>(x, Tn, H, T(0.01f));
  auto dx = filled<T>(x, Tn, H, T(0.0f));
  if (!dw || !wd || !xd || !out || !dout || !dx)
    return make_error(errc::backend_error, "bench-layer: allocating the step's buffers failed");
  if (auto st = first_error({x.copy(row_view<const T>(w.data(), E, H), wd->view()),
                             x.copy(row_view<const T>(xs.data(), Tn, H), xd->view())});
      !st)
    return unexpected<error>(st.error());
  if (auto st = layer->bind_parameters({.router_weight = wd->view(), .router_grad = dw->view()});
      !st)
    return unexpected<error>(st.error());
  const auto fwd = [&]() -> status {
    auto r = layer->forward(x, xd->cview(), {}, out->view());
    return r ? status{} : status(unexpected<error>(r.error()));
  };
  const auto fwdbwd = [&]() -> status {
    if (auto st = fwd(); !st) return st;
    return layer->backward(x, dout->cview(), 1.0f, dx->view());
  };
  std::optional<error> last;
  times t;
  t.fwd = median_seconds(x.stream(), fwd, last);
  t.fwdbwd = median_seconds(x.stream(), fwdbwd, last);
  if (last) return unexpected<error>(*last);
  if constexpr (std::is_same_v<Layer, fast_layer>) {  // one step on the clock
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    clocked::gemm_clock::marks.clear();
    clocked::gemm_clock::on = true;
    cudaEventRecord(a, x.stream());
    keep(last, fwdbwd());
    cudaEventRecord(b, x.stream());
    clocked::gemm_clock::on = false;
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.clocked = ms * 1e-3;
    for (const auto& m : clocked::gemm_clock::marks) {
      float g = 0;
      cudaEventElapsedTime(&g, m.a, m.b);
      (m.kind == gemm_kind::router ? t.router_gemms : t.expert_gemms) += g * 1e-3;
      cudaEventDestroy(m.a);
      cudaEventDestroy(m.b);
    }
    clocked::gemm_clock::marks.clear();
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    if (last) return unexpected<error>(*last);
  }
  // The routing was the intended one: every expert's rows as counted.
  if (auto st = layer->device_status(x); !st) return unexpected<error>(st.error());
  return t;
}

// The six dense cuBLAS GEMMs of the experts over M = T k rows: forward (the first two) and
// forward + backward (all six).
expected<times> time_dense(cuda_exec& x, const shape& s) {
  const long long M = static_cast<long long>(s.tokens) * s.topk;
  const int H = s.hidden, F2 = 2 * s.ffn, Fh = s.ffn;
  struct gemm {
    bool wgrad;
    int m, n, k;  // rows_are_m: [M, k] x [k, n]; rows_are_k: [m, M] x [M, n]
  };
  const gemm gs[6] = {{false, 0, F2, H}, {false, 0, H, Fh},  // fc1, fc2 forward
                      {false, 0, Fh, H}, {true, H, Fh, 0},   // fc2 data, weight gradient
                      {false, 0, H, F2}, {true, F2, H, 0}};  // fc1 data, weight gradient
  std::vector<long long> off{0, M};
  times t;
  for (int i = 0; i < 6; ++i) {
    const gemm& g = gs[i];
    std::optional<error> last;
    double sec = 0;
    if (!g.wgrad) {
      auto a = filled<T>(x, M, g.k, T(0.01f));
      auto b = filled<T>(x, g.n, g.k, T(0.01f));
      auto c = filled<T>(x, M, g.n, T(0.0f));
      if (!a || !b || !c) return make_error(errc::backend_error, "bench-layer: dense buffers");
      grouped_gemm_args<T, T, T> args{.grouping = k::gemm_grouping::rows_are_m,
                                      .groups = 1,
                                      .n = g.n,
                                      .k = g.k,
                                      .host_offsets = off,
                                      .a = {a->view().data(), g.k, 1, 0},
                                      .b = {b->view().data(), 1, g.k, 0},
                                      .c = {c->view().data(), g.n, 1, 0}};
      cublas_dense<T, T, T> op;
      if (auto st = op.initialize(x, args, {}); !st) return unexpected<error>(st.error());
      sec = median_seconds(
          x.stream(), [&] { return op.run(x); }, last);
    } else {
      auto a = filled<T>(x, M, g.m, T(0.01f));  // dh [M, m]: A [m, M] K-major
      auto b = filled<T>(x, M, g.n, T(0.01f));
      auto c = filled<float>(x, g.m, g.n, 0.0f);
      if (!a || !b || !c) return make_error(errc::backend_error, "bench-layer: dense buffers");
      grouped_gemm_args<T, T, float> args{.grouping = k::gemm_grouping::rows_are_k,
                                          .groups = 1,
                                          .m = g.m,
                                          .n = g.n,
                                          .host_offsets = off,
                                          .a = {a->view().data(), 1, g.m, 0},
                                          .b = {b->view().data(), g.n, 1, 0},
                                          .c = {c->view().data(), g.n, 1, 0},
                                          .accumulate = true};
      cublas_dense<T, T, float> op;
      if (auto st = op.initialize(x, args, {}); !st) return unexpected<error>(st.error());
      sec = median_seconds(
          x.stream(), [&] { return op.run(x); }, last);
    }
    if (last) return unexpected<error>(*last);
    if (i < 2) t.fwd += sec;
    t.fwdbwd += sec;
  }
  return t;
}

struct table_row {
  std::string shape, routing, impl;
  double fwd_tflops, fwdbwd_tflops, fwd_ratio, fwdbwd_ratio, router_share, other_share;
};

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  std::vector<table_row> rows;
  std::vector<std::pair<std::string, times>> dense_by_shape;  // the six GEMMs' times per shape
  const auto st = run_loopback_world(1, [&](comm_t& c) -> status {
    auto x = cuda_exec::make(c.stream());
    if (!x) return unexpected<error>(x.error());
    const auto one = [&]<class Layer>(const shape& s, bool skewed, const char* impl) -> status {
      const auto counts = pair_counts(s, skewed);
      const auto idx = routing_of(s, counts);
      // The ceiling depends on the shape alone: timed once per shape, for every routing and layer.
      auto known = std::find_if(dense_by_shape.begin(), dense_by_shape.end(),
                                [&](const auto& d) { return d.first == s.name; });
      if (known == dense_by_shape.end()) {
        auto d = time_dense(*x, s);
        if (!d) return unexpected<error>(d.error());
        dense_by_shape.emplace_back(s.name, *d);
        known = std::prev(dense_by_shape.end());
      }
      const times* dense = &known->second;
      auto t = time_layer<Layer>(*x, c, s, idx);
      if (!t) return unexpected<error>(t.error());
      const double f = 6.0 * s.tokens * s.topk * static_cast<double>(s.hidden) * s.ffn;
      const double lf = f / t->fwd / 1e12, lfb = 3 * f / t->fwdbwd / 1e12;
      const double df = f / dense->fwd / 1e12, dfb = 3 * f / dense->fwdbwd / 1e12;
      const char* routing = skewed ? "skewed" : "balanced";
      // Shares of the clocked step (the SIMT layer is not on the clock: -1).
      const auto share = [&](double sec) { return t->clocked > 0 ? sec / t->clocked : -1.0; };
      std::printf(
          "{\"bench\": \"layer\", \"shape\": \"%s\", \"T\": %d, \"H\": %d, \"F\": %d, \"E\": %d, "
          "\"k\": %d, \"routing\": \"%s\", \"impl\": \"%s\", \"max_rows\": %d, \"min_rows\": %d, "
          "\"fwd_ms\": %.3f, \"fwdbwd_ms\": %.3f, \"fwd_tflops\": %.1f, \"fwdbwd_tflops\": %.1f, "
          "\"dense_fwd_tflops\": %.1f, \"dense_fwdbwd_tflops\": %.1f, \"clocked_ms\": %.3f, "
          "\"router_gemms_share\": %.4f, \"expert_gemms_share\": %.4f, \"other_share\": %.4f}\n",
          s.name, s.tokens, s.hidden, s.ffn, s.experts, s.topk, routing, impl,
          *std::max_element(counts.begin(), counts.end()),
          *std::min_element(counts.begin(), counts.end()), t->fwd * 1e3, t->fwdbwd * 1e3, lf, lfb,
          df, dfb, t->clocked * 1e3, share(t->router_gemms), share(t->expert_gemms),
          share(t->clocked - t->router_gemms - t->expert_gemms));
      std::fflush(stdout);
      rows.push_back({s.name, routing, impl, lf, lfb, lf / df, lfb / dfb, share(t->router_gemms),
                      share(t->clocked - t->router_gemms - t->expert_gemms)});
      return {};
    };
    for (const shape& s : quick ? std::span<const shape>() : std::span<const shape>(shapes))
      for (bool skewed : {false, true})
        if (auto r = one.template operator()<fast_layer>(s, skewed, "moefold"); !r) return r;
    for (bool skewed : {false, true}) {
      if (auto r = one.template operator()<fast_layer>(small_shape, skewed, "moefold"); !r)
        return r;
      if (auto r = one.template operator()<simt_layer>(small_shape, skewed, "moefold-simt"); !r)
        return r;
    }
    return x->synchronize();
  });
  if (!st[0]) {
    std::fprintf(stderr, "bench-layer: %s\n", st[0].error().message.c_str());
    return 1;
  }
  std::printf(
      "\n| shape | routing | layer | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd / dense | fwd+bwd / dense "
      "| router GEMMs | besides GEMMs |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows)
    std::printf("| %s | %s | %s | %.0f | %.0f | %.2f | %.2f | %.3f | %.3f |\n", r.shape.c_str(),
                r.routing.c_str(), r.impl.c_str(), r.fwd_tflops, r.fwdbwd_tflops, r.fwd_ratio,
                r.fwdbwd_ratio, r.router_share, r.other_share);
  return 0;
}
