// The two CPU contexts every kernel body of the simt suite runs on: cpu_exec (the checker: real
// teams, poisoned shared memory, seeded block order) and host_exec (the fast path: plain loops, a
// team of one). A test draws its inputs once and launches the same kernel on both through one
// `simt_launcher`, then compares: bit for bit where the body is integer or fixed-order, within
// the ulps its kernel documents where a team reduction's order differs.
#pragma once

#include <cstdint>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>

namespace moefold::test {

enum class simt_on { cpu_exec, host_exec };

inline const char* to_string(simt_on on) {
  return on == simt_on::cpu_exec ? "cpu_exec" : "host_exec";
}

//! launch(grid, kernel) on the context `on` names (cpu_exec seeded with `seed`).
struct simt_launcher {
  simt_on on = simt_on::cpu_exec;
  std::uint64_t seed = 0;
  template <class K>
  [[nodiscard]] status operator()(const launch_grid& g, const K& k) const {
    return on == simt_on::host_exec ? launch(host_exec{}, g, k) : launch(cpu_exec{seed}, g, k);
  }
};

}  // namespace moefold::test
