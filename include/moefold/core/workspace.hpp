//! @file workspace.hpp
//! @brief The workspace idiom (CUB's alias_temporaries): one function both sizes a workspace and
//! carves it into aligned sub-buffers, so that sizes and offsets can never drift apart.
//!
//! @code
//! workspace_carver c(bytes);          // an empty span to measure, or the caller's workspace
//! auto counts = c.take<int>(E);        // span<int> (empty while measuring)
//! auto rows = c.take<int>(M);
//! if (!c.fits()) ...                   // c.required() is the size to ask for
//! @endcode
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace moefold {
inline namespace v0_1 {

//! Alignment of every sub-buffer: enough for vector loads on the GPU and cache lines on the CPU.
inline constexpr std::size_t workspace_alignment = 256;

//! Carves typed, 256-byte-aligned sub-buffers from a byte span, or only measures when the span is
//! empty. Call the same sequence of take() twice: once to measure, once to carve. The workspace
//! may start at any address (the size asked for includes room to align its start).
class workspace_carver {
 public:
  explicit workspace_carver(std::span<std::byte> bytes = {}) noexcept : bytes_(bytes) {
    const auto addr = reinterpret_cast<std::uintptr_t>(bytes_.data());
    skip_ = static_cast<std::size_t>(align_up(addr) - addr);
  }

  //! The next sub-buffer of n elements of T (an empty span when only measuring or too small).
  template <class T>
  [[nodiscard]] std::span<T> take(std::size_t n) noexcept {
    static_assert(alignof(T) <= workspace_alignment);
    const std::size_t begin = static_cast<std::size_t>(align_up(used_));
    used_ = begin + n * sizeof(T);
    if (bytes_.empty() || skip_ + used_ > bytes_.size()) {
      fits_ = false;
      return {};
    }
    return {reinterpret_cast<T*>(bytes_.data() + skip_ + begin), n};
  }

  //! Bytes the sequence of take() calls needs, whatever the workspace's start address.
  [[nodiscard]] std::size_t required() const noexcept {
    return static_cast<std::size_t>(align_up(used_)) + workspace_alignment - 1;
  }
  //! True when every take() so far was served from the workspace.
  [[nodiscard]] bool fits() const noexcept { return fits_; }

 private:
  static std::uintptr_t align_up(std::uintptr_t v) noexcept {
    return (v + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
  }

  std::span<std::byte> bytes_;
  std::size_t skip_ = 0;
  std::size_t used_ = 0;
  bool fits_ = true;
};

}  // namespace v0_1
}  // namespace moefold
