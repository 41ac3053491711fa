// expect: rule 6 (order_missing_axis)
// ep = 2 but the order has no ep token (the attention side does not need it, the MoE side does).
#include <moefold/mesh/fold.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using F = folded_mesh<mesh<axis::tp<1>, axis::dp<4>, axis::pp<2>>, mesh<axis::etp<1>, axis::ep<2>>,
                      megatron_order{"tp-ep-dp-pp"}>;
#else
using F = folded_mesh<mesh<axis::tp<1>, axis::dp<4>, axis::pp<2>>, mesh<axis::etp<1>, axis::ep<2>>,
                      megatron_order{"tp-dp-pp"}>;
#endif
int main() { return F{}.edp(); }
