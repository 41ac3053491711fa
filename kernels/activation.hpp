//! @file activation.hpp
//! @brief The expert activations of experts/activation.hpp as kernels, forward and backward, over
//! fc1's output: [rows, 2F] -> [rows, F] for the gated forms (columns [0, F) the gate, [F, 2F) the
//! up projection: act(gate) * up), [rows, F] -> [rows, F] for the plain ones. The routing
//! probability can be applied here, after the activation (Megatron-Core's placement:
//! h = act_out * p, its gradient dp = sum_c act_out(c) dh(c) from the backward).
//!
//! Arithmetic: each output element is computed in double from the widened inputs (the special
//! functions of simt/math.hpp and simt/erf.hpp, relative error <= 2e-13) and rounded to the
//! element type once: within half an ulp of the exact value but for values within 2e-13 of a
//! rounding boundary (fp32; bf16 and fp16 round through fp32, so at most one ulp). This is the
//! reference-quality path, bound by memory on a GPU except for GELU's series; a tensor-core
//! expert fuses the activation into its GEMM epilogue instead.
#pragma once

#include <type_traits>

#include <moefold/core/activation.hpp>
#include <moefold/core/config.hpp>
#include <moefold/core/dtype.hpp>

#include "elementwise.hpp"
#include "simt/erf.hpp"
#include "simt/math.hpp"
#include "simt/warp.hpp"

namespace moefold::kernels {

//! act(x) in double (the function applied to the gate, or to the whole input).
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double activation_value(activation a, double x) noexcept {
  switch (a) {
    case activation::swiglu:
    case activation::silu: return simt::div(x, simt::add(1.0, simt::exp(-x)));
    case activation::geglu:
    case activation::gelu:  // x Phi(x) = x/2 erfc(-x / sqrt 2): no cancellation for x << 0
      return simt::mul(simt::mul(0.5, x), simt::erfc(simt::mul(-x, 0.70710678118654752440)));
    case activation::relu: return x > 0.0 ? x : 0.0;
    case activation::squared_relu: return x > 0.0 ? simt::mul(x, x) : 0.0;
  }
  return x;
}

//! d act / dx in double.
[[nodiscard]] MOEFOLD_HOST_DEVICE inline double activation_derivative(activation a,
                                                                      double x) noexcept {
  switch (a) {
    case activation::swiglu:
    case activation::silu: {  // s (1 + x (1 - s)), s = sigmoid(x)
      const double s = simt::div(1.0, simt::add(1.0, simt::exp(-x)));
      return simt::mul(s, simt::add(1.0, simt::mul(x, simt::add(1.0, -s))));
    }
    case activation::geglu:
    case activation::gelu: {  // Phi(x) + x phi(x)
      const double cdf = simt::mul(0.5, simt::erfc(simt::mul(-x, 0.70710678118654752440)));
      const double pdf =
          simt::mul(simt::exp(simt::mul(-0.5, simt::mul(x, x))), 0.39894228040143267794);
      return simt::add(cdf, simt::mul(x, pdf));
    }
    case activation::relu: return x > 0.0 ? 1.0 : 0.0;
    case activation::squared_relu: return x > 0.0 ? simt::mul(2.0, x) : 0.0;
  }
  return 1.0;
}

namespace detail_activation {
// A double rounded to T once (bf16 and fp16 through fp32).
template <class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE T round_to(double v) noexcept {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(v);
  else
    return moefold::detail::narrow<T>(static_cast<float>(v));
}
template <class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE double wide(const T& v) noexcept {
  return static_cast<double>(moefold::detail::widen(v));
}
//! One output element's inputs: x (the gate, or the whole input) and the up projection, 1 for
//! a plain activation (a product with it is exact, so one formula serves both forms).
struct element_input {
  double x, up;
};
template <class T>
[[nodiscard]] MOEFOLD_HOST_DEVICE element_input load(const rows_arg<const T>& a, bool gated,
                                                     long long r, long long k, int width) {
  return {wide(a(r, k)), gated ? wide(a(r, width + k)) : 1.0};
}
}  // namespace detail_activation

//! h = act_out(a) [* p]: act_out = act(a[:, c]) * a[:, F + c] (gated) or act(a[:, c]).
//! a [rows, F1 = (gated ? 2 : 1) width], probs [rows] or null, h [rows, width]. One element per
//! thread, grid-strided.
template <class T, class P = T>
struct activation_forward_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "activation_forward";
  activation act;
  rows_arg<const T> a;
  const P* probs;  // nullable: the probability applied at un-permute instead
  rows_arg<T> h;
  int rows, width;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using detail_activation::wide;
    const bool gated = is_gated(act);
    detail_elementwise::for_each_element(c, rows, width, [&](long long r, long long k) {
      const auto in = detail_activation::load(a, gated, r, k, width);
      double v = simt::mul(activation_value(act, in.x), in.up);
      if (probs != nullptr) v = simt::mul(v, wide(probs[r]));
      h(r, k) = detail_activation::round_to<T>(v);
    });
  }
};

