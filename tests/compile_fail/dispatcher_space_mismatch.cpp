// expect: communicator_for
// A dispatcher whose communicator's memory space is not its execution context's: the thread world
// over the CPU executor's device memory with host_exec (control: with cpu_exec's host twin).
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using D = all_to_all_dispatcher<float, thread_communicator, host_exec>;
#else
using D = all_to_all_dispatcher<float, thread_device_communicator, host_exec>;
#endif
int main() { return D::make({.max_tokens = 1, .hidden = 1}).has_value() ? 0 : 1; }
