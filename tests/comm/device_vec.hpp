// The GPU collectives test's buffer set-up, written once over a runtime `Rt` so that the
// sequence the GPU runs (tests/comm/gpu_collectives_test.cu, with the CUDA runtime) is the one
// the stream-order fake checks on the CPU (tests/comm/stream_order_test.cpp).
//
// Rt provides: allocate(bytes) -> void*, release(p); fill_from_host(dst, src, bytes)
// (cudaMemcpy host to device: on the legacy stream, the source staged before it returns, the
// data maybe not yet landed); fill_bytes(dst, byte, bytes) (cudaMemset: asynchronous, legacy
// stream); synchronize_legacy() (cudaStreamSynchronize(nullptr)); to_host(dst, src, bytes)
// (cudaMemcpy device to host: returns once the copy has completed, after the legacy stream's
// earlier work).
//
// The fills run on the legacy default stream, the collectives on non-blocking streams, which do
// not wait for it; so every fill ends by synchronizing the legacy stream before any collective
// can read the buffer (not the device: a loopback rank's collective may be waiting for a peer
// that is still filling its buffers).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace moefold::test {

// A device copy of a host vector, or a poisoned device buffer (at least one element, so
// pointers are never null).
template <class T, class Rt>
struct basic_device_vec {
  Rt* rt = nullptr;
  T* p = nullptr;
  std::size_t n = 0;

  basic_device_vec(Rt& r, const std::vector<T>& h) : rt(&r), n(h.size()) {
    p = static_cast<T*>(rt->allocate(bytes()));
    if (n) rt->fill_from_host(p, h.data(), sizeof(T) * n);
    rt->synchronize_legacy();
  }
  basic_device_vec(Rt& r, std::size_t count) : rt(&r), n(count) {
    p = static_cast<T*>(rt->allocate(bytes()));
    rt->fill_bytes(p, 0xff, bytes());
    rt->synchronize_legacy();
  }
  basic_device_vec(const basic_device_vec&) = delete;
  basic_device_vec& operator=(const basic_device_vec&) = delete;
  ~basic_device_vec() { rt->release(p); }

  std::span<T> span() { return {p, n}; }
  // Callers synchronize the collective's stream first.
  std::vector<T> host() const {
    std::vector<T> h(n);
    if (n) rt->to_host(h.data(), p, sizeof(T) * n);
    return h;
  }

 private:
  [[nodiscard]] std::size_t bytes() const noexcept { return sizeof(T) * (n ? n : 1); }
};

}  // namespace moefold::test
