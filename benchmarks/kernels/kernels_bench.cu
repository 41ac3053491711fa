// Kernel benchmarks against ceilings and peers measured in the same run (docs/performance.md):
// - permute (gather_rows_kernel) and un-permute (gather_sum_rows_kernel, k rows summed in fp32)
//   of bf16 rows, in bytes moved per second, against one cudaMemcpyAsync device to device of the
//   same number of bytes (read + written);
// - the router (router_topk_kernel and router_topk_block_kernel: scores to top-k, the logits GEMM
//   excluded) per call, for the variants benchmarks/kernels/router_peer.py times in PyTorch.
// Each time is the median of 20 event-timed launches after 3 warm-ups. Output: one JSON object
// per line (the peer script reads the router lines and prints the ratios).
//
//   build/benchmarks/kernels/bench-kernels [tokens=16384] [hidden=4096]
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>
#include <moefold/kernels/permute.hpp>
#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_block.hpp>
#include <moefold/kernels/simt/row_copy.hpp>
#include <moefold/kernels/unpermute.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace moefold;
namespace k = moefold::kernels;

namespace {

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

// The median time of f() in seconds: 3 warm-ups, then 20 launches each between two events.
template <class F>
double median_seconds(F&& f) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> t;
  for (int i = 0; i < 20; ++i) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class T>
T* device_copy(const std::vector<T>& h) {
  T* p = nullptr;
  if (!ok(cudaMalloc(&p, sizeof(T) * std::max<std::size_t>(h.size(), 1)), "cudaMalloc"))
    std::exit(1);
  if (!ok(cudaMemcpy(p, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice), "cudaMemcpy"))
    std::exit(1);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--help") {
    std::printf("usage: bench-kernels [tokens=16384] [hidden=4096]\n");
    return 0;
  }
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 16384;
  const int hidden = argc > 2 ? std::atoi(argv[2]) : 4096;
  if (tokens < 1 || hidden < 1) {
    std::fprintf(stderr, "bench-kernels: tokens and hidden must be positive integers\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 77;
  }
  const int topk = 8;
  const long long rows = static_cast<long long>(tokens) * topk;
  std::mt19937 rng(1);
  auto made = cuda_exec::make(nullptr);
  if (!made) {
    std::printf("cuda_exec::make: %s\n", made.error().message.c_str());
    return 1;
  }
  const cuda_exec& exec = *made;
  bool failed = false;

  // Permute: rows = tokens k slots, each a copy of its token's row (a random order, as the
  // sort by expert gives), bf16, H wide.
  {
    std::vector<int> index(static_cast<std::size_t>(rows));
    for (long long r = 0; r < rows; ++r) index[static_cast<std::size_t>(r)] = static_cast<int>(r);
    std::shuffle(index.begin(), index.end(), rng);
    bfloat16 *src = nullptr, *dst = nullptr;
    ok(cudaMalloc(&src, sizeof(bfloat16) * tokens * static_cast<long long>(hidden)), "cudaMalloc");
    ok(cudaMalloc(&dst, sizeof(bfloat16) * rows * hidden), "cudaMalloc");
    cudaMemset(src, 0, sizeof(bfloat16) * tokens * static_cast<long long>(hidden));
    int* d_index = device_copy(index);
    const k::gather_rows_kernel<bfloat16> g{
        .src = src,
        .src_stride = hidden,
        .src_rows = tokens,
        .index = d_index,
        .index_stride = 1,
        .divisor = topk,
        .dst = dst,
        .dst_stride = hidden,
        .rows = static_cast<int>(rows),
        .width = hidden,
        .vec16 = k::simt::rows_vec16<bfloat16>(src, hidden, hidden) &&
                 k::simt::rows_vec16<bfloat16>(dst, hidden, hidden)};
    const long long bytes = rows * hidden * static_cast<long long>(sizeof(bfloat16));
    const double t = median_seconds([&] {
      if (!launch(exec, launch_grid{.blocks = 132 * 16}, g)) failed = true;
    });
    bfloat16* scratch = nullptr;  // the copy's destination: the same bytes as the permute's
    ok(cudaMalloc(&scratch, bytes), "cudaMalloc");
    const double c =
        median_seconds([&] { cudaMemcpyAsync(scratch, dst, bytes, cudaMemcpyDeviceToDevice); });
    cudaFree(scratch);
    std::printf(
        "{\"bench\": \"permute\", \"dtype\": \"bf16\", \"rows\": %lld, \"hidden\": %d, "
        "\"seconds\": %.6e, \"bytes_per_second\": %.4e, \"copy_seconds\": %.6e, "
        "\"copy_bytes_per_second\": %.4e, \"ratio_to_copy\": %.4f}\n",
        rows, hidden, t, 2.0 * bytes / t, c, 2.0 * bytes / c, c / t);

    // Un-permute: each token sums its k rows (fp32 weights, fp32 sum, bf16 out).
    std::vector<int> slots(static_cast<std::size_t>(rows));
    for (long long r = 0; r < rows; ++r)
      slots[static_cast<std::size_t>(index[r])] = static_cast<int>(r);
    std::vector<float> w(static_cast<std::size_t>(rows), 0.125f);
    int* d_slots = device_copy(slots);
    float* d_w = device_copy(w);
    const k::gather_sum_rows_kernel<bfloat16, float, float> u{.src = dst,
                                                              .src_stride = hidden,
                                                              .src_rows = static_cast<int>(rows),
                                                              .index = d_slots,
                                                              .index_stride = topk,
                                                              .k = topk,
                                                              .weights = d_w,
                                                              .weight_stride = topk,
                                                              .dst = src,
                                                              .dst_stride = hidden,
                                                              .rows = tokens,
                                                              .width = hidden,
                                                              .vec16 = g.vec16};
    const double tu = median_seconds([&] {
      if (!launch(exec, launch_grid{.blocks = 132 * 16}, u)) failed = true;
    });
    const long long moved = bytes + static_cast<long long>(tokens) * hidden * sizeof(bfloat16);
    std::printf(
        "{\"bench\": \"unpermute\", \"dtype\": \"bf16\", \"tokens\": %d, \"k\": %d, \"hidden\": "
        "%d, \"seconds\": %.6e, \"bytes_per_second\": %.4e, \"copy_bytes_per_second\": %.4e, "
        "\"ratio_to_copy\": %.4f}\n",
        tokens, topk, hidden, tu, moved / tu, 2.0 * bytes / c, (moved / tu) / (2.0 * bytes / c));
    cudaFree(src);
    cudaFree(dst);
    cudaFree(d_index);
    cudaFree(d_slots);
    cudaFree(d_w);
  }

  // The router: the variants router_peer.py times (the names match its lines).
  struct variant {
    const char* name;
    int experts, topk;
    moefold::score_function score;
    bool pre, bias;
    int groups, group_topk;
    bool scale;
  };
  const variant variants[] = {
      {"softmax_topk_e128_k8", 128, 8, moefold::score_function::softmax, true, false, 0, 0, false},
      {"topk_softmax_e64_k6", 64, 6, moefold::score_function::softmax, false, false, 0, 0, false},
      {"sigmoid_bias_groups_e256_k8", 256, 8, moefold::score_function::sigmoid, false, true, 8, 4,
       true},
      {"softmax_topk_e512_k8", 512, 8, moefold::score_function::softmax, true, false, 0, 0, false},
  };
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (const auto& v : variants) {
    std::vector<float> logits(static_cast<std::size_t>(tokens) * v.experts), bias(v.experts);
    for (auto& x : logits) x = d(rng);
    for (auto& x : bias) x = 0.01f * d(rng);
    float* d_logits = device_copy(logits);
    float* d_bias = device_copy(bias);
    int* d_idx = nullptr;
    float* d_probs = nullptr;
    cudaMalloc(&d_idx, sizeof(int) * tokens * v.topk);
    cudaMalloc(&d_probs, sizeof(float) * tokens * v.topk);
    auto args = [&](auto kernel) {
      kernel.logits = d_logits;
      kernel.num_tokens = tokens;
      kernel.num_experts = v.experts;
      kernel.topk = v.topk;
      kernel.score = v.score;
      kernel.pre_softmax = v.pre;
      kernel.num_groups = v.groups;
      kernel.group_topk = v.group_topk;
      kernel.expert_bias = v.bias ? d_bias : nullptr;
      kernel.scale = v.scale;
      kernel.scaling_factor = 2.5f;
      kernel.indices = d_idx;
      kernel.probs = d_probs;
      return kernel;
    };
    double t = 0;
    if (v.experts <= k::router_topk_kernel::max_experts) {
      const auto kernel = args(k::router_topk_kernel{});
      t = median_seconds([&] {
        if (!launch(exec, launch_grid{.blocks = (tokens + 3) / 4}, kernel)) failed = true;
      });
    } else {
      const auto kernel = args(k::router_topk_block_kernel{});
      t = median_seconds([&] {
        if (!launch(exec,
                    launch_grid{.blocks = tokens,
                                .smem_bytes = k::router_topk_block_kernel::smem_bytes},
                    kernel))
          failed = true;
      });
    }
    std::printf(
        "{\"bench\": \"router\", \"variant\": \"%s\", \"tokens\": %d, \"experts\": %d, \"topk\": "
        "%d, \"seconds\": %.6e}\n",
        v.name, tokens, v.experts, v.topk, t);
    cudaFree(d_logits);
    cudaFree(d_bias);
    cudaFree(d_idx);
    cudaFree(d_probs);
  }
  if (!ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize")) failed = true;
  return failed ? 1 : 0;
}
