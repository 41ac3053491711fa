// GPU test of the SIMT seam: each seam kernel on cuda_exec equals the same body on cpu_exec, on
// the same fresh random inputs, bit for bit (integer results and fixed-order float results
// alike). Without a CUDA device it exits 77, which meson counts as skipped; scripts/gpu-check.sh
// fails on that skip where a GPU exists.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <moefold/core/cpu_exec.hpp>
#include <moefold/core/cuda/cuda_launch.cuh>
#include <moefold/kernels/activation.hpp>
#include <moefold/kernels/capacity.hpp>
#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_block.hpp>
#include <numeric>
#include <random>
#include <vector>

#include "../../support/simt_test_sizes.hpp"
#include "seam_kernels.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

//! A device copy of a host vector, freed at scope exit.
template <class T>
struct device_vec {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_vec(const std::vector<T>& h) : n(h.size()) {
    REQUIRE(cudaMalloc(&p, sizeof(T) * (n ? n : 1)) == cudaSuccess);
    REQUIRE(cudaMemcpy(p, h.data(), sizeof(T) * n, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~device_vec() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    REQUIRE(cudaMemcpy(h.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(T) * a.size()) == 0;
}

//! Runs `make(ptrs...)` on both executors over copies of `outs` (poisoned), returns both results.
template <class T, class Make>
std::pair<std::vector<T>, std::vector<T>> both(std::size_t out_size, launch_grid g, Make make) {
  std::vector<T> cpu(out_size);
  std::memset(cpu.data(), 0xFF, sizeof(T) * out_size);
  device_vec<T> dev(cpu);
  REQUIRE(launch(cpu_exec{test::simt_seed()}, g, make(cpu.data())));
  REQUIRE(launch(cuda_exec{nullptr}, g, make(dev.p)));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  return {cpu, dev.host()};
}

}  // namespace

TEST_CASE("[kernel][small] shuffles and ballots: cuda_exec equals cpu_exec") {
  const auto [cpu, gpu] = both<unsigned>(3 * 64 * 7, launch_grid{.blocks = 3},
                                         [](unsigned* o) { return shuffle_kernel{o}; });
  CHECK(same_bits(cpu, gpu));
}

TEST_CASE("[kernel][small] warp sums and block scans: cuda_exec equals cpu_exec bitwise") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937 rng(static_cast<unsigned>(seed));
  std::normal_distribution<float> d(0.0f, 1.0f);
  constexpr int threads = 256, blocks = 5, n = threads * blocks;
  std::vector<float> in(n);
  for (auto& v : in) v = d(rng);
  device_vec<float> din(in);
  using K = scan_kernel<threads, float>;
  const launch_grid g{.blocks = blocks,
                      .smem_bytes = sizeof(float) * kernels::simt::block_scan_scratch<K>};
  std::vector<float> ex(n), tot(n), ws(n);
  REQUIRE(launch(cpu_exec{seed}, g, K{in.data(), ex.data(), tot.data(), ws.data()}));
  device_vec<float> dex(ex), dtot(tot), dws(ws);
  REQUIRE(launch(cuda_exec{nullptr}, g, K{din.p, dex.p, dtot.p, dws.p}));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(same_bits(ex, dex.host()));
  CHECK(same_bits(tot, dtot.host()));
  CHECK(same_bits(ws, dws.host()));
}

TEST_CASE("[kernel][small] atomic histogram: cuda_exec equals cpu_exec") {
  std::mt19937 rng(static_cast<unsigned>(test::simt_seed()));
  const int n = 100000, bins = 256;
  std::vector<int> ids(n);
  for (auto& v : ids) v = static_cast<int>(rng() % bins);
  device_vec<int> dids(ids);
  std::vector<int> zero(bins, 0), cpu = zero;
  device_vec<int> dcounts(zero);
  const launch_grid g{.blocks = 40, .smem_bytes = sizeof(int) * bins};
  REQUIRE(launch(cpu_exec{1}, g, histogram_kernel{ids.data(), n, bins, cpu.data()}));
  REQUIRE(launch(cuda_exec{nullptr}, g, histogram_kernel{dids.p, n, bins, dcounts.p}));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(cpu == dcounts.host());
}

TEST_CASE("[kernel][small] moefold's exp, log, sqrt, bf16 and fma: the same bits on the GPU") {
  std::vector<float> in;
  for (std::uint64_t b = 0; b < 0x100000000ull; b += 65537) {
    const auto u = static_cast<std::uint32_t>(b);
    float x;
    std::memcpy(&x, &u, 4);
    in.push_back(x);
  }
  const int n = static_cast<int>(in.size());
  device_vec<float> din(in);
  std::vector<float> cpu(5 * in.size());
  std::memset(cpu.data(), 0xFF, sizeof(float) * cpu.size());
  device_vec<float> dout(cpu);
  const launch_grid g{.blocks = 64};
  REQUIRE(launch(cpu_exec{1}, g, math_kernel{in.data(), cpu.data(), n}));
  REQUIRE(launch(cuda_exec{nullptr}, g, math_kernel{din.p, dout.p, n}));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const auto gpu = dout.host();
  int differ[5] = {};
  for (std::size_t i = 0; i < cpu.size(); ++i)
    if (std::memcmp(&cpu[i], &gpu[i], sizeof(float)) != 0) ++differ[i % 5];
  MESSAGE("values " << n << "; differing exp " << differ[0] << ", log " << differ[1] << ", sqrt "
                    << differ[2] << ", bf16 " << differ[3] << ", fma " << differ[4]);
  for (int k = 0; k < 5; ++k) CHECK(differ[k] == 0);
}

TEST_CASE("[kernel][small] router forward and backward: cuda_exec equals cpu_exec bit for bit") {
  namespace k = moefold::kernels;
  std::mt19937 rng(static_cast<unsigned>(test::simt_seed()));
  std::normal_distribution<float> d(0.0f, 2.0f);
  struct v {
    k::router_score score;
    bool pre;
    int groups, group_topk;
    bool bias, scale;
  };
  const v variants[] = {{k::router_score::softmax, true, 0, 0, false, false},
                        {k::router_score::softmax, false, 0, 0, false, true},
                        {k::router_score::sigmoid, false, 0, 0, true, true},
                        {k::router_score::sigmoid, false, 8, 4, true, false},
                        {k::router_score::sqrt_softplus, false, 0, 0, false, false}};
  const int N = 200, E = 256, K = 8;  // the CPU executor side costs about 20 ms per token
  std::vector<float> logits(N * E), bias(E);
  for (auto& x : logits) x = d(rng);
  for (auto& x : bias) x = 0.1f * d(rng);
  device_vec<float> dl(logits), db(bias);
  for (const auto& w : variants) {
    std::vector<int> idx(N * K, -7);
    std::vector<float> probs(N * K, -7.0f);
    device_vec<int> didx(idx);
    device_vec<float> dprobs(probs);
    auto make = [&](const float* l, const float* b, int* i, float* p) {
      return k::router_topk_kernel{.logits = l,
                                   .num_tokens = N,
                                   .num_experts = E,
                                   .topk = K,
                                   .score = w.score,
                                   .pre_softmax = w.pre,
                                   .num_groups = w.groups,
                                   .group_topk = w.group_topk,
                                   .expert_bias = w.bias ? b : nullptr,
                                   .scale = w.scale,
                                   .scaling_factor = 2.5f,
                                   .indices = i,
                                   .probs = p};
    };
    REQUIRE(launch(cpu_exec{1}, launch_grid{.blocks = 8},
                   make(logits.data(), bias.data(), idx.data(), probs.data())));
    REQUIRE(
        launch(cuda_exec{nullptr}, launch_grid{.blocks = 50}, make(dl.p, db.p, didx.p, dprobs.p)));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(idx == didx.host());
    CHECK(same_bits(probs, dprobs.host()));
    // The backward over the CPU's selection, on both executors.
    std::vector<float> grad(N * K), dl_cpu(N * E, -7.0f);
    for (auto& x : grad) x = d(rng);
    device_vec<float> dgrad(grad), dl_gpu(dl_cpu);
    device_vec<int> dsel(idx);
    auto back = [&](const float* l, const int* i, const float* g, float* out) {
      return k::router_backward_kernel{.logits = l,
                                       .indices = i,
                                       .dprobs = g,
                                       .num_tokens = N,
                                       .num_experts = E,
                                       .topk = K,
                                       .score = w.score,
                                       .pre_softmax = w.pre,
                                       .scale = w.scale,
                                       .scaling_factor = 2.5f,
                                       .dlogits = out};
    };
    REQUIRE(launch(cpu_exec{1}, launch_grid{.blocks = 8},
                   back(logits.data(), idx.data(), grad.data(), dl_cpu.data())));
    REQUIRE(launch(cuda_exec{nullptr}, launch_grid{.blocks = 50},
                   back(dl.p, dsel.p, dgrad.p, dl_gpu.p)));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(same_bits(dl_cpu, dl_gpu.host()));
  }
}

TEST_CASE("[kernel][small] router, a block per token (E 1024): cuda_exec equals cpu_exec") {
  namespace k = moefold::kernels;
  std::mt19937 rng(static_cast<unsigned>(test::simt_seed()));
  std::normal_distribution<float> d(0.0f, 2.0f);
  const int N = 24, E = 1024, K = 8;  // the CPU executor side costs about 50 ms per token
  std::vector<float> logits(N * E), bias(E);
  for (auto& x : logits) x = d(rng);
  for (auto& x : bias) x = 0.1f * d(rng);
  device_vec<float> dl(logits), db(bias);
  const k::router_score scores[] = {k::router_score::softmax, k::router_score::softmax,
                                    k::router_score::sigmoid, k::router_score::sqrt_softplus};
  for (int v = 0; v < 4; ++v) {
    CAPTURE(v);
    std::vector<int> idx(N * K, -7);
    std::vector<float> probs(N * K, -7.0f);
    device_vec<int> didx(idx);
    device_vec<float> dprobs(probs);
    auto make = [&](const float* l, const float* b, int* i, float* p) {
      return k::router_topk_block_kernel{.logits = l,
                                         .num_tokens = N,
                                         .num_experts = E,
                                         .topk = K,
                                         .score = scores[v],
                                         .pre_softmax = v == 0,
                                         .num_groups = v == 2 ? 8 : 0,
                                         .group_topk = v == 2 ? 4 : 0,
                                         .expert_bias = v == 2 ? b : nullptr,
                                         .scale = v == 2,
                                         .scaling_factor = 2.5f,
                                         .indices = i,
                                         .probs = p};
    };
    const launch_grid g{.blocks = 8, .smem_bytes = k::router_topk_block_kernel::smem_bytes};
    REQUIRE(launch(cpu_exec{1}, g, make(logits.data(), bias.data(), idx.data(), probs.data())));
    REQUIRE(launch(cuda_exec{nullptr}, g, make(dl.p, db.p, didx.p, dprobs.p)));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(idx == didx.host());
    CHECK(same_bits(probs, dprobs.host()));
  }
}

TEST_CASE("[kernel][small] activations forward and backward: cuda_exec equals cpu_exec bitwise") {
  namespace k = moefold::kernels;
  std::mt19937 rng(static_cast<unsigned>(test::simt_seed()));
  std::normal_distribution<float> d(0.0f, 4.0f);
  const int rows = 37, width = 136;  // F1 = 2 width for the gated forms
  std::vector<float> a(rows * 2 * width), dh(rows * width), p(rows);
  for (auto& x : a) x = d(rng);
  for (auto& x : dh) x = d(rng);
  for (auto& x : p) x = std::fabs(d(rng)) / 4.0f;
  std::vector<bfloat16> ab(a.begin(), a.end()), dhb(dh.begin(), dh.end());
  device_vec<float> da_(a), ddh(dh), dp(p);
  device_vec<bfloat16> dab(ab), ddhb(dhb);
  const activation acts[] = {activation::swiglu, activation::geglu, activation::gelu,
                             activation::silu,   activation::relu,  activation::squared_relu};
  for (activation act : acts) {
    CAPTURE(to_string(act));
    const int f1 = is_gated(act) ? 2 * width : width;
    // fp32 with probabilities (forward output, then backward input gradient and dprobs packed
    // into one buffer: [rows, width] | [rows, f1] | [rows]).
    auto f32 = [&](const float* a_, const float* dh_, const float* p_) {
      return [=](float* out) {
        return std::pair{k::activation_forward_kernel<float>{.act = act,
                                                             .a = {a_, f1},
                                                             .probs = p_,
                                                             .h = {out, width},
                                                             .rows = rows,
                                                             .width = width},
                         k::activation_backward_kernel<float>{.act = act,
                                                              .a = {a_, f1},
                                                              .dh = {dh_, width},
                                                              .probs = p_,
                                                              .da = {out + rows * width, f1},
                                                              .dprobs = out + rows * (width + f1),
                                                              .rows = rows,
                                                              .width = width}};
      };
    };
    const std::size_t n = static_cast<std::size_t>(rows) * (width + f1 + 1);
    std::vector<float> cpu(n);
    std::memset(cpu.data(), 0xFF, sizeof(float) * n);
    device_vec<float> gpu(cpu);
    const auto [cf, cb] = f32(a.data(), dh.data(), p.data())(cpu.data());
    const auto [gf, gb] = f32(da_.p, ddh.p, dp.p)(gpu.p);
    REQUIRE(launch(cpu_exec{3}, launch_grid{.blocks = 4}, cf));
    REQUIRE(launch(cpu_exec{3}, launch_grid{.blocks = 4}, cb));
    REQUIRE(launch(cuda_exec{nullptr}, launch_grid{.blocks = 4}, gf));
    REQUIRE(launch(cuda_exec{nullptr}, launch_grid{.blocks = 4}, gb));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(same_bits(cpu, gpu.host()));
    // bf16 rows without probabilities.
    std::vector<bfloat16> cpub(static_cast<std::size_t>(rows) * (width + f1));
    std::memset(static_cast<void*>(cpub.data()), 0xFF, sizeof(bfloat16) * cpub.size());
    device_vec<bfloat16> gpub(cpub);
    auto b16 = [&](const bfloat16* a_, const bfloat16* dh_, bfloat16* out) {
      return std::pair{
          k::activation_forward_kernel<bfloat16, float>{.act = act,
                                                        .a = {a_, f1},
                                                        .probs = nullptr,
                                                        .h = {out, width},
                                                        .rows = rows,
                                                        .width = width},
          k::activation_backward_kernel<bfloat16, float>{.act = act,
                                                         .a = {a_, f1},
                                                         .dh = {dh_, width},
                                                         .probs = nullptr,
                                                         .da = {out + rows * width, f1},
                                                         .dprobs = nullptr,
                                                         .rows = rows,
                                                         .width = width}};
    };
    const auto [cbf, cbb] = b16(ab.data(), dhb.data(), cpub.data());
    const auto [gbf, gbb] = b16(dab.p, ddhb.p, gpub.p);
    REQUIRE(launch(cpu_exec{3}, launch_grid{.blocks = 4}, cbf));
    REQUIRE(launch(cpu_exec{3}, launch_grid{.blocks = 4}, cbb));
    REQUIRE(launch(cuda_exec{nullptr}, launch_grid{.blocks = 4}, gbf));
    REQUIRE(launch(cuda_exec{nullptr}, launch_grid{.blocks = 4}, gbb));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(same_bits(cpub, gpub.host()));
  }
}

TEST_CASE("[kernel][small] capacity keep decision: cuda_exec equals cpu_exec") {
  namespace k = moefold::kernels;
  std::mt19937 rng(static_cast<unsigned>(test::simt_seed()));
  const int N = 300, E = 64, K = 8, C = 30;  // C: capacity factor 0.8
  std::vector<int> expert, ids(E), offsets(E + 1, 0);
  std::vector<float> probs;
  std::iota(ids.begin(), ids.end(), 0);
  for (int t = 0; t < N; ++t) {  // k distinct experts, all among 0-15: the rest get fillers
    std::shuffle(ids.begin(), ids.end(), rng);
    std::stable_partition(ids.begin(), ids.end(), [](int e) { return e < 16; });
    for (int i = 0; i < K; ++i) {
      expert.push_back(ids[i]);
      probs.push_back(static_cast<float>(rng() % 8) / 8.0f);  // ties that order must break
    }
  }
  for (int e : expert) ++offsets[e + 1];
  std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
  std::vector<long long> order(N), by_order(N);
  std::iota(order.begin(), order.end(), 0LL);
  std::shuffle(order.begin(), order.end(), rng);
  for (int t = 0; t < N; ++t) by_order[order[t]] = t;
  device_vec<int> d_expert(expert), d_offsets(offsets);
  device_vec<float> d_probs(probs);
  device_vec<long long> d_order(order), d_by_order(by_order);
  for (int combo = 0; combo < 4; ++combo) {
    const bool by_probs = combo % 2 == 0, with_order = combo >= 2;
    CAPTURE(by_probs);
    CAPTURE(with_order);
    const long long first = with_order ? 100 : 0, count = with_order ? 150 : N;
    // Outputs: keep [N K] | filler [count E] as bytes; routed | dropped | padded [E] | scratch.
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(N * K + count * E), 0xEE);
    std::vector<int> ints(static_cast<std::size_t>(3 * E + N * K), -5);
    std::vector<long long> totals(2, -3);
    device_vec<std::uint8_t> d_bytes(bytes);
    device_vec<int> d_ints(ints);
    device_vec<long long> d_totals(totals);
    auto args = [&](const int* ex, const float* pr, const long long* ord, const long long* bo,
                    const int* off, std::uint8_t* b, int* in) {
      return k::keep_args<float>{.expert = ex,
                                 .probs = pr,
                                 .order = with_order ? ord : nullptr,
                                 .by_order = with_order ? bo : nullptr,
                                 .offsets = off,
                                 .scratch = in + 3 * E,
                                 .num_tokens = N,
                                 .topk = K,
                                 .num_experts = E,
                                 .capacity = C,
                                 .by = by_probs ? k::keep_by::probs : k::keep_by::position,
                                 .pad = true,
                                 .first = first,
                                 .count = count,
                                 .keep = b,
                                 .routed = in,
                                 .dropped = in + E,
                                 .padded = in + 2 * E,
                                 .filler_map = b + N * K};
    };
    auto run = [&](auto exec, const k::keep_args<float>& a, long long* tot) {
      REQUIRE(launch(exec, launch_grid{.blocks = 1}, k::expert_lists_kernel<float>{a}));
      REQUIRE(launch(exec, launch_grid{.blocks = 4}, k::keep_rank_kernel<float>{a}));
      REQUIRE(launch(exec,
                     launch_grid{.blocks = 1, .smem_bytes = k::drop_totals_kernel::smem_bytes},
                     k::drop_totals_kernel{.keep = a.keep,
                                           .dropped = a.dropped,
                                           .topk = K,
                                           .num_experts = E,
                                           .first = first,
                                           .count = count,
                                           .totals = tot}));
    };
    run(cpu_exec{5},
        args(expert.data(), probs.data(), order.data(), by_order.data(), offsets.data(),
             bytes.data(), ints.data()),
        totals.data());
    run(cuda_exec{nullptr},
        args(d_expert.p, d_probs.p, d_order.p, d_by_order.p, d_offsets.p, d_bytes.p, d_ints.p),
        d_totals.p);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(bytes == d_bytes.host());
    CHECK(ints == d_ints.host());
    CHECK(totals == d_totals.host());
    CHECK(totals[0] > 0);  // something was dropped
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
