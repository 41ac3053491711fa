// One kernel of cutlass_sm90 (exec/cuda/cutlass_sm90_kernel.cuh): A K-major, B K-major, bf16 D: fc1
// and fc2 forward (x W1^T, h W2^T).
#include <moefold/exec/cuda/cutlass_sm90_kernel.cuh>

namespace moefold {
inline namespace v0_1 {
namespace detail {

status cutlass_sm90_run_kk_bf16(const kernels::grouped_gemm_arrays<bfloat16, bfloat16, bfloat16>& g,
                                std::span<std::byte> workspace, cudaStream_t stream) {
  return cutlass_sm90_run<cutlass_sm90_config<cutlass::layout::RowMajor,
                                              cutlass::layout::ColumnMajor, cutlass::bfloat16_t>>(
      g, workspace, stream);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
