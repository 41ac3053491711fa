#include <moefold/moefold.hpp>

#include <cstdio>
using namespace moefold;

// 16 GPUs. Attention: TP2 x CP2 x DP2 x PP2. MoE: ETP1 x EP4 (x EDP2, derived) x PP2.
using fold = folded_mesh<mesh<axis::tp<2>, axis::cp<2>, axis::dp<2>, axis::pp<2>>,
                         mesh<axis::etp<1>, axis::ep<4>>>;
static_assert(std::is_empty_v<fold>);  // all sizes static: zero bytes
static_assert(decltype(fold{}.size<axis::edp>())::value == 2);
constexpr megatron_groups groups{fold{}};          // computed at compile time
static_assert(groups(group_kind::ep)(1, 0) == 4);  // EP groups [0,1,2,3] [4,5,6,7] ...

int main() {
  // The same fold checked at run time, as when the sizes come from a config file:
  auto f = make_folded({.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1});
  if (!f) {
    std::printf("%s\n", f.error().message.c_str());  // names the rule broken
    return 1;
  }
  const megatron_groups g(*f);
  for (int r : g(group_kind::edp)[0]) std::printf("%d ", r);  // prints "0 4"
  std::printf("\n");
  return g(group_kind::ep) == groups(group_kind::ep) ? 0 : 1;
}
