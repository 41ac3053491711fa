//! @file group_table.cuh
//! @brief Device-side lookup of a rank's group: for every rank, which group of a group_list holds
//! it and at which position. Kernels that route rows between ranks read this table instead of
//! recomputing the layout per element.
#pragma once

#include <cuda_runtime.h>

#include <moefold/mesh/group_list.hpp>

namespace moefold::kernels {

//! One thread per (group, position): table[rank - offset] = {group, position}.
//! Preconditions: `table` has room for list.count() * list.group_size() entries (the groups of a
//! kind that partitions the world), and every rank - offset lies in [0, that size).
//! A template (of nothing) so that every .cu file including this header may instantiate it: a
//! plain __global__ defined in a header is a duplicate symbol at link time (the kernels-cuh test
//! links two such files).
template <class = void>
__global__ void __launch_bounds__(256)
    fill_group_table(group_list list, int offset, int2* table /* (world) */) {
  const int n = list.count() * list.group_size();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int g = i / list.group_size();
    const int k = i % list.group_size();
    table[list(g, k) - offset] = make_int2(g, k);
  }
}

//! Enqueues fill_group_table on `stream`; returns the launch status (no host synchronization).
[[nodiscard]] inline cudaError_t launch_fill_group_table(const group_list& list, int offset,
                                                         int2* table, cudaStream_t stream) {
  const int n = list.count() * list.group_size();
  if (n == 0) return cudaSuccess;
  const int blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  fill_group_table<><<<blocks, 256, 0, stream>>>(list, offset, table);
  // cudaGetLastError, not Peek: it clears the error, so a later check does not report it again.
  return cudaGetLastError();
}

}  // namespace moefold::kernels
