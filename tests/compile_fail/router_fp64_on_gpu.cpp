// expect: an fp64 router (R = double) runs on the CPU contexts only
// An fp64 router on a context whose memory is the GPU's is refused with the reason. The context
// here stands for cuda_exec (whose header needs nvcc): what the rule reads is its memory space.
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/routing/topk_router.hpp>
using namespace moefold;
struct gpu_like_exec : cpu_exec {
  using memory_space = device_space;
};
#ifdef MOEFOLD_CF_CONTROL
using R = topk_router<double, cpu_exec, double>;
#else
using R = topk_router<double, gpu_like_exec, double>;
#endif
int main() { return R::make({.num_experts = 4, .topk = 2}, 8).has_value() ? 0 : 1; }
