//! @file cpu_fibers.hpp
//! @brief The CPU executor's fibers: `cpu_fibers::run(n, order, body, ready, ctx)` runs body(ctx,
//! t) for every t in [0, n) as fibers (each its own stack) on the calling OS thread, and returns
//! when every body has returned. A fiber gives way with `yield(t)`; the scheduler resumes fibers
//! in `order`, pass after pass, skipping a yielded fiber while ready(ctx, t) is false. This is how
//! exec/cpu_launch.hpp runs the CUDA threads of a block (config.hpp, MOEFOLD_CPU_EXEC_THREADS): a
//! barrier is then two stack switches per thread instead of waking every thread of the block
//! through the kernel.
//!
//! A switch: on x86-64 (without shadow stacks), `moefold_fiber_switch` below saves six registers
//! and the floating-point control words, no system call; elsewhere glibc's swapcontext, whose
//! signal-mask system call costs ten times as much. Each OS thread has its own set
//! (`local_fibers()`, a thread_local) whose stacks are kept for the next run. A stack is 256 KiB
//! of lazily committed memory with a guard page below it, so a body that overflows it faults at
//! once instead of writing over another fiber's stack. AddressSanitizer is told of every switch
//! (its fiber interface), so it checks each fiber's stack as a stack.
//!
//! ThreadSanitizer: every fiber is a TSan fiber of its own (a thread identity in its reports), and
//! the switches order memory one way only. Resuming a fiber orders what the scheduler did before
//! (the poisoned shared memory, the kernel's arguments) before the fiber's accesses; a fiber's
//! yield orders nothing, so that nothing one CUDA thread does reaches another through the
//! scheduler: between the threads of a block only the barriers' own annotations
//! (exec/cpu_launch.hpp) order memory, and TSan reports two accesses no barrier separates. A
//! fiber's end orders everything it did before what the scheduler does next (the next block's
//! poison, the results read on the host); every thread of a block has passed the block's exit
//! barrier by then. The scheduler's own bookkeeping (which fiber yielded, which barrier it waits
//! at) is excluded from TSan's checks: the fibers of one OS thread never run at once, and that
//! state is the executor's, not the kernel's.
#pragma once

#include "../core/config.hpp"

#if !MOEFOLD_CPU_EXEC_THREADS

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if MOEFOLD_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#if MOEFOLD_TSAN
#include <sanitizer/tsan_interface.h>
#endif

#if MOEFOLD_CPU_FIBER_ASM
#if !defined(__CUDA_ARCH__)  // nvcc's device pass: host code only, nothing to assemble
// moefold_fiber_switch(save, load): pushes the callee-saved registers and the MXCSR and x87
// control words, stores the stack pointer in *save, takes `load` as the stack pointer, pops what
// was saved there and returns into that fiber. In a COMDAT section: one copy in a program however
// many translation units include this header.
asm(R"(
  .pushsection .text.moefold_fiber_switch,"axG",@progbits,moefold_fiber_switch,comdat
  .globl moefold_fiber_switch
  .hidden moefold_fiber_switch
  .type moefold_fiber_switch,@function
  .p2align 4
moefold_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size moefold_fiber_switch, .-moefold_fiber_switch
  .popsection
)");
#endif
extern "C" void moefold_fiber_switch(void** save, void* load);
#endif