//! From dh = dL/dh [rows, width]: da [rows, F1] (gated: d gate = p dh up act'(gate),
//! d up = p dh act(gate); plain: p dh act'(a)) and, when both probs and dprobs are given,
//! dprobs[r] = sum_c act_out(r, c) dh(r, c) in double (lane-strided, then the warp's butterfly:
//! a fixed order, the same bits on cpu_exec and a GPU; a host context's team of one adds the row
//! in one chain, which differs in the double's last bits and, rounded to P = fp32 or bf16, agrees
//! with it within one ulp of P). With h.p set it also writes h = act_out [* p]
//! [rows, width], the forward's output bit for bit (a weight gradient needs it and the backward
//! has computed act already). One warp per row, grid-strided.
template <class T, class P = T>
struct activation_backward_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;  // a warp per row (a team of one on the host)
  static constexpr const char* name = "activation_backward";
  activation act;
  rows_arg<const T> a;
  rows_arg<const T> dh;
  const P* probs;  // nullable (p = 1)
  rows_arg<T> da;
  P* dprobs;  // nullable; written only with probs
  int rows, width;
  rows_arg<T> h{nullptr, 0};  // h.p nullable: the forward's output, recomputed on the way
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using detail_activation::round_to;
    using detail_activation::wide;
    constexpr int warps = Ctx::block_threads / Ctx::warp_threads;
    const bool gated = is_gated(act);
    // The loop bound is the same on every lane of a warp, so the warp shuffles in step.
    for (long long r = static_cast<long long>(c.block()) * warps + c.warp(); r < rows;
         r += static_cast<long long>(c.grid_blocks()) * warps) {
      const double p = probs != nullptr ? wide(probs[r]) : 1.0;
      double part = 0.0;
      for (int k = c.lane(); k < width; k += Ctx::warp_threads) {
        const auto in = detail_activation::load(a, gated, r, k, width);
        const double g = wide(dh(r, k)), pg = simt::mul(p, g);
        const double f = activation_value(act, in.x), fd = activation_derivative(act, in.x);
        const double out = simt::mul(f, in.up);  // act_out, as the forward rounds it
        if (h.p != nullptr) h(r, k) = round_to<T>(probs != nullptr ? simt::mul(out, p) : out);
        if (gated) {
          da(r, k) = round_to<T>(simt::mul(simt::mul(pg, in.up), fd));
          da(r, width + k) = round_to<T>(simt::mul(pg, f));
        } else {
          da(r, k) = round_to<T>(simt::mul(pg, fd));
        }
        part = simt::fma(out, g, part);  // act_out dh
      }
      if (probs != nullptr && dprobs != nullptr) {
        const double s = simt::warp_sum(c, part);
        if (c.lane() == 0) dprobs[r] = round_to<P>(s);
      }
    }
  }
};

}  // namespace moefold::kernels
