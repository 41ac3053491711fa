// cutlass_sm90 on cuda_exec from an installed moefold with its CUTLASS library, in a consumer
// project (CMake component CUTLASS_SM90, moefold-cutlass-sm90.pc, or the subproject's
// dependency): the consumer has no CUTLASS headers, only moefold's, the library and the CUDA
// runtime. The backend's run path is kept by address, so the program links only where the
// library gives the three entry points; consumers.py then finds them defined in the executable.
// With a GPU it says whether the kernels run there (compute capability 9.0); without one it has
// been compiled and linked, and says so.
#include <moefold/exec/cuda/cuda_exec.cuh>
#include <moefold/exec/cutlass_sm90.hpp>

#include <cstdio>

using moefold::bfloat16;
using moefold::cuda_exec;
using forward = moefold::cutlass_sm90<bfloat16, bfloat16, bfloat16>;   // kk_bf16, kn_bf16
using weight_grad = moefold::cutlass_sm90<bfloat16, bfloat16, float>;  // mn_f32

// The dependency's MOEFOLD_CUTLASS_SM90 is what makes cuda_exec a context cutlass_sm90 runs on.
static_assert(forward::runs_on<cuda_exec> && weight_grad::runs_on<cuda_exec>,
              "cutlass_sm90 does not run on cuda_exec: MOEFOLD_CUTLASS_SM90 is not defined");

int main() {
  // volatile: the compiler cannot drop the calls into the library as unreachable.
  auto volatile run_forward = &forward::run<cuda_exec>;
  auto volatile run_weight_grad = &weight_grad::run<cuda_exec>;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cutlass_sm90: compiled and linked; no CUDA device, not run\n");
    return 0;
  }
  auto x = cuda_exec::make(cudaStreamPerThread);
  if (!x) return 1;
  const forward fwd;
  const weight_grad wgrad;
  // Before initialize both refuse without a launch, whatever the device.
  if ((fwd.*run_forward)(*x) || (wgrad.*run_weight_grad)(*x)) return 1;
  const auto here = forward::runs_here(*x);
  std::printf("cutlass_sm90: %s\n", here ? "runs on this device" : here.error().message.c_str());
  return 0;
}
