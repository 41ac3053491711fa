// The MoE layer on one GPU against its GEMMs (docs/performance.md, "The layer against its GEMMs"):
// moefold's layer in bf16 (cuda_exec, EP = ETP = 1: router, permute, the experts' grouped GEMMs,
// un-permute), forward and forward + backward, timed from the router's input to the layer's
// output, on the three shapes of gpu-baselines at 8,192 tokens, with balanced routing and skewed
// routing (one expert at 4x the mean, a quarter of the experts at 5% of it, the rest even).
// The routing is set by the input: token t's chosen experts hold 4 in their columns of x and the
// router weight is the identity on the first E columns, so the router picks exactly them; the
// PyTorch peer (benchmarks/layer/torch_peer.py) builds the same tokens and routes them through the
// same gating. In the same run:
//   - the ceiling: the six dense cuBLAS GEMMs of the experts over the same total rows (fc1 and fc2
//     forward, their data and weight gradients; the forward's two for the forward);
//   - the layer on each backend of its experts' GEMMs: "moefold" (cuda_exec's default policy,
//     dropless: CUTLASS's grouped GEMM), "moefold-cublas" (dropless, a cuBLAS call per expert),
//     "moefold-pad" (pad mode at capacity factor 1: one strided cuBLAS batch; the skewed expert's
//     excess is dropped and only kept pairs count), and "moefold-simt" (the portable SIMT kernel)
//     at a small shape only, beside the others at that shape;
//   - where one forward + backward of each of the first three goes: this program wraps the
//     layer's router, dispatcher and experts and every GEMM in CUDA events (clocked::), for one
//     step: the router's GEMMs, the experts' GEMMs, the router's top-k, the dispatch, the experts
//     besides their GEMMs (activation, probabilities), the combine, and the rest (losses, drop
//     policy, copies, zeroing, host gaps), each as a share of that step.
// FLOPs: 6 T k H F forward on the kept rows (dropless: all T k), 3x that for forward + backward.
// Each time: the median of 10 event-timed steps after 3 warm-ups (the first sizes every buffer).
// Output: one JSON object per line ("bench": "layer"), then two tables: TFLOP/s and ratios, and
// the shares of a step.
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

// This program's clock: CUDA events around each step of the layer and each GEMM, on for one
// forward + backward of each layer (the layer's router, dispatcher and experts are this program's
// wrappers of moefold's, below; the GEMMs run through the policy below). The spans nest (the
// experts' GEMMs inside "experts"); what no span covers is the rest of the layer: the
// load-balancing bookkeeping, the drop policy, copies, zeroing, and any gap the host leaves.
struct clock {
  static inline bool on = false;
  // The experts' grouped GEMMs on cuBLAS (a cublasGemmEx per expert, cublas_dense) instead of
  // their default backends (cutlass_sm90 dropless, cublas_strided in pad mode): the layer on that
  // backend, without a second layer type to compile.
  static inline bool cublas_only = false;
  struct mark {
    const char* step;
    cudaEvent_t a, b;
  };
  static inline std::vector<mark> marks;
  template <class F>
  static auto span(cudaStream_t s, const char* step, F&& f) -> decltype(f()) {
    if (!on) return f();
    mark m{step, nullptr, nullptr};
    cudaEventCreate(&m.a);
    cudaEventCreate(&m.b);
    cudaEventRecord(m.a, s);
    auto r = f();
    cudaEventRecord(m.b, s);
    marks.push_back(m);
    return r;
  }
};

// The steps the clock names (a pointer each: marks compare by address).
inline constexpr const char* router_gemms = "router_gemms";  // logits, dx, dW
inline constexpr const char* router_topk = "router_topk";    // score function, top-k, its backward
inline constexpr const char* dispatch = "dispatch";          // permute, exchange; its backward
inline constexpr const char* experts = "experts";            // everything the experts run
inline constexpr const char* expert_gemms = "expert_gemms";  // fc1, fc2, their gradients
inline constexpr const char* combine = "combine";            // un-permute, weighting; its backward

