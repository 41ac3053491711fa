//! @file gemm_notice.hpp
//! @brief What a GEMM's caller tells when a backend declines and another runs (fallback_gemm):
//! once per distinct message per object (the experts, the router), to a sink the user may set.
//! The default sink writes one line to stderr ("moefold: ..."), so that a trainer sees that
//! its GEMMs left the tensor-core path (an unaligned hidden size, fp32 weights, a GPU other than
//! sm_90, a build without CUTLASS) without the library holding global state.
#pragma once

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace moefold {
inline namespace v0_1 {

//! Where gemm_notices sends a message.
using gemm_notice_sink = std::function<void(std::string_view)>;

class gemm_notices {
 public:
  //! Messages go to `sink` from now on (an empty sink: nowhere).
  void set_sink(gemm_notice_sink sink) { sink_ = std::move(sink); }
  //! Sends `message` unless this object has sent it before.
  void say_once(std::string message) {
    if (std::find(said_.begin(), said_.end(), message) != said_.end()) return;
    if (sink_) sink_(message);
    said_.push_back(std::move(message));
  }
  //! Every message sent so far, in order.
  [[nodiscard]] const std::vector<std::string>& said() const noexcept { return said_; }

  //! After initialize() of backend G by `who` (for GEMM `what`): the fallback taken, if any.
  template <class G>
  void after_initialize(const G& g, const char* who, const char* what) {
    if constexpr (requires { g.used_fallback(); }) {
      if (g.used_fallback())
        say_once(std::string("moefold: ") + who + ": " + what + " runs on " + g.ran_on() +
                 ", not " + G::name + ": " + g.fallback_chain());
    }
  }

 private:
  gemm_notice_sink sink_ = [](std::string_view m) {
    std::fprintf(stderr, "%.*s\n", static_cast<int>(m.size()), m.data());
  };
  std::vector<std::string> said_{};
};

}  // namespace v0_1
}  // namespace moefold
