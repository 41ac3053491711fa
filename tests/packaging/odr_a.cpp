// Two translation units include every header; linking them proves there is no ODR violation
// (every non-template function in a header is inline).
#include <moefold/moefold.hpp>

int odr_a() { return moefold::make_folded({.world = 8, .tp = 2}).value().dp(); }
