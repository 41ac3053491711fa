// expect: invalid_order_string_literal
#include <moefold/mesh/order.hpp>
using namespace moefold;
#ifdef MOEFOLD_CF_CONTROL
constexpr megatron_order o{"tp-cp-ep-pp-dp"};
#else
constexpr megatron_order o{"tp-cp-xp-pp-dp"};
#endif
int main() { return o.given; }
