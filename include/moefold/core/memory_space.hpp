//! @file memory_space.hpp
//! @brief Memory-space tags: where the elements of a buffer live, stated in its type, so that
//! host code cannot read device memory by accident and a communicator cannot be handed buffers
//! of the wrong kind (comm/communicator.hpp).
//!
//! Three spaces: host memory; CUDA device memory; and the device memory of the CPU executor
//! (exec/cpu_exec.hpp), which is host memory that the library treats as device memory (host code
//! reaches it only through the executor's copies), so the GPU code path runs in CI unchanged.
#pragma once

#include <concepts>

namespace moefold {
inline namespace v0_1 {

//! Host memory: views give element access.
struct host_space {
  static constexpr const char* name = "host";
  static constexpr bool host_accessible = true;
};

//! CUDA device memory (cudaMalloc, cudaMallocAsync): no host element access.
struct device_space {
  static constexpr const char* name = "device";
  static constexpr bool host_accessible = false;
};

//! The device memory of the CPU executor: backed by host memory, treated as device memory (no
//! host element access; kernels and the executor's copies reach it).
struct cpu_device_space {
  static constexpr const char* name = "cpu_device";
  static constexpr bool host_accessible = false;
};

//! A memory-space tag.
template <class S>
concept memory_space = requires {
  { S::name } -> std::convertible_to<const char*>;
  { S::host_accessible } -> std::convertible_to<bool>;
};

//! True when host code may read and write elements of space S.
template <memory_space S>
inline constexpr bool host_accessible_v = S::host_accessible;

}  // namespace v0_1
}  // namespace moefold