// Policy P's backend, or on clock::cublas_only D's (the policy's cuBLAS chain), chosen at each
// initialize (mlp_experts initializes every GEMM before it runs it).
template <class P, class D>
class either_gemm {
 public:
  using args_type = typename P::args_type;
  static constexpr const char* name = P::name;
  template <class Exec>
  static constexpr bool runs_on = P::template runs_on<Exec>&& D::template runs_on<Exec>;
  [[nodiscard]] static status can_implement(const args_type& a) {
    return clock::cublas_only ? D::can_implement(a) : P::can_implement(a);
  }
  [[nodiscard]] static std::size_t workspace_bytes(const args_type& a) {
    return std::max(P::workspace_bytes(a), D::workspace_bytes(a));
  }
  template <class Exec>
  [[nodiscard]] status initialize(Exec& x, const args_type& a, std::span<std::byte> w) {
    dense_ = clock::cublas_only;
    return dense_ ? d_.initialize(x, a, w) : p_.initialize(x, a, w);
  }
  template <class Exec>
  [[nodiscard]] status run(Exec& x) const {
    return dense_ ? d_.run(x) : p_.run(x);
  }
  // What ran, for the experts' notices (a backend that declined is said on stderr).
  [[nodiscard]] bool used_fallback() const noexcept {
    return dense_ ? d_.used_fallback() : p_.used_fallback();
  }
  [[nodiscard]] const char* ran_on() const noexcept { return dense_ ? d_.ran_on() : p_.ran_on(); }
  [[nodiscard]] std::string fallback_chain() const {
    return dense_ ? d_.fallback_chain() : p_.fallback_chain();
  }

 private:
  P p_{};
  D d_{};
  bool dense_ = false;
};

template <gemm_kind K, class G>
struct timed_gemm : G {
  template <execution_context Exec>
  [[nodiscard]] status run(Exec& x) const {
    return clock::span(x.stream(), K == gemm_kind::router ? router_gemms : expert_gemms,
                       [&] { return G::run(x); });
  }
};

// cuda_exec's default policy (tensor_core_gemms), each GEMM on the clock, the experts' switchable
// to the policy's cuBLAS chain.
using base_gemms = default_gemms<cuda_exec>;
struct bench_gemms {
  template <gemm_kind K, gemm_mode M, class A, class B, class C>
  using backend = timed_gemm<K, either_gemm<typename base_gemms::template backend<K, M, A, B, C>,
                                            typename base_gemms::template dense<K, M, A, B, C>>>;
};

// moefold's router, its routing and routing backward on the clock (the layer runs the gating
// GEMMs itself, on the router's policy).
template <class Base>
struct timed_router : Base {
  using base_type = Base;
  using space = typename cuda_exec::memory_space;
  using R = typename Base::value_type;
  explicit timed_router(Base&& b) : Base(std::move(b)) {}
  [[nodiscard]] status route(cuda_exec& x, const router_route_args<R, space>& f) const {
    return clock::span(x.stream(), router_topk, [&] { return Base::route(x, f); });
  }
  [[nodiscard]] status backward(cuda_exec& x, const router_backward_args<R, space>& b) const {
    return clock::span(x.stream(), router_topk, [&] { return Base::backward(x, b); });
  }
};

