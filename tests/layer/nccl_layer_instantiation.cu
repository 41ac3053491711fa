// The production combination compiled whole: the layer in bf16 on cuda_exec over NCCL, with
// either dispatcher (every member function instantiated, so a call that does not compile for
// device memory and a stream, or for NCCL's communicator, fails the build). Runs nothing.
#include <moefold/comm/cuda/nccl_communicator.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>
#include <moefold/layer/moe_layer.hpp>

namespace moefold {
// The defaults: drop_policy_variant, the All-to-All dispatcher with fp32 probabilities,
// mlp_experts, topk_router.
template class moe_layer<bfloat16, cuda_exec, nccl_communicator>;
template class moe_layer<bfloat16, cuda_exec, nccl_communicator, drop_policy_variant,
                         all_gather_dispatcher<bfloat16, nccl_communicator, cuda_exec, float>>;
}  // namespace moefold

int main() { return 0; }
