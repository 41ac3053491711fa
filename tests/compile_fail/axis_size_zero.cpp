// expect: a static axis size must be >= 1
#include <moefold/mesh/mesh.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using M = mesh<axis::tp<1>, axis::dp<4>>;
#else
using M = mesh<axis::tp<0>, axis::dp<4>>;
#endif
int main() { return M{}.world_size(); }
