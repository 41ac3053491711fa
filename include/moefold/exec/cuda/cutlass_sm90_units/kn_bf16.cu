// One kernel of cutlass_sm90 (exec/cuda/cutlass_sm90_kernel.cuh): A K-major, B N-major, bf16 D: the
// data gradients (dy W2, da W1).
#include <moefold/exec/cuda/cutlass_sm90_kernel.cuh>

namespace moefold {
inline namespace v0_1 {
namespace detail {

status cutlass_sm90_run_kn_bf16(const kernels::grouped_gemm_arrays<bfloat16, bfloat16, bfloat16>& g,
                                std::span<std::byte> workspace, cudaStream_t stream) {
  return cutlass_sm90_run<cutlass_sm90_config<cutlass::layout::RowMajor, cutlass::layout::RowMajor,
                                              cutlass::bfloat16_t>>(g, workspace, stream);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
