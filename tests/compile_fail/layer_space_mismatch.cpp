// expect: communicator_for
// A layer whose communicator (device memory of the CPU executor) disagrees with its dispatcher's
// context (host_exec).
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/experts/reference_mlp.hpp>
#include <moefold/layer/moe_layer.hpp>
using namespace moefold;
using D = all_to_all_dispatcher<float, thread_communicator, host_exec>;
#ifdef MOEFOLD_CF_CONTROL
using C = thread_communicator;
#else
using C = thread_device_communicator;
#endif
using L = moe_layer<float, host_exec, C, dropless, D, reference_mlp<float>>;
int main() { return sizeof(L) > 0 ? 0 : 1; }
