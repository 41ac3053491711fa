//! @file config.hpp
//! @brief Portability macros. Every macro of the library lives here and starts with MOEFOLD_.
#pragma once

// Functions that are callable from host and device code when compiled by nvcc, and plain
// functions otherwise, so that the mesh algebra is one piece of code on both sides.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define MOEFOLD_HOST_DEVICE __host__ __device__
#define MOEFOLD_DEVICE __device__
#else
#define MOEFOLD_HOST_DEVICE
#define MOEFOLD_DEVICE
#endif

// Statements that only the host compiles: nvcc's device pass drops them. The CPU executor's
// context (core/cpu_launch.hpp) has __host__ __device__ members, so that kernel bodies
// instantiated with it in a .cu file call no host function, and does its host work in these.
#if defined(__CUDA_ARCH__)
#define MOEFOLD_CPU_ONLY(...)
#else
#define MOEFOLD_CPU_ONLY(...) __VA_ARGS__
#endif

#if defined(_MSC_VER)
#define MOEFOLD_NO_UNIQUE_ADDRESS [[msvc::no_unique_address]]
#else
#define MOEFOLD_NO_UNIQUE_ADDRESS [[no_unique_address]]
#endif
