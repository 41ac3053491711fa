//! @file fallback_gemm.hpp
//! @brief fallback_gemm<Primary, Fallback>: a grouped-GEMM backend (exec/grouped_gemm.hpp) that
//! runs Primary where Primary runs on the context and accepts the arguments, and Fallback
//! otherwise: the tensor-core backends refuse element types, layouts and alignments their
//! libraries do not take (their can_implement names the rule), and contexts they are not built
//! for (cutlass_sm90 without the CUTLASS headers), and the GEMM then runs on a backend that takes
//! everything (simt_gemm). used_fallback() tells which ran, and why (Primary's refusal).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

#include "../core/expected.hpp"
#include "exec.hpp"
#include "grouped_gemm.hpp"

namespace moefold {
inline namespace v0_1 {

template <class Primary, class Fallback>
class fallback_gemm {
  static_assert(std::is_same_v<typename Primary::args_type, typename Fallback::args_type>,
                "fallback_gemm: both backends take the same arguments");

 public:
  using args_type = typename Primary::args_type;
  using primary_type = Primary;
  using fallback_type = Fallback;
  static constexpr const char* name = Primary::name;
  //! Wherever the fallback runs (the primary only where it runs too).
  template <class Exec>
  static constexpr bool runs_on = Fallback::template runs_on<Exec>;

  //! The primary's rules, or else the fallback's.
  [[nodiscard]] static status can_implement(const args_type& a) {
    if (Primary::can_implement(a)) return {};
    return Fallback::can_implement(a);
  }
  //! The larger of the two: either may run on the workspace.
  [[nodiscard]] static std::size_t workspace_bytes(const args_type& a) {
    return std::max(Primary::workspace_bytes(a), Fallback::workspace_bytes(a));
  }

  //! Initializes the primary where it runs on Exec, on this context's device (runs_here, where
  //! the primary has one: cutlass_sm90 needs compute capability 9.0) and accepts `a`; the fallback
  //! otherwise, keeping the primary's reason.
  template <class Exec>
  [[nodiscard]] status initialize(Exec& x, const args_type& a, std::span<std::byte> workspace) {
    why_.reset();
    if constexpr (Primary::template runs_on<Exec>) {
      const status st = primary_accepts(x, a);
      if (st) {
        primary_ = true;
        return p_.initialize(x, a, workspace);
      }
      why_ = st.error();
    } else {
      why_ = error{errc::not_supported, std::string(Primary::name) + " does not run on " +
                                            Exec::name + " in this build"};
    }
    primary_ = false;
    return f_.initialize(x, a, workspace);
  }

  template <class Exec>
  [[nodiscard]] status run(Exec& x) const {
    if constexpr (Primary::template runs_on<Exec>) {
      if (primary_) return p_.run(x);
    }
    return f_.run(x);
  }

  //! After initialize(): whether the fallback runs, and the primary's refusal when it does.
  [[nodiscard]] bool used_fallback() const noexcept { return !primary_; }
  [[nodiscard]] const std::optional<error>& fallback_reason() const noexcept { return why_; }
  //! The backend that runs (through nested fallbacks).
  [[nodiscard]] const char* ran_on() const noexcept {
    if (primary_) return Primary::name;
    if constexpr (requires { f_.ran_on(); })
      return f_.ran_on();
    else
      return Fallback::name;
  }
  //! Each refusal on the way to the backend that runs, in order ("" when the primary runs).
  [[nodiscard]] std::string fallback_chain() const {
    if (primary_ || !why_) return {};
    std::string s = why_->message;
    if constexpr (requires { f_.fallback_chain(); }) {
      const std::string next = f_.fallback_chain();
      if (!next.empty()) s += "; then " + next;
    }
    return s;
  }

 private:
  // The primary takes `a` on this context's device. Returned, not assigned: nvcc reads an
  // assignment of a [[nodiscard]] type as its result discarded (warning 2810).
  template <class Exec>
  static status primary_accepts(Exec& x, const args_type& a) {
    if (auto st = Primary::can_implement(a); !st) return st;
    if constexpr (requires {
                    { Primary::runs_here(x) } -> std::same_as<status>;
                  })
      return Primary::runs_here(x);
    else
      return {};
  }
  Primary p_{};
  Fallback f_{};
  bool primary_ = false;
  std::optional<error> why_{};
};

}  // namespace v0_1
}  // namespace moefold
