// GPU test of the SIMT seam: each seam kernel on cuda_exec equals the same body on cpu_exec, on
// the same fresh random inputs, bit for bit (integer results and fixed-order float results
// alike). Without a CUDA device it exits 77, which meson counts as skipped; scripts/gpu-check.sh
// fails on that skip where a GPU exists.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <moefold/core/cpu_exec.hpp>
#include <moefold/core/cuda/cuda_launch.cuh>
#include <moefold/kernels/activation.hpp>
#include <moefold/kernels/router.hpp>
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

TEST_CASE("[kernel][small] router: cuda_exec equals cpu_exec bit for bit, every variant") {
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

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
