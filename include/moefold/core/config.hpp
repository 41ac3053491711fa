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
// context (exec/cpu_launch.hpp) has __host__ __device__ members, so that kernel bodies
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

// ThreadSanitizer must be told when the CPU executor switches fibers (each CUDA thread its own
// TSan fiber) and where its barriers order memory (exec/cpu_fibers.hpp, exec/cpu_launch.hpp).
#if defined(__SANITIZE_THREAD__)
#define MOEFOLD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MOEFOLD_TSAN 1
#endif
#endif
#if !defined(MOEFOLD_TSAN)
#define MOEFOLD_TSAN 0
#endif
// On a function: ThreadSanitizer neither checks nor records its own reads and writes (what it
// calls is checked as usual). For the CPU executor's bookkeeping, which the fibers of one OS
// thread share one at a time: the executor's state, not the kernel's. A function attribute, not
// TSan's ignore annotations, which save a stack trace at every call.
#if MOEFOLD_TSAN
#define MOEFOLD_TSAN_UNCHECKED __attribute__((no_sanitize("thread")))
#else
#define MOEFOLD_TSAN_UNCHECKED
#endif

// How the CPU executor (exec/cpu_launch.hpp) runs the CUDA threads of a block: as fibers of one
// OS thread per block (exec/cpu_fibers.hpp), where <ucontext.h> exists. A barrier is then a
// switch of stacks instead of waking every thread of the block through the kernel, ten to a
// hundred times cheaper on a machine with few cores. Under ThreadSanitizer each fiber is its own
// TSan fiber (its own thread identity) and only the barriers order memory between them, so TSan
// checks every shared-memory access between two barriers against the other threads' as it would
// with OS threads. Define MOEFOLD_CPU_EXEC_THREADS to 1 to have an OS thread per CUDA thread.
#if !defined(MOEFOLD_CPU_EXEC_THREADS)
#if __has_include(<ucontext.h>)
#define MOEFOLD_CPU_EXEC_THREADS 0
#else
#define MOEFOLD_CPU_EXEC_THREADS 1
#endif
#endif

// How the CPU executor's fibers switch stacks (exec/cpu_fibers.hpp): on x86-64 without shadow
// stacks, by a six-register switch of moefold's own; elsewhere (or defined to 0) by glibc's
// swapcontext, which makes a system call for the signal mask at every switch.
#if !defined(MOEFOLD_CPU_FIBER_ASM)
#if defined(__x86_64__) && !(defined(__CET__) && (__CET__ & 2))
#define MOEFOLD_CPU_FIBER_ASM 1
#else
#define MOEFOLD_CPU_FIBER_ASM 0
#endif
#endif

// AddressSanitizer must be told when the CPU executor switches stacks between fibers.
#if defined(__SANITIZE_ADDRESS__)
#define MOEFOLD_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOEFOLD_ASAN 1
#endif
#endif
#if !defined(MOEFOLD_ASAN)
#define MOEFOLD_ASAN 0
#endif
