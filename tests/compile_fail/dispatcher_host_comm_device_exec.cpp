// expect: communicator_for
// The host thread world cannot serve a dispatcher on the CPU executor's device memory.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using D = all_gather_dispatcher<float, thread_communicator, host_exec>;
#else
using D = all_gather_dispatcher<float, thread_communicator, cpu_exec>;
#endif
int main() { return D::make({.max_tokens = 1, .hidden = 1}).has_value() ? 0 : 1; }
