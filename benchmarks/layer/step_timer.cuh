// The timing both layer benchmarks use (bench-layer, bench-gemm): the median of 10 runs of a call,
// each between two CUDA events on its stream, after 3 warm-ups; the calls return a status, and the
// first error of a run is kept for the caller (nvcc warns on assigning a status, hence `keep`).
#pragma once

#include <cuda_runtime.h>
#include <moefold/core/expected.hpp>

#include <algorithm>
#include <optional>
#include <vector>

namespace moefold::bench {

inline void keep(std::optional<error>& first, const status& st) {
  if (!st && !first) first.emplace(st.error());
}

//! Seconds per call of f() -> status on stream s (the median of 10 after 3 warm-ups).
template <class F>
double median_seconds(cudaStream_t s, F&& f, std::optional<error>& last) {
  for (int i = 0; i < 3; ++i) keep(last, f());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(a, s);
    keep(last, f());
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace moefold::bench
