// expect: rule 5 (moe_world_not_divisible)
// A static fold of 6 ranks cannot hold 4-way expert parallelism.
#include <moefold/mesh/fold.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using F = folded_mesh<mesh<axis::tp<1>, axis::dp<6>>, mesh<axis::etp<1>, axis::ep<3>>>;
#else
using F = folded_mesh<mesh<axis::tp<1>, axis::dp<6>>, mesh<axis::etp<1>, axis::ep<4>>>;
#endif
int main() { return F{}.edp(); }
