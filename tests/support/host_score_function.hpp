//! @file host_score_function.hpp
//! @brief The tests' host reference: The router's score functions (softmax, sigmoid, sqrt-softplus)
//! and their derivatives, written the way Megatron-Core's PyTorch code evaluates them, so that fp32
//! results agree to rounding. The enum naming them is core/score_function.hpp's.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>

#include <moefold/core/score_function.hpp>

namespace moefold {
inline namespace v0_1 {

namespace detail {

template <class T>
[[nodiscard]] T sigmoid(T x) noexcept {
  // Two branches so that exp never overflows.
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

// torch.nn.functional.softplus with beta 1 and threshold 20: the identity above the threshold.
template <class T>
[[nodiscard]] T softplus(T x) noexcept {
  return x > T(20) ? x : std::log1p(std::exp(x));
}
template <class T>
[[nodiscard]] T softplus_grad(T x) noexcept {
  return x > T(20) ? T(1) : sigmoid(x);
}

//! The per-expert score of sigmoid or sqrt-softplus.
template <class T>
[[nodiscard]] T elementwise_score(score_function f, T x) noexcept {
  return f == score_function::sigmoid ? sigmoid(x) : std::sqrt(softplus(x));
}
//! d score / d x, given x and score = elementwise_score(f, x).
template <class T>
[[nodiscard]] T elementwise_score_grad(score_function f, T x, T score) noexcept {
  if (f == score_function::sigmoid) return score * (T(1) - score);
  // d sqrt(sp(x)) = sp'(x) / (2 sqrt(sp(x))); sp(x) > 0 for finite x, but it underflows to 0 far
  // below zero, where the true derivative tends to 0 as well.
  return score > T(0) ? softplus_grad(x) / (T(2) * score) : T(0);
}

//! out = softmax(x), max-subtracted; x and out may alias.
template <class T>
void softmax(std::span<const T> x, std::span<T> out) noexcept {
  if (x.empty()) return;
  const T m = *std::max_element(x.begin(), x.end());
  T sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    out[i] = std::exp(x[i] - m);
    sum += out[i];
  }
  for (std::size_t i = 0; i < x.size(); ++i) out[i] /= sum;
}

//! log(sum exp(x)), max-subtracted.
template <class T>
[[nodiscard]] T logsumexp(std::span<const T> x) noexcept {
  const T m = *std::max_element(x.begin(), x.end());
  T sum = 0;
  for (T v : x) sum += std::exp(v - m);
  return m + std::log(sum);
}

//! Backward of y = softmax(x): dx = y * (dy - <y, dy>). dx may alias dy.
template <class T>
void softmax_backward(std::span<const T> y, std::span<const T> dy, std::span<T> dx) noexcept {
  T dot = 0;
  for (std::size_t i = 0; i < y.size(); ++i) dot += y[i] * dy[i];
  for (std::size_t i = 0; i < y.size(); ++i) dx[i] = y[i] * (dy[i] - dot);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
