// expect: rule (pp shared)
#include <moefold/mesh/fold.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using F = folded_mesh<mesh<axis::dp<4>, axis::pp<2>>, mesh<axis::ep<4>, axis::pp<2>>>;
#else
using F = folded_mesh<mesh<axis::dp<4>, axis::pp<2>>, mesh<axis::ep<4>, axis::pp<4>>>;
#endif
int main() { return F{}.edp(); }
