// expect: sync() in a kernel that is not cooperative
// A body with a barrier whose kernel does not declare itself cooperative: host_exec would run its
// threads one after another to the end, so the barrier could not hold (control: declared).
#include <moefold/exec/host_exec.hpp>
using namespace moefold;
struct barrier_kernel {
  static constexpr int block_threads = 32;
#ifdef MOEFOLD_CF_CONTROL
  static constexpr bool cooperative = true;
#endif
  int* out;
  template <class Ctx>
  void operator()(Ctx& c) const {
    out[c.thread()] = 1;
    c.sync();
  }
};
int main() {
  int out[32] = {};
  return launch(host_exec{}, launch_grid{.blocks = 1}, barrier_kernel{out}) ? 0 : 1;
}
