//! @file shared_gate.hpp
//! @brief The shared expert's sigmoid gate and its output on an execution context
//! (experts/shared_expert.hpp has the host form): out += gate_t * y_t, gate_t = sigmoid(x_t . w_g)
//! (1 without a gate), forward and backward. One thread per token for the dot products and one
//! per hidden column for the gate weight's gradient, each sum in ascending order, so CPU and GPU
//! agree bit for bit (the sigmoid is moefold's own, simt::sigmoid, within 2 ulp of the host's
//! std::exp form; the dot products are the host's bits).
//!
//! Arithmetic: accumulator_t<T> (fp32 for 16-bit tokens); the gated output rounded to T, then
//! added to out and rounded again (the host's two steps: the shared output, then its sum with the
//! routed one).
//!
//! Shapes: x, y, out, dout, dy, dx [N, H] (rows_arg: any row stride); w_g and its gradient [H];
//! gates, dpre [N].
#pragma once

#include <moefold/core/config.hpp>
#include <moefold/core/dtype.hpp>

#include "elementwise.hpp"
#include "simt/math.hpp"

namespace moefold::kernels {

//! gates[t] = sigmoid(x_t . w_g) (1 when gate is null); out[t, h] += round(gates[t] y[t, h]).
template <class T>
struct shared_gate_forward_kernel {
  using A = accumulator_t<T>;
  static constexpr int block_threads = 128;
  static constexpr const char* name = "shared_gate_forward";

  rows_arg<const T> x;  //!< [N, H] this rank's tokens
  const T* gate;        //!< [H] w_g, or null: no gate
  rows_arg<const T> y;  //!< [N, H] the ungated output (reduce-scattered over TP)
  int num_tokens, hidden;
  A* gates;         //!< [N] out: the gate of each token, kept for the backward
  rows_arg<T> out;  //!< [N, H] += the gated output

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using moefold::detail::narrow;
    using moefold::detail::widen;
    for (long long t = static_cast<long long>(c.block()) * block_threads + c.thread();
         t < num_tokens; t += static_cast<long long>(c.grid_blocks()) * block_threads) {
      A g = A(1);
      if (gate != nullptr) {
        A z = A(0);
        for (int h = 0; h < hidden; ++h)
          z = simt::add(z, simt::mul(A(widen(x(t, h))), A(widen(gate[h]))));
        g = A(widen(narrow<T>(simt::sigmoid(z))));  // the host keeps the gate as T
      }
      gates[t] = g;
      for (int h = 0; h < hidden; ++h) {
        const T shared = narrow<T>(simt::mul(g, A(widen(y(t, h)))));
        out(t, h) = narrow<T>(simt::add(A(widen(out(t, h))), A(widen(shared))));
      }
    }
  }
};

//! Per token: dy[t, h] = round(gates[t] dout[t, h]) (the gradient at the ungated output) and,
//! with a gate, dpre[t] = (sum_h dout[t, h] y[t, h]) g (1 - g) in accumulator_t<T> (the weight's
//! gradient takes it so; the input's rounds it to T first, as the host does).
template <class T>
struct shared_gate_backward_kernel {
  using A = accumulator_t<T>;
  static constexpr int block_threads = 128;
  static constexpr const char* name = "shared_gate_backward";

  rows_arg<const T> dout;  //!< [N, H]
  rows_arg<const T> y;     //!< [N, H] the forward's ungated output
  const A* gates;          //!< [N]
  int num_tokens, hidden;
  bool gated;
  rows_arg<T> dy;  //!< [N, H] out
  A* dpre;         //!< [N] out (with a gate): d loss / d (x . w_g)

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using moefold::detail::narrow;
    using moefold::detail::widen;
    for (long long t = static_cast<long long>(c.block()) * block_threads + c.thread();
         t < num_tokens; t += static_cast<long long>(c.grid_blocks()) * block_threads) {
      const A g = gates[t];
      A dg = A(0);
      for (int h = 0; h < hidden; ++h) {
        const A d = A(widen(dout(t, h)));
        dy(t, h) = narrow<T>(simt::mul(g, d));
        dg = simt::add(dg, simt::mul(d, A(widen(y(t, h)))));
      }
      if (gated) dpre[t] = simt::mul(simt::mul(dg, g), simt::add(A(1), -g));
    }
  }
};

//! grad[h] += sum_t dpre[t] x[t, h]: the sum over t in ascending order (one thread per column)
//! in accumulator_t<T>, then added to grad once, as the GEMMs add a backward's weight gradient
//! (beta = 1): backwards of forwards in flight give the same bits in any order. (The host
//! shared expert adds each token's product to grad in turn: the same value within rounding.)
template <class T, class G>
struct shared_gate_weight_grad_kernel {
  using A = accumulator_t<T>;
  static constexpr int block_threads = 128;
  static constexpr const char* name = "shared_gate_weight_grad";

  rows_arg<const T> x;  //!< [N, H]
  const A* dpre;        //!< [N]
  int num_tokens, hidden;
  G* grad;  //!< [H] accumulated into

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using moefold::detail::widen;
    for (long long h = static_cast<long long>(c.block()) * block_threads + c.thread(); h < hidden;
         h += static_cast<long long>(c.grid_blocks()) * block_threads) {
      A acc = A(0);
      for (int t = 0; t < num_tokens; ++t)
        acc = simt::add(acc, simt::mul(dpre[t], A(widen(x(t, h)))));
      grad[h] = static_cast<G>(simt::add(static_cast<A>(grad[h]), acc));
    }
  }
};

//! dx[t, h] = round(dx[t, h] + round(dpre[t]) w_g[h]): the gate's part of the input gradient.
template <class T>
struct shared_gate_dx_kernel {
  using A = accumulator_t<T>;
  static constexpr int block_threads = 256;
  static constexpr const char* name = "shared_gate_dx";

  const A* dpre;  //!< [N]
  const T* gate;  //!< [H]
  int num_tokens, hidden;
  rows_arg<T> dx;  //!< [N, H]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    using moefold::detail::narrow;
    using moefold::detail::widen;
    detail_elementwise::for_each_element(c, num_tokens, hidden, [&](long long t, long long h) {
      const A d = A(widen(narrow<T>(dpre[t])));  // the host keeps dpre as T for dx
      dx(t, h) = narrow<T>(simt::add(A(widen(dx(t, h))), simt::mul(d, A(widen(gate[h])))));
    });
  }
};

}  // namespace moefold::kernels
