#include <moefold/moefold.hpp>

#include <cstdio>

int odr_a();

int main() {
  const int b = moefold::make_folded({.world = 8, .tp = 4}).value().dp();
  std::printf("dp %d and %d\n", odr_a(), b);
  return odr_a() == 4 && b == 2 ? 0 : 1;
}
