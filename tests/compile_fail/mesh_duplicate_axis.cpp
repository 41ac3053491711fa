// expect: each axis may appear once in a mesh
#include <moefold/mesh/mesh.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
using M = mesh<axis::tp<2>, axis::dp<4>>;
#else
using M = mesh<axis::tp<2>, axis::tp<4>>;
#endif
int main() { return M{}.world_size(); }
