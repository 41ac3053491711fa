// The kernel headers of an installed moefold (<moefold/kernels/...>), compiled by nvcc in a
// consumer project. With a GPU it fills the EP group table of a fold on the device and compares
// it with the host's; without one it has been compiled and linked, and says so.
#include <moefold/kernels/group_table.cuh>
#include <moefold/moefold.hpp>

#include <cstdio>
#include <vector>

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("kernels: compiled and linked; no CUDA device, not run\n");
    return 0;
  }
  const auto fold =
      moefold::make_folded({.world = 16, .tp = 2, .pp = 2, .ep = 4, .etp = 1}).value();
  const moefold::megatron_groups groups(fold);
  const auto list = groups(moefold::group_kind::ep);
  const int world = fold.world_size();
  int2* d_table = nullptr;
  if (cudaMalloc(&d_table, sizeof(int2) * world) != cudaSuccess) return 1;
  if (moefold::kernels::launch_fill_group_table(list, 0, d_table, nullptr) != cudaSuccess) return 1;
  std::vector<int2> table(static_cast<std::size_t>(world));
  if (cudaMemcpy(table.data(), d_table, sizeof(int2) * world, cudaMemcpyDeviceToHost) !=
      cudaSuccess)
    return 1;
  cudaFree(d_table);
  int wrong = 0;
  for (int r = 0; r < world; ++r) {
    const auto where = list.find(r);
    wrong += table[static_cast<std::size_t>(r)].x != where.group ||
             table[static_cast<std::size_t>(r)].y != where.position;
  }
  std::printf("kernels: EP group table of %d ranks on the device, %d wrong\n", world, wrong);
  return wrong == 0 ? 0 : 1;
}
