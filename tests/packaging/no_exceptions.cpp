// The headers build with -fno-exceptions (errors travel in moefold::expected).
#include <moefold/moefold.hpp>

#include <cstdio>

int main() {
  auto f = moefold::make_folded({.world = 12, .tp = 4, .pp = 2});
  if (f) return 1;
  std::printf("rejected as expected: %s\n", f.error().message.c_str());
  auto g = moefold::make_folded({.world = 16, .tp = 2, .pp = 2, .ep = 4, .etp = 1});
  if (!g) return 1;
  const moefold::megatron_groups groups(*g);
  return groups(moefold::group_kind::ep).group_size() == 4 ? 0 : 1;
}
