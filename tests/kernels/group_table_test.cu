// GPU test: the mesh algebra evaluated on the device equals the host's, for every group kind of
// a few folds. Without a GPU it exits 77, which meson counts as skipped.
#include <moefold/kernels/group_table.cuh>
#include <moefold/moefold.hpp>

#include <cstdio>
#include <vector>

namespace {
int failures = 0;
#define EXPECT(cond)                                                       \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::printf("%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                          \
    }                                                                      \
  } while (0)
}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  const moefold::fold_config configs[] = {
      {.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1},
      {.world = 64, .tp = 2, .pp = 4, .ep = 8, .etp = 1},
      {.world = 96, .tp = 4, .cp = 2, .pp = 3, .ep = 16, .etp = 1, .order = "tp-cp-ep-dp-pp"},
      {.world = 256, .tp = 8, .pp = 4, .ep = 32, .etp = 2},
  };
  int cases = 0;
  for (const auto& c : configs) {
    const auto fold = moefold::make_folded(c).value();
    const moefold::megatron_groups groups(fold);
    const int world = fold.world_size();
    int2* d_table = nullptr;
    EXPECT(cudaMalloc(&d_table, sizeof(int2) * world) == cudaSuccess);
    for (int i = 0; i < groups.num_kinds(); ++i) {
      const auto kind = groups.kind_at(i);
      if (kind.kind == moefold::group_kind::embd || kind.kind == moefold::group_kind::pos_embd)
        continue;  // not a partition of the world
      const auto list = groups(kind);
      EXPECT(cudaMemset(d_table, 0xff, sizeof(int2) * world) == cudaSuccess);
      EXPECT(moefold::kernels::launch_fill_group_table(list, 0, d_table, nullptr) == cudaSuccess);
      std::vector<int2> table(static_cast<std::size_t>(world));
      EXPECT(cudaMemcpy(table.data(), d_table, sizeof(int2) * world, cudaMemcpyDeviceToHost) ==
             cudaSuccess);
      for (int r = 0; r < world; ++r) {
        const auto where = list.find(r);
        EXPECT(table[static_cast<std::size_t>(r)].x == where.group);
        EXPECT(table[static_cast<std::size_t>(r)].y == where.position);
      }
      ++cases;
    }
    EXPECT(cudaFree(d_table) == cudaSuccess);
  }
  std::printf("[doctest] test cases: %d | %d passed | %d failed | 0 skipped\n", cases,
              failures ? cases - 1 : cases, failures ? 1 : 0);
  return failures ? 1 : 0;
}
