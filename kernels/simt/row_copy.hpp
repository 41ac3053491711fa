//! @file row_copy.hpp
//! @brief Block-level row moves for the row kernels: a whole block copies or clears one row,
//! 16 bytes per thread per step when the rows allow it (LDG.E.128 / STG.E.128 on the GPU), else
//! one element per thread per step. Consecutive threads take consecutive pieces, so a warp's
//! accesses are coalesced either way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <moefold/core/config.hpp>
#include <moefold/core/simt_launch.hpp>

namespace moefold::kernels::simt {

//! Whether rows of `width` elements of T, `stride` elements apart, starting at `p`, can move as
//! 16-byte pieces: the row's bytes, the stride's bytes and the address are multiples of 16.
//! Buffers the library allocates pad their strides to 16 bytes, so only user views fail this.
template <class T>
[[nodiscard]] constexpr bool rows_vec16(const void* p, long long width, long long stride) noexcept {
  return (width * static_cast<long long>(sizeof(T))) % 16 == 0 &&
         (stride * static_cast<long long>(sizeof(T))) % 16 == 0 &&
         reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

//! d[0, width) = s[0, width), by the whole block.
template <class Ctx, class T>
MOEFOLD_HOST_DEVICE void block_copy_row(Ctx& c, const T* s, T* d, int width, bool vec16) {
  if (vec16) {
    const int pieces = static_cast<int>(width * sizeof(T) / 16);
    const auto* sb = reinterpret_cast<const unsigned char*>(s);
    auto* db = reinterpret_cast<unsigned char*>(d);
    for (int q = c.thread(); q < pieces; q += Ctx::block_threads)
      c.store16(db + 16 * static_cast<std::ptrdiff_t>(q),
                c.load16(sb + 16 * static_cast<std::ptrdiff_t>(q)));
  } else {
    for (int i = c.thread(); i < width; i += Ctx::block_threads) d[i] = s[i];
  }
}

//! d[0, width) = 0 (all bits clear: zero for every element type), by the whole block.
template <class Ctx, class T>
MOEFOLD_HOST_DEVICE void block_zero_row(Ctx& c, T* d, int width, bool vec16) {
  if (vec16) {
    const int pieces = static_cast<int>(width * sizeof(T) / 16);
    auto* db = reinterpret_cast<unsigned char*>(d);
    for (int q = c.thread(); q < pieces; q += Ctx::block_threads)
      c.store16(db + 16 * static_cast<std::ptrdiff_t>(q), bytes16{{0u, 0u, 0u, 0u}});
  } else {
    for (int i = c.thread(); i < width; i += Ctx::block_threads) d[i] = T{};
  }
}

}  // namespace moefold::kernels::simt
