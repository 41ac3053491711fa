//! @file host_bytes16.hpp
//! @brief The 16-byte loads and stores of the CPU contexts' bodies (cpu_exec's cpu_ctx, host_exec's
//! host_ctx_base): one memcpy each, after the context's own check that the address is 16-byte
//! aligned, as the GPU requires (`Ctx::fault_misaligned(p, what)`, `what` the rule broken in
//! words: a kernel fault on both, each reported its own way).
#pragma once

#include <cstdint>
#include <cstring>

#include "../core/config.hpp"
#include "../core/simt_launch.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

template <class Ctx>
class host_bytes16 {
 public:
  //! One 16-byte load / store; the address must be 16-byte aligned, as on the GPU.
  // __host__ __device__ under nvcc so that a body instantiated with a CPU context in a .cu file is
  // not a call of a host function; the device pass compiles the host work away.
  [[nodiscard]] MOEFOLD_HOST_DEVICE bytes16 load16(const void* p) const {
    bytes16 v{};
    MOEFOLD_CPU_ONLY(check(p, "load16 of an address that is not 16-byte aligned");
                     std::memcpy(&v, p, 16));
    return v;
  }
  MOEFOLD_HOST_DEVICE void store16(void* p, bytes16 v) const {
    MOEFOLD_CPU_ONLY(check(p, "store16 of an address that is not 16-byte aligned");
                     std::memcpy(p, &v, 16));
  }

 private:
  void check(const void* p, const char* what) const {
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0)
      static_cast<const Ctx&>(*this).fault_misaligned(p, what);
  }
};

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
