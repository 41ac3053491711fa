// expect: rule 4 (order_missing_axis)
// cp = 2 but the order has no cp token.
#include <moefold/mesh/fold.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using F = folded_mesh<mesh<axis::tp<1>, axis::cp<2>, axis::dp<2>, axis::pp<2>>,
                      mesh<axis::etp<1>, axis::ep<2>>, megatron_order{"tp-cp-ep-dp-pp"}>;
#else
using F = folded_mesh<mesh<axis::tp<1>, axis::cp<2>, axis::dp<2>, axis::pp<2>>,
                      mesh<axis::etp<1>, axis::ep<2>>, megatron_order{"tp-ep-dp-pp"}>;
#endif
int main() { return F{}.edp(); }
