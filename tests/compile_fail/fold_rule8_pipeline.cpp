// expect: rule 8 (fold_pipeline_mismatch)
// tp*cp == etp*ep, but before pp the attention order spans tp = 2 ranks and the MoE order etp = 1.
#include <moefold/mesh/fold.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using F = folded_mesh<mesh<axis::tp<2>, axis::cp<2>, axis::dp<2>, axis::pp<2>>,
                      mesh<axis::etp<2>, axis::ep<2>>, megatron_order{"tp-pp-cp-ep-dp"}>;
#else
using F = folded_mesh<mesh<axis::tp<2>, axis::cp<2>, axis::dp<2>, axis::pp<2>>,
                      mesh<axis::etp<1>, axis::ep<4>>, megatron_order{"tp-pp-cp-ep-dp"}>;
#endif
int main() { return F{}.edp(); }
