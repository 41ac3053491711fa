//! @file nccl_group.hpp
//! @brief A scope guard for ncclGroupStart / ncclGroupEnd.
#pragma once

#include <nccl.h>

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! Brackets grouped NCCL calls; ncclGroupEnd's result is what counts.
class nccl_group {
 public:
  nccl_group() { ncclGroupStart(); }
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;
  ~nccl_group() {
    if (open_) ncclGroupEnd();
  }
  [[nodiscard]] ncclResult_t end() {
    open_ = false;
    return ncclGroupEnd();
  }

 private:
  bool open_ = true;
};

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
