// Occupancy of a kernel on an H100 SXM (the limits of compute capability 9.0, 132 SMs) from
// CUDA's own calculator, cuda_occupancy.h (host-only, no device needed). Reads lines
// "NAME THREADS REGISTERS STATIC_SMEM" and prints "NAME BLOCKS_PER_SM OCCUPANCY_PERCENT".
#include <cuda_occupancy.h>

#include <iostream>
#include <string>

int main() {
  cudaOccDeviceProp prop;
  prop.computeMajor = 9;
  prop.computeMinor = 0;
  prop.maxThreadsPerBlock = 1024;
  prop.maxThreadsPerMultiprocessor = 2048;
  prop.regsPerBlock = 65536;
  prop.regsPerMultiprocessor = 65536;
  prop.warpSize = 32;
  prop.sharedMemPerBlock = 48 * 1024;
  prop.sharedMemPerMultiprocessor = 228 * 1024;
  prop.numSms = 132;
  prop.sharedMemPerBlockOptin = 227 * 1024;
  prop.reservedSharedMemPerBlock = 1024;
  std::string name;
  int threads = 0, regs = 0;
  long smem = 0;
  while (std::cin >> name >> threads >> regs >> smem) {
    cudaOccFuncAttributes attr;
    attr.maxThreadsPerBlock = threads;
    attr.numRegs = regs;
    attr.sharedSizeBytes = static_cast<size_t>(smem);
    attr.partitionedGCConfig = PARTITIONED_GC_OFF;
    attr.shmemLimitConfig = FUNC_SHMEM_LIMIT_DEFAULT;
    attr.maxDynamicSharedSizeBytes = 0;
    attr.numBlockBarriers = 1;
    attr.virtualResourceCount = 0;
    cudaOccDeviceState state;
    cudaOccResult result;
    if (cudaOccMaxActiveBlocksPerMultiprocessor(&result, &prop, &attr, &state, threads, 0) !=
        CUDA_OCC_SUCCESS) {
      std::cerr << "occupancy: the calculator refused " << name << "\n";
      return 1;
    }
    std::cout << name << " " << result.activeBlocksPerMultiprocessor << " "
              << 100.0 * result.activeBlocksPerMultiprocessor * threads /
                     prop.maxThreadsPerMultiprocessor
              << "\n";
  }
  return 0;
}
