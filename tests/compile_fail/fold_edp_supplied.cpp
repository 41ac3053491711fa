// expect: EDP is derived
#include <moefold/mesh/fold.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using F = folded_mesh<mesh<axis::tp<2>, axis::dp<4>>, mesh<axis::etp<1>, axis::ep<4>>>;
#else
using F =
    folded_mesh<mesh<axis::tp<2>, axis::dp<4>>, mesh<axis::etp<1>, axis::ep<4>, axis::edp<2>>>;
#endif
int main() { return F{}.edp(); }
