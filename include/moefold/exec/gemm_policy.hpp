//! @file gemm_policy.hpp
//! @brief Which grouped-GEMM backend each GEMM of a layer runs on: a policy type whose member
//! alias `backend<kind, mode, A, B, C>` names the backend (exec/grouped_gemm.hpp's protocol) per
//! GEMM kind (the experts' forward and data gradients, their weight gradients, the router's, the
//! shared expert's) and mode (dropless: rows per expert from the dispatch; pad: every expert at
//! the capacity). The router, the experts and the layer ask the policy and nothing else, so a new
//! backend (cuBLAS, CUTLASS) slots in as a policy without touching them.
//!
//! The policies:
//! - `simt_gemms`: the portable SIMT kernel everywhere (cpu_exec's default, and the bitwise
//!   CPU = GPU reference on cuda_exec);
//! - `host_gemms`: the cache-blocked host GEMM (host_exec's default);
//! - `tensor_core_gemms<Fallback>`: the library backends (cuda_exec's default): CUTLASS's grouped
//!   GEMM for dropless experts (exec/cutlass_sm90.hpp), one strided-batched cuBLAS call for pad
//!   mode (exec/cublas_strided.hpp), dense cuBLAS for the router and the shared expert
//!   (exec/cublas_dense.hpp); what one refuses (element types, layouts, alignment, row ranges only
//!   on the device for cuBLAS, a build without CUTLASS) falls back to the cuBLAS backends, then to
//!   Fallback's (fallback_gemm.hpp says which ran and why). On host_exec and cpu_exec the library
//!   backends' descriptions run on host_blas: CI's proof of their bookkeeping.
#pragma once

#include <type_traits>

#include "../core/memory_space.hpp"
#include "cublas_dense.hpp"
#include "cublas_strided.hpp"
#include "cutlass_sm90.hpp"
#include "exec.hpp"
#include "fallback_gemm.hpp"
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

//! The library backends, each falling back to the next that accepts a GEMM (see the file
//! comment): experts dropless cutlass_sm90 -> cublas_dense -> Fallback; experts in pad mode (every
//! expert at the capacity) cublas_strided -> cublas_dense -> Fallback; router and shared expert
//! cublas_dense -> Fallback.
template <class Fallback = simt_gemms>
struct tensor_core_gemms {
  template <gemm_kind K, gemm_mode M, class A, class B, class C>
  using fallback = typename Fallback::template backend<K, M, A, B, C>;
  template <gemm_kind K, gemm_mode M, class A, class B, class C>
  using dense = fallback_gemm<cublas_dense<A, B, C>, fallback<K, M, A, B, C>>;
  template <gemm_kind K, gemm_mode M, class A, class B, class C>
  using backend = std::conditional_t<
      K == gemm_kind::router || K == gemm_kind::shared, dense<K, M, A, B, C>,
      std::conditional_t<M == gemm_mode::pad,
                         fallback_gemm<cublas_strided<A, B, C>, dense<K, M, A, B, C>>,
                         fallback_gemm<cutlass_sm90<A, B, C>, dense<K, M, A, B, C>>>>;
};

//! Policy P's shared-expert backends for every GEMM of an MLP: the shared expert runs
//! mlp_experts (one expert, whose GEMMs it asks for as gemm_kind::expert and expert_wgrad) with
//! the backends P names for gemm_kind::shared.
template <class P>
struct shared_gemms {
  template <gemm_kind, gemm_mode M, class A, class B, class C>
  using backend = typename P::template backend<gemm_kind::shared, M, A, B, C>;
};

//! The policy a context runs by default: the host GEMM on host_exec, the library backends on a
//! GPU's memory (cuda_exec), the SIMT kernel elsewhere (cpu_exec: the bitwise reference of the
//! GPU's SIMT path).
template <class Exec>
using default_gemms =
    std::conditional_t<std::is_same_v<Exec, host_exec>, host_gemms,
                       std::conditional_t<std::is_same_v<typename Exec::memory_space, device_space>,
                                          tensor_core_gemms<simt_gemms>, simt_gemms>>;

namespace detail {
//! The GEMM policy a component names as its `gemms_type` (mlp_experts, topk_router), else
//! `Otherwise`: the context's default (a user's experts), or another component's policy (the
//! layer's gating: the router's, else the experts').
template <class E, class Exec, class Otherwise = default_gemms<Exec>>
struct gemms_of {
  using type = Otherwise;
};
template <class E, class Exec, class Otherwise>
requires requires { typename E::gemms_type; }
struct gemms_of<E, Exec, Otherwise> {
  using type = typename E::gemms_type;
};
template <class E, class Exec, class Otherwise = default_gemms<Exec>>
using gemms_of_t = typename gemms_of<E, Exec, Otherwise>::type;
}  // namespace detail

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
