// What a launch costs on the CPU executor: blocks of 256 threads, each a block scan (barriers and
// warp shuffles), launched again and again. Built three times: bench-cpu-exec-launch, the block's
// threads as fibers switched by moefold's own x86-64 switch (the default); ...-ucontext, the same
// fibers switched by glibc's swapcontext (other machines); ...-threads, every CUDA thread on its
// own OS thread (MOEFOLD_CPU_EXEC_THREADS=1, what TSan builds ran before their fibers became TSan
// fibers). The programs' times are the ratios docs/kernels.md records.
//
//   bench-cpu-exec-launch [launches] [blocks]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/kernels/simt/block_scan.hpp>
#include <vector>

namespace {

// out[b * 256 + t] = exclusive prefix sum of in over the block.
struct scan_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "scan_kernel";
  const int* in;
  int* out;
  template <class Ctx>
  void operator()(Ctx& c) const {
    const int i = c.block() * block_threads + c.thread();
    int total = 0;
    out[i] =
        moefold::kernels::simt::block_exclusive_scan(c, in[i], c.template shared<int>(), total);
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int launches = argc > 1 ? std::atoi(argv[1]) : 50;
  const int blocks = argc > 2 ? std::atoi(argv[2]) : 4;
  if (launches < 1 || blocks < 1) {
    std::fprintf(stderr, "error: launches and blocks must be positive\n");
    return 2;
  }
  std::vector<int> in(static_cast<std::size_t>(blocks) * 256, 1), out(in.size(), -1);
  const moefold::launch_grid grid{
      .blocks = blocks,
      .smem_bytes =
          sizeof(int) *
          moefold::kernels::simt::block_scan_scratch<moefold::cpu_ctx<scan_kernel::block_threads>>};
  const scan_kernel k{in.data(), out.data()};
  if (!launch(moefold::cpu_exec{1}, grid, k)) return 1;  // warm: workers and stacks made
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < launches; ++i)
    if (!launch(moefold::cpu_exec{static_cast<std::uint64_t>(i)}, grid, k)) return 1;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < 256; ++t)
      if (out[static_cast<std::size_t>(b * 256 + t)] != t) {
        std::fprintf(stderr, "error: wrong scan at block %d thread %d\n", b, t);
        return 1;
      }
  std::printf(
      "cpu_exec (%s): %d launches of %d blocks x 256 threads (a block scan): %.3f ms per "
      "launch\n",
      MOEFOLD_CPU_EXEC_THREADS ? "OS threads"
      : MOEFOLD_CPU_FIBER_ASM  ? "fibers, own switch"
                               : "fibers, swapcontext",
      launches, blocks, ms / launches);
  return 0;
}
