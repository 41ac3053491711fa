// The negative test of the CPU executor under ThreadSanitizer: a block-wide reversal through
// shared memory whose barrier is missing (unless --with-barrier), or is only a warp's
// (--warp-sync-only: each thread reads the other warp's element, which a warp barrier does not
// order). Run by race_probe_check.py, which expects TSan to report a data race at the line
// marked RACE below without the block's barrier, and none with it.
#include <cstdio>
#include <cstring>
#include <moefold/exec/cpu_exec.hpp>
#include <vector>

namespace {

struct reverse_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "reverse_kernel";
  const float* in;
  float* out;
  bool with_barrier, warp_sync_only;
  template <class Ctx>
  void operator()(Ctx& c) const {
    float* s = c.template shared<float>();
    const int i = c.block() * block_threads + c.thread();
    s[c.thread()] = in[i];
    if (with_barrier) c.sync();
    if (warp_sync_only) c.warp_sync();
    out[i] = s[block_threads - 1 - c.thread()];  // RACE: read of another thread's write
  }
};

}  // namespace

int main(int argc, char** argv) {
  const bool with_barrier = argc > 1 && std::strcmp(argv[1], "--with-barrier") == 0;
  const bool warp_sync_only = argc > 1 && std::strcmp(argv[1], "--warp-sync-only") == 0;
  const int blocks = 4, n = blocks * reverse_kernel::block_threads;
  std::vector<float> in(n), out(n, -1.0f);
  for (int i = 0; i < n; ++i) in[static_cast<std::size_t>(i)] = static_cast<float>(i);
  auto st =
      moefold::launch(moefold::cpu_exec{1},
                      moefold::launch_grid{.blocks = blocks, .smem_bytes = 64 * sizeof(float)},
                      reverse_kernel{in.data(), out.data(), with_barrier, warp_sync_only});
  if (!st) {
    std::printf("launch failed: %s\n", st.error().message.c_str());
    return 2;
  }
  int wrong = 0;
  for (int i = 0; i < n; ++i)
    wrong += out[static_cast<std::size_t>(i)] != static_cast<float>(i / 64 * 64 + 63 - i % 64);
  std::printf("%d of %d elements wrong\n", wrong, n);
  return with_barrier && wrong != 0 ? 3 : 0;
}
