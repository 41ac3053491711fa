//! @file thread_exchange.hpp
//! @brief The thread world's communicator as an exchange_backend, so that code running over
//! exchange_communicator (the layer units of a framework binding) can run every rank of a mapping
//! as threads of one process, bit for bit as over the framework's groups (the numerics are
//! exchange_communicator's; the backend only moves bytes). For tests and for debugging a binding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../core/expected.hpp"
#include "exchange_communicator.hpp"
#include "thread_world.hpp"

namespace moefold {
inline namespace v0_1 {

//! Over one rank's thread_communicator (a group of a run_thread_world). Send parts are packed in
//! peer order first (the thread world takes counts only). `fail_at`: call number `fail_at` of this
//! rank fails as a dead transport would (errc::comm_peer_failed), for fault tests; -1: never.
class thread_exchange final : public exchange_backend {
 public:
  explicit thread_exchange(thread_communicator c, int fail_at = -1)
      : c_(std::move(c)), fail_at_(fail_at) {}
  [[nodiscard]] int rank() const noexcept override { return c_.rank(); }
  [[nodiscard]] int size() const noexcept override { return c_.size(); }
  [[nodiscard]] std::string name() const override { return "thread world"; }
  [[nodiscard]] status all_gather(std::span<const std::byte> mine,
                                  std::span<std::byte> all) override {
    if (calls_++ == fail_at_)
      return make_error(errc::comm_peer_failed, "thread_exchange: injected failure");
    return c_.all_gather<std::byte>(mine, all);
  }
  [[nodiscard]] status all_to_all_v(const std::byte* send, std::span<const std::int64_t> sb,
                                    std::span<const std::int64_t> so, std::byte* recv,
                                    std::span<const std::int64_t> rb,
                                    std::span<const std::int64_t>) override {
    if (calls_++ == fail_at_)
      return make_error(errc::comm_peer_failed, "thread_exchange: injected failure");
    std::vector<std::byte> packed;
    std::vector<int> sc, rc;
    std::int64_t rt = 0;
    for (std::size_t p = 0; p < sb.size(); ++p) {
      packed.insert(packed.end(), send + so[p], send + so[p] + sb[p]);
      sc.push_back(static_cast<int>(sb[p]));
      rc.push_back(static_cast<int>(rb[p]));
      rt += rb[p];
    }
    return c_.all_to_all_v<std::byte>(packed, sc, std::span<std::byte>(recv, recv + rt), rc);
  }

 private:
  thread_communicator c_;
  int calls_ = 0;
  int fail_at_;
};

}  // namespace v0_1
}  // namespace moefold
