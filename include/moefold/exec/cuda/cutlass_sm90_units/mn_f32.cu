// One kernel of cutlass_sm90 (exec/cuda/cutlass_sm90_kernel.cuh): A M-major, B N-major, fp32 D = C
// + A B: the weight gradients into fp32 main gradients.
#include <moefold/exec/cuda/cutlass_sm90_kernel.cuh>

namespace moefold {
inline namespace v0_1 {
namespace detail {

status cutlass_sm90_run_mn_f32(const kernels::grouped_gemm_arrays<bfloat16, bfloat16, float>& g,
                               std::span<std::byte> workspace, cudaStream_t stream) {
  return cutlass_sm90_run<
      cutlass_sm90_config<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float>>(
      g, workspace, stream);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
