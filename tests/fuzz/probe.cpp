// Configure-time probe: does clang++ link a libFuzzer target here (libclang-rt-14-dev)?
#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t*, std::size_t) { return 0; }