namespace moefold {
inline namespace v0_1 {
namespace detail {

class cpu_fibers {
 public:
  static constexpr std::size_t stack_bytes = std::size_t{256} << 10;

  cpu_fibers() = default;
  cpu_fibers(const cpu_fibers&) = delete;
  cpu_fibers& operator=(const cpu_fibers&) = delete;
  ~cpu_fibers() {
    for (auto& f : fibers_) {
#if MOEFOLD_TSAN
      __tsan_destroy_fiber(f.tsan);
#endif
      ::munmap(f.map, f.map_bytes);
    }
  }

  //! Runs body(ctx, t), t in [0, n), as fibers resumed in `order` (a permutation of [0, n));
  //! returns false when fibers remain that have yielded and none is ready (the caller's
  //! barriers detect a block that can make no progress before that; this is the last guard
  //! against a hang). One run at a time per OS thread; not reentrant.
  [[nodiscard]] MOEFOLD_TSAN_UNCHECKED bool run(int n, const int* order, void (*body)(void*, int),
                                                bool (*ready)(void*, int), void* ctx) {
    if (n <= 0) return true;
    grow(n);
    body_ = body;
    ctx_ = ctx;
    for (int t = 0; t < n; ++t) start_at_entry(fibers_[static_cast<std::size_t>(t)]);
    int left = n;
    while (left > 0) {
      bool resumed = false;
      for (int i = 0; i < n; ++i) {
        const int t = order[i];
        auto& f = fibers_[static_cast<std::size_t>(t)];
        if (f.done || (f.yielded && !ready(ctx, t))) continue;
        f.yielded = false;
        resume(f);
        resumed = true;
        if (f.done) --left;
      }
      if (!resumed) return false;
    }
    return true;
  }

  //! Fiber t gives way to the scheduler; returns when the scheduler resumes it.
  MOEFOLD_TSAN_UNCHECKED void yield(int t) {
    auto& f = fibers_[static_cast<std::size_t>(t)];
    f.yielded = true;
#if MOEFOLD_ASAN
    __sanitizer_start_switch_fiber(&f.fake_stack, main_bottom_, main_size_);
#endif
#if MOEFOLD_TSAN
    // No order from this fiber to the scheduler: it would pass on to the next fiber resumed.
    __tsan_switch_to_fiber(main_tsan_, __tsan_switch_to_fiber_no_sync);
#endif
#if MOEFOLD_CPU_FIBER_ASM
    moefold_fiber_switch(&f.sp, main_sp_);
#else
    if (::swapcontext(&f.uc, &main_uc_) != 0) fatal("swapcontext");
#endif
#if MOEFOLD_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
  }

  //! How many fiber stacks the set holds (the most one run asked for).
  [[nodiscard]] std::size_t size() const noexcept { return fibers_.size(); }

 private:
  struct fiber {
#if MOEFOLD_CPU_FIBER_ASM
    void* sp = nullptr;  // the saved stack pointer while it is not running
#else
    ucontext_t uc;
#endif
    void* map = nullptr;
    std::size_t map_bytes = 0;
    std::byte* stack = nullptr;  // the lowest address of the stack (above the guard page)
    void* fake_stack = nullptr;
#if MOEFOLD_TSAN
    void* tsan = nullptr;  // its TSan fiber
#endif
    bool yielded = false, done = false;
  };

  [[noreturn]] static void fatal(const char* what) {
    std::fprintf(stderr, "cpu_exec: %s failed while switching fibers\n", what);
    std::abort();
  }

  MOEFOLD_TSAN_UNCHECKED void grow(int n) {
    if (static_cast<int>(fibers_.size()) >= n) return;
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    fibers_.reserve(static_cast<std::size_t>(n));  // addresses of fibers never change in a run
    while (static_cast<int>(fibers_.size()) < n) {
      fiber f{};
      f.map_bytes = stack_bytes + page;
      f.map = ::mmap(nullptr, f.map_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (f.map == MAP_FAILED) fatal("mmap of a fiber stack");
      if (::mprotect(f.map, page, PROT_NONE) != 0) fatal("mprotect of a guard page");
      f.stack = static_cast<std::byte*>(f.map) + page;
#if MOEFOLD_TSAN
      f.tsan = __tsan_create_fiber(0);
#endif
      fibers_.push_back(f);
    }
  }

  // Makes fiber f start at entry() when next resumed.
  MOEFOLD_TSAN_UNCHECKED void start_at_entry(fiber& f) {
    f.yielded = f.done = false;
#if MOEFOLD_CPU_FIBER_ASM
    // The frame moefold_fiber_switch pops, from the stack pointer up: x87 control word, MXCSR,
    // r15, r14, r13, r12, rbx, rbp, then the return address (entry). entry() then starts with the
    // stack pointer at 8 mod 16, as after a call, above a zero return address that ends any
    // unwinding there.
    auto* top = reinterpret_cast<std::uint64_t*>(f.stack + stack_bytes);  // 16-byte aligned
    std::uint64_t* sp = top - 10;
    std::uint32_t mxcsr = 0;
    std::uint16_t fcw = 0;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fcw));
    sp[0] = fcw;
    sp[1] = mxcsr;
    for (int r = 2; r < 8; ++r) sp[r] = 0;
    sp[8] = reinterpret_cast<std::uint64_t>(&entry);
    sp[9] = 0;
    f.sp = sp;
#else
    if (::getcontext(&f.uc) != 0) fatal("getcontext");
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = stack_bytes;
    f.uc.uc_link = nullptr;
    ::makecontext(&f.uc, &entry, 0);
#endif
  }

  MOEFOLD_TSAN_UNCHECKED void resume(fiber& f) {
    current_ = static_cast<int>(&f - fibers_.data());
#if MOEFOLD_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack, stack_bytes);
#endif
#if MOEFOLD_TSAN
    main_tsan_ = __tsan_get_current_fiber();
    __tsan_switch_to_fiber(f.tsan, 0);  // what the scheduler did is ordered before the fiber
#endif
#if MOEFOLD_CPU_FIBER_ASM
    moefold_fiber_switch(&main_sp_, f.sp);
#else
    if (::swapcontext(&main_uc_, &f.uc) != 0) fatal("swapcontext");
#endif
#if MOEFOLD_ASAN
    __sanitizer_finish_switch_fiber(fake, &main_bottom_, &main_size_);
#endif
  }

  // A fiber's first frame: the OS thread's own set runs the body of the fiber being resumed.
  MOEFOLD_TSAN_UNCHECKED static void entry() {
    cpu_fibers& self = local_fibers_of_this_thread();
#if MOEFOLD_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &self.main_bottom_, &self.main_size_);
#endif
    const int t = self.current_;
    self.body_(self.ctx_, t);
    auto& f = self.fibers_[static_cast<std::size_t>(t)];
    f.done = true;
#if MOEFOLD_ASAN
    // nullptr: this fiber's frames end here (its stack is reused by the next run).
    __sanitizer_start_switch_fiber(nullptr, self.main_bottom_, self.main_size_);
#endif
#if MOEFOLD_TSAN
    // Ordered: every thread of the block has passed its exit barrier, and what the scheduler
    // does next (the next block's poison, the host's reads) must follow what this fiber did.
    __tsan_switch_to_fiber(self.main_tsan_, 0);
#endif
#if MOEFOLD_CPU_FIBER_ASM
    moefold_fiber_switch(&f.sp, self.main_sp_);
#else
    ::setcontext(&self.main_uc_);
#endif
    fatal("a finished fiber resumed");
  }

  static cpu_fibers& local_fibers_of_this_thread();

  std::vector<fiber> fibers_;
#if MOEFOLD_CPU_FIBER_ASM
  void* main_sp_ = nullptr;
#else
  ucontext_t main_uc_{};
#endif
#if MOEFOLD_ASAN
  const void* main_bottom_ = nullptr;  // the OS thread's own stack, for AddressSanitizer
  std::size_t main_size_ = 0;
#endif
#if MOEFOLD_TSAN
  void* main_tsan_ = nullptr;  // the OS thread's own TSan identity, for TSan
#endif
  int current_ = 0;  // the fiber being resumed
  void (*body_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
};

//! The calling OS thread's fibers.
[[nodiscard]] inline cpu_fibers& local_fibers() {
  thread_local cpu_fibers f;
  return f;
}
inline cpu_fibers& cpu_fibers::local_fibers_of_this_thread() { return local_fibers(); }

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold

#endif  // !MOEFOLD_CPU_EXEC_THREADS