// moefold's dispatcher, each call on the clock.
template <class Base>
struct timed_dispatcher : Base {
  explicit timed_dispatcher(Base&& b) : Base(std::move(b)) {}
  [[nodiscard]] static expected<timed_dispatcher> make(const dispatch_shape& s) {
    auto d = Base::make(s);
    if (!d) return unexpected<error>(d.error());
    return timed_dispatcher(std::move(*d));
  }
  template <class... A>
  [[nodiscard]] auto dispatch(cuda_exec& x, A&&... a)
      -> decltype(std::declval<Base&>().dispatch(x, std::forward<A>(a)...)) {
    return clock::span(x.stream(), clocked::dispatch,
                       [&] { return Base::dispatch(x, std::forward<A>(a)...); });
  }
  template <class... A>
  [[nodiscard]] auto dispatch_backward(cuda_exec& x, A&&... a)
      -> decltype(std::declval<Base&>().dispatch_backward(x, std::forward<A>(a)...)) {
    return clock::span(x.stream(), clocked::dispatch,
                       [&] { return Base::dispatch_backward(x, std::forward<A>(a)...); });
  }
  template <class... A>
  [[nodiscard]] auto combine(cuda_exec& x, A&&... a)
      -> decltype(std::declval<Base&>().combine(x, std::forward<A>(a)...)) {
    return clock::span(x.stream(), clocked::combine,
                       [&] { return Base::combine(x, std::forward<A>(a)...); });
  }
  template <class... A>
  [[nodiscard]] auto combine_backward(cuda_exec& x, A&&... a)
      -> decltype(std::declval<Base&>().combine_backward(x, std::forward<A>(a)...)) {
    return clock::span(x.stream(), clocked::combine,
                       [&] { return Base::combine_backward(x, std::forward<A>(a)...); });
  }
};

// moefold's experts, forward and backward on the clock.
template <class Base>
struct timed_experts : Base {
  using base_type = Base;
  explicit timed_experts(Base&& b) : Base(std::move(b)) {}
  template <class... A>
  [[nodiscard]] auto forward(cuda_exec& x, A&&... a)
      -> decltype(std::declval<Base&>().forward(x, std::forward<A>(a)...)) {
    return clock::span(x.stream(), clocked::experts,
                       [&] { return Base::forward(x, std::forward<A>(a)...); });
  }
  template <class... A>
  [[nodiscard]] auto backward(cuda_exec& x, A&&... a)
      -> decltype(std::declval<Base&>().backward(x, std::forward<A>(a)...)) {
    return clock::span(x.stream(), clocked::experts,
                       [&] { return Base::backward(x, std::forward<A>(a)...); });
  }
};
}  // namespace clocked

namespace {

using T = bfloat16;
using comm_t = loopback_communicator;

using fast_router = clocked::timed_router<topk_router<T, cuda_exec, float, clocked::bench_gemms>>;
using fast_layer =
    moe_layer<T, cuda_exec, comm_t, drop_policy_variant,
              clocked::timed_dispatcher<all_to_all_dispatcher<T, comm_t, cuda_exec, float>>,
              clocked::timed_experts<mlp_experts<T, cuda_exec, clocked::bench_gemms, float, float>>,
              fast_router>;
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
  // One forward + backward on the clock: its time and each step's (clocked:: names).
  double clocked = 0;
  std::vector<std::pair<const char*, double>> steps;
  long long kept = 0;  // pairs the experts computed (padding not counted)
  [[nodiscard]] double step(const char* name) const {
    double sec = 0;
    for (const auto& [n, v] : steps)
      if (n == name) sec += v;
    return sec;
  }
};

template <class V>
expected<exec_buffer<V, cuda_exec>> filled(cuda_exec& x, long long rows, long long width, V v) {
  auto b = exec_buffer<V, cuda_exec>::make(x, rows, width);
  if (!b) return b;
  if (auto st = x.fill<V>(b->view(), v); !st) return unexpected<error>(st.error());
  return b;
}

