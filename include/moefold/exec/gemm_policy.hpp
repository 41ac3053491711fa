//! @file gemm_policy.hpp
//! @brief Which grouped-GEMM backend each GEMM of a layer runs on: a policy type whose member
//! alias `backend<kind, mode, A, B, C>` names the backend (exec/grouped_gemm.hpp's protocol) per
//! GEMM kind (the experts' forward and data gradients, their weight gradients, the router's, the
//! shared expert's) and mode (dropless: rows per expert from the dispatch; pad: every expert at
//! the capacity). The router, the experts and the layer ask the policy and nothing else, so a new
//! backend (cuBLAS, CUTLASS) slots in as a policy without touching them.
//!
//! Two policies now: `simt_gemms` (the portable SIMT kernel: cpu_exec's default and the bitwise
//! CPU = GPU reference) and `host_gemms` (the cache-blocked host GEMM: host_exec's default).
#pragma once

#include <type_traits>

#include "exec.hpp"
#include "host_exec.hpp"
#include "host_gemm.hpp"
#include "simt_gemm.hpp"

namespace moefold {
inline namespace v0_1 {

//! The GEMMs of a layer, by what they compute.
enum class gemm_kind {
  expert,        //!< fc1 and fc2 forward and their data gradients (grouped by M)
  expert_wgrad,  //!< fc1 and fc2 weight gradients (grouped by K, beta = 1 into main gradients)
  router,        //!< the router's logits, dx and dW (one group)
  shared,        //!< the shared expert's GEMMs (one group)
};

//! How the experts' rows are laid out.
enum class gemm_mode {
  dropless,  //!< each expert's rows from the dispatch (host or device offsets)
  pad,       //!< every expert at the capacity C (a strided batch)
};

//! Every GEMM on the portable SIMT kernel (exec/simt_gemm.hpp), on any context.
struct simt_gemms {
  template <gemm_kind, gemm_mode, class A, class B, class C>
  using backend = simt_gemm<A, B, C>;
};

//! Every GEMM on the cache-blocked host GEMM (exec/host_gemm.hpp), on host_exec.
struct host_gemms {
  template <gemm_kind, gemm_mode, class A, class B, class C>
  using backend = host_gemm<A, B, C>;
};

//! The policy a context runs by default: the host GEMM on host_exec, the SIMT kernel elsewhere
//! (the next backends replace it on cuda_exec).
template <class Exec>
using default_gemms = std::conditional_t<std::is_same_v<Exec, host_exec>, host_gemms, simt_gemms>;

//! P names, for every kind and mode, a backend that runs on Exec (checked at one element type).
template <class P, class Exec>
concept gemm_policy = grouped_gemm_backend<
    typename P::template backend<gemm_kind::expert, gemm_mode::dropless, float, float, float>,
    Exec> &&
    grouped_gemm_backend<typename P::template backend<gemm_kind::expert_wgrad, gemm_mode::dropless,
                                                      float, float, float>,
                         Exec> &&
    grouped_gemm_backend<
        typename P::template backend<gemm_kind::expert, gemm_mode::pad, float, float, float>,
        Exec> &&
    grouped_gemm_backend<
        typename P::template backend<gemm_kind::router, gemm_mode::dropless, float, float, float>,
        Exec> &&
    grouped_gemm_backend<
        typename P::template backend<gemm_kind::shared, gemm_mode::dropless, float, float, float>,
        Exec>;

}  // namespace v0_1
}  // namespace moefold
