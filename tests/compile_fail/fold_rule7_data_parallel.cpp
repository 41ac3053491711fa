// expect: rule 7 (fold_data_parallel_mismatch)
// Worked example 3 (world 64, tp2 pp4 ep8 etp1) is legal only with pp last.
#include <moefold/mesh/fold.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using F = folded_mesh<mesh<axis::tp<2>, axis::dp<8>, axis::pp<4>>, mesh<axis::etp<1>, axis::ep<8>>,
                      megatron_order{"tp-cp-ep-dp-pp"}>;
#else
using F = folded_mesh<mesh<axis::tp<2>, axis::dp<8>, axis::pp<4>>, mesh<axis::etp<1>, axis::ep<8>>,
                      megatron_order{"tp-cp-ep-pp-dp"}>;
#endif
int main() { return F{}.edp(); }