// One routing's tokens on the host: the router weight [E, H] is the identity on the first E
// columns; token t holds 4 in its experts' columns, 0 in the other first E, a small value
// elsewhere (so the router picks exactly idx's experts).
struct tokens {
  std::vector<T> w, xs;
};
tokens tokens_of(const shape& s, const std::vector<int>& idx) {
  const int H = s.hidden, E = s.experts, Tn = s.tokens;
  tokens r{std::vector<T>(static_cast<std::size_t>(E) * H, T(0.0f)),
           std::vector<T>(static_cast<std::size_t>(Tn) * H)};
  for (int e = 0; e < E; ++e) r.w[static_cast<std::size_t>(e) * H + e] = T(1.0f);
  for (int t = 0; t < Tn; ++t)
    for (int h = 0; h < H; ++h)
      r.xs[static_cast<std::size_t>(t) * H + h] =
          T(h < E ? 0.0f : 0.01f * static_cast<float>((t + h) % 7));
  for (std::size_t p = 0; p < idx.size(); ++p)
    r.xs[(p / static_cast<std::size_t>(s.topk)) * H + static_cast<std::size_t>(idx[p])] = T(4.0f);
  return r;
}

// A layer to time: its name in the output, its drop policy (dropless, or pad mode for
// cublas_strided) and whether the experts' GEMMs run on cuBLAS's per-expert calls.
struct variant {
  const char* impl;
  drop_policy_variant policy;
  bool cublas_only = false;
};

// The experts type under this program's clock wrapper, or the type itself.
template <class E>
struct unwrapped {
  using type = E;
};
template <class E>
requires requires { typename E::base_type; }
struct unwrapped<E> {
  using type = typename E::base_type;
};

