// all_to_all_v throughput of the device loopback (N ranks on one GPU), reported the way
// nccl-tests reports all-to-all: size = bytes each rank sends, algbw = size / time, busbw =
// algbw * (n - 1) / n. The ceiling is one cudaMemcpyAsync moving the same total bytes (all ranks'
// data) device to device; the last column is the loopback's time over that copy's.
//
//   build/benchmarks/comm/bench-comm-a2av-loopback [ranks=8] [max bytes per rank=256 MiB]
#include <moefold/comm/cuda/loopback_world.cuh>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace moefold;

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--help") == 0) {
    std::printf("usage: bench-comm-a2av-loopback [ranks=8] [max bytes per rank=256 MiB]\n");
    return 0;
  }
  // Bad arguments are refused before any GPU work (a rank count of 0 divided by zero once).
  const int n = argc > 1 ? std::atoi(argv[1]) : 8;
  const long long max_bytes = argc > 2 ? std::atoll(argv[2]) : (256ll << 20);
  if (n < 1 || n > 64 || max_bytes < 8) {
    std::fprintf(stderr,
                 "bench-comm-a2av-loopback: ranks must be 1..64 and max bytes >= 8 "
                 "(got %s, %s)\n",
                 argc > 1 ? argv[1] : "8", argc > 2 ? argv[2] : "default");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 77;
  }
  std::printf("# moefold all_to_all_v, device loopback, %d ranks on one GPU, float32\n", n);
  std::printf("# %12s %12s %10s %10s %10s %10s %10s\n", "size(B)", "count", "time(us)", "algbw",
              "busbw", "memcpy(us)", "ratio");
  bool failed = false;
  for (long long bytes = 1024ll * n; bytes <= max_bytes; bytes *= 4) {
    const int per_peer = static_cast<int>(bytes / (static_cast<long long>(sizeof(float)) * n));
    const std::size_t count = static_cast<std::size_t>(per_peer) * static_cast<std::size_t>(n);
    const int iters = bytes <= (1 << 20) ? 100 : 20;
    std::vector<double> seconds(static_cast<std::size_t>(n), 0.0);
    auto st = run_loopback_world(n, [&](loopback_communicator& c) -> status {
      float *send = nullptr, *recv = nullptr;
      cudaMalloc(&send, count * sizeof(float));
      cudaMalloc(&recv, count * sizeof(float));
      const std::vector<int> counts(static_cast<std::size_t>(n), per_peer);
      auto step = [&] {
        return c.all_to_all_v<float>(std::span<const float>(send, count), counts,
                                     std::span<float>(recv, count), counts);
      };
      // Warm-up, a synchronized start, the timed calls, a drained stream.
      auto timed = [&]() -> status {
        for (int i = 0; i < 3; ++i)
          if (auto ok = step(); !ok) return ok;
        if (auto ok = c.barrier(); !ok) return ok;
        if (auto ok = c.synchronize(); !ok) return ok;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i)
          if (auto ok = step(); !ok) return ok;
        auto ok = c.synchronize();
        seconds[static_cast<std::size_t>(c.rank())] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
        return ok;
      };
      auto s = timed();
      cudaFree(send);
      cudaFree(recv);
      return s;
    });
    for (const auto& s : st)
      if (!s) {
        std::printf("# ERROR: %s\n", s.error().message.c_str());
        failed = true;
      }
    // The ceiling: the same total volume in one device-to-device copy.
    const std::size_t total = count * sizeof(float) * static_cast<std::size_t>(n);
    void *a = nullptr, *b = nullptr;
    cudaMalloc(&a, total);
    cudaMalloc(&b, total);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpy(b, a, total, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) cudaMemcpyAsync(b, a, total, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    const double t = *std::max_element(seconds.begin(), seconds.end());
    const double t_copy = ms / 1e3 / iters;
    const double size = static_cast<double>(count * sizeof(float));
    const double algbw = size / t / 1e9, busbw = algbw * (n - 1) / n;
    std::printf("  %12.0f %12zu %10.1f %10.3f %10.3f %10.1f %10.2f\n", size, count, t * 1e6, algbw,
                busbw, t_copy * 1e6, t / t_copy);
  }
  return failed ? 1 : 0;
}
