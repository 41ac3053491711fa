// expect: communicator_for
// NCCL moves device memory on a stream: a layer on host_exec cannot take nccl_communicator (the
// control takes the thread world, which serves host memory).
#include <moefold/comm/cuda/nccl_communicator.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/experts/reference_mlp.hpp>
#include <moefold/layer/moe_layer.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using C = thread_communicator;
#else
using C = nccl_communicator;
#endif
using L = moe_layer<float, host_exec, C, dropless, all_to_all_dispatcher<float, C, host_exec>,
                    reference_mlp<float>>;
int main() { return sizeof(L) > 0 ? 0 : 1; }