// The layer of type Layer on shape s and the tokens `in`: forward and forward + backward.
template <class Layer>
expected<times> time_layer(cuda_exec& x, comm_t& world, const shape& s, const tokens& in,
                           const variant& v) {
  const int H = s.hidden, E = s.experts, Fh = s.ffn, Tn = s.tokens;
  constexpr bool on_clock = std::is_same_v<Layer, fast_layer>;
  clocked::clock::cublas_only = v.cublas_only;
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
  using mlp_t = typename unwrapped<experts_t>::type;
  auto mlp =
      mlp_t::make({.hidden = H, .ffn = Fh, .num_local_experts = E, .act = activation::swiglu},
                  {fc1->cview(), fc2->cview()}, {g1->view(), g2->view()});
  if (!mlp) return unexpected<error>(mlp.error());
  const moe_layer_options o{
      .hidden = H, .max_tokens = Tn, .router = {.num_experts = E, .topk = s.topk}};
  auto layer = [&]() -> expected<Layer> {
    if constexpr (on_clock) {
      auto r = fast_router::base_type::make(o.router, H);
      if (!r) return unexpected<error>(r.error());
      return Layer::make(x, o, *comms, v.policy, experts_t(std::move(*mlp)),
                         fast_router(std::move(*r)));
    } else {
      return Layer::make(x, o, *comms, v.policy, std::move(*mlp));
    }
  }();
  if (!layer) return unexpected<error>(layer.error());
  auto dw = filled<float>(x, E, H, 0.0f);
  auto wd = exec_buffer<T, cuda_exec>::make(x, E, H);
  auto xd = exec_buffer<T, cuda_exec>::make(x, Tn, H);
  auto out = filled<T>(x, Tn, H, T(0.0f));
  auto dout = filled<T>(x, Tn, H, T(0.01f));
  auto dx = filled<T>(x, Tn, H, T(0.0f));
  if (!dw || !wd || !xd || !out || !dout || !dx)
    return make_error(errc::backend_error, "bench-layer: allocating the step's buffers failed");
  if (auto st = first_error({x.copy(row_view<const T>(in.w.data(), E, H), wd->view()),
                             x.copy(row_view<const T>(in.xs.data(), Tn, H), xd->view())});
      !st)
    return unexpected<error>(st.error());
  if (auto st = layer->bind_parameters({.router_weight = wd->view(), .router_grad = dw->view()});
      !st)
    return unexpected<error>(st.error());
  typename Layer::stats_type stats{};
  const auto fwd = [&]() -> status {
    auto r = layer->forward(x, xd->cview(), {}, out->view());
    if (!r) return unexpected<error>(r.error());
    stats = *r;
    return {};
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
  if constexpr (on_clock) {  // one step on the clock
    using clocked::clock;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    clock::marks.clear();
    clock::on = true;
    cudaEventRecord(a, x.stream());
    keep(last, fwdbwd());
    cudaEventRecord(b, x.stream());
    clock::on = false;
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.clocked = ms * 1e-3;
    for (const auto& m : clock::marks) {
      float g = 0;
      cudaEventElapsedTime(&g, m.a, m.b);
      t.steps.emplace_back(m.step, g * 1e-3);
      cudaEventDestroy(m.a);
      cudaEventDestroy(m.b);
    }
    clock::marks.clear();
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    if (last) return unexpected<error>(*last);
  }
  clocked::clock::cublas_only = false;
  // The routing was the intended one (no fault), and what the experts computed: every pair but
  // the dropped (pad mode at capacity factor 1 drops the skewed expert's excess).
  if (auto st = layer->device_status(x); !st) return unexpected<error>(st.error());
  long long totals[2] = {0, 0};  // dropped pairs, tokens that lost all k
  if (stats.drop_totals.data() != nullptr &&
      cudaMemcpy(totals, stats.drop_totals.data(), sizeof totals, cudaMemcpyDeviceToHost) !=
          cudaSuccess)
    return make_error(errc::backend_error, "bench-layer: reading the drop totals failed");
  t.kept = static_cast<long long>(Tn) * s.topk - totals[0];
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
  double fwd_tflops, fwdbwd_tflops, fwd_ratio, fwdbwd_ratio;
  std::vector<std::pair<const char*, double>> shares;  // of the clocked step (clocked layers)
};

// The clocked step's parts, as shares of it: each step besides its GEMMs, the GEMMs, the rest.
std::vector<std::pair<const char*, double>> shares_of(const times& t) {
  if (t.clocked <= 0) return {};
  const double gemms = t.step(clocked::router_gemms) + t.step(clocked::expert_gemms);
  const double experts_other = t.step(clocked::experts) - t.step(clocked::expert_gemms);
  const double spans = t.step(clocked::router_gemms) + t.step(clocked::router_topk) +
                       t.step(clocked::dispatch) + t.step(clocked::experts) +
                       t.step(clocked::combine);
  const double besides = t.clocked - gemms;
  return {{"router_gemms", t.step(clocked::router_gemms) / t.clocked},
          {"expert_gemms", t.step(clocked::expert_gemms) / t.clocked},
          {"router_topk", t.step(clocked::router_topk) / t.clocked},
          {"dispatch", t.step(clocked::dispatch) / t.clocked},
          {"experts_besides_gemms", experts_other / t.clocked},
          {"combine", t.step(clocked::combine) / t.clocked},
          {"rest", (t.clocked - spans) / t.clocked},
          {"besides_gemms", besides / t.clocked}};
}

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
  // The layer on each backend of its experts' GEMMs: cutlass_sm90 (the default, dropless),
  // cuBLAS per expert (dropless), cublas_strided (pad mode: every expert at its capacity,
  // factor 1; the skewed expert's excess dropped, FLOPs on the kept pairs).
  const variant variants[] = {
      {"moefold", dropless{}},
      {"moefold-cublas", dropless{}, true},
      {"moefold-pad", sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true}},
  };
  const auto st = run_loopback_world(1, [&](comm_t& c) -> status {
    auto x = cuda_exec::make(c.stream());
    if (!x) return unexpected<error>(x.error());
    const auto one = [&]<class Layer>(const shape& s, bool skewed, const tokens& in,
                                      const std::vector<int>& counts, const variant& v) -> status {
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
      auto t = time_layer<Layer>(*x, c, s, in, v);
      if (!t) return unexpected<error>(t.error());
      const double per_pair = 6.0 * s.hidden * static_cast<double>(s.ffn);
      const double f = per_pair * static_cast<double>(t->kept);
      const double lf = f / t->fwd / 1e12, lfb = 3 * f / t->fwdbwd / 1e12;
      const double all = per_pair * s.tokens * s.topk;  // the dense GEMMs run every pair
      const double df = all / dense->fwd / 1e12, dfb = 3 * all / dense->fwdbwd / 1e12;
      const char* routing = skewed ? "skewed" : "balanced";
      const auto shares = shares_of(*t);
      std::string steps;
      for (const auto& [name, share] : shares) {
        char buf[96];
        std::snprintf(buf, sizeof buf, "%s\"%s\": %.4f", steps.empty() ? "" : ", ", name, share);
        steps += buf;
      }
      std::printf(
          "{\"bench\": \"layer\", \"shape\": \"%s\", \"T\": %d, \"H\": %d, \"F\": %d, \"E\": %d, "
          "\"k\": %d, \"routing\": \"%s\", \"impl\": \"%s\", \"max_rows\": %d, \"min_rows\": %d, "
          "\"kept_pairs\": %lld, \"fwd_ms\": %.3f, \"fwdbwd_ms\": %.3f, \"fwd_tflops\": %.1f, "
          "\"fwdbwd_tflops\": %.1f, \"dense_fwd_tflops\": %.1f, \"dense_fwdbwd_tflops\": %.1f, "
          "\"clocked_ms\": %.3f, \"steps\": {%s}}\n",
          s.name, s.tokens, s.hidden, s.ffn, s.experts, s.topk, routing, v.impl,
          *std::max_element(counts.begin(), counts.end()),
          *std::min_element(counts.begin(), counts.end()), t->kept, t->fwd * 1e3, t->fwdbwd * 1e3,
          lf, lfb, df, dfb, t->clocked * 1e3, steps.c_str());
      std::fflush(stdout);
      rows.push_back({s.name, routing, v.impl, lf, lfb, lf / df, lfb / dfb, shares});
      return {};
    };
    for (const shape& s : quick ? std::span<const shape>() : std::span<const shape>(shapes))
      for (bool skewed : {false, true}) {
        const auto counts = pair_counts(s, skewed);
        const tokens in = tokens_of(s, routing_of(s, counts));
        for (const variant& v : variants)
          if (auto r = one.template operator()<fast_layer>(s, skewed, in, counts, v); !r) return r;
      }
    for (bool skewed : {false, true}) {
      const auto counts = pair_counts(small_shape, skewed);
      const tokens in = tokens_of(small_shape, routing_of(small_shape, counts));
      for (const variant& v : variants)
        if (auto r = one.template operator()<fast_layer>(small_shape, skewed, in, counts, v); !r)
          return r;
      if (auto r = one.template operator()<simt_layer>(small_shape, skewed, in, counts,
                                                       {"moefold-simt", dropless{}});
          !r)
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
      "|\n|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows)
    std::printf("| %s | %s | %s | %.0f | %.0f | %.2f | %.2f |\n", r.shape.c_str(),
                r.routing.c_str(), r.impl.c_str(), r.fwd_tflops, r.fwdbwd_tflops, r.fwd_ratio,
                r.fwdbwd_ratio);
  // Where one forward + backward goes (goals: the router's GEMMs <= 0.03, everything besides the
  // GEMMs <= 0.10).
  std::printf(
      "\n| shape | routing | layer | router GEMMs | expert GEMMs | router top-k | dispatch | "
      "experts besides GEMMs | combine | rest | besides GEMMs |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    if (r.shares.empty()) continue;
    std::printf("| %s | %s | %s |", r.shape.c_str(), r.routing.c_str(), r.impl.c_str());
    for (const auto& [name, share] : r.shares) std::printf(" %.3f |", share);
    std::printf("\n");
  }
  return 0;
}
