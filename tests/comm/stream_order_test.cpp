// The stream-order fake (tests/support/stream_order_fake.hpp) over the GPU collectives test's
// buffer set-up (tests/comm/device_vec.hpp, the code gpu_collectives_test.cu runs with the CUDA
// runtime): as written it orders every fill before the collective that reads it and the
// collective before the host reads its result; without the synchronization after a fill (the
// defect gpu-design.md section 5 names) the fake reports the race. Then the rules themselves:
// stream order, events, the legacy stream's barriers, host waits, write after read.
#include <doctest/doctest.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "../support/stream_order_fake.hpp"
#include "device_vec.hpp"

using namespace moefold::test;
using fake = stream_order_fake;

namespace {

fake::range bytes_of(const void* p, std::size_t n) { return {p, n}; }

// The set-up's runtime calls on the fake: what each CUDA call reads and writes, on which stream,
// and when the host waits. `sync_after_fill = false` is the set-up before its fix.
struct fake_setup_calls {
  fake* f = nullptr;
  bool sync_after_fill = true;
  std::vector<std::unique_ptr<std::byte[]>> blocks;
  int allocations = 0;

  void* allocate(std::size_t bytes) {
    blocks.push_back(std::make_unique<std::byte[]>(bytes));
    f->name(bytes_of(blocks.back().get(), bytes), "buffer " + std::to_string(allocations++));
    return blocks.back().get();
  }
  void release(void*) {}
  // cudaMemcpy from pageable memory: the host stages the source before the call returns, the
  // copy to the device runs on the legacy stream later.
  void fill_from_host(void* dst, const void* src, std::size_t bytes) {
    f->host_access({bytes_of(src, bytes)}, {}, "cudaMemcpy staging its source");
    f->enqueue(fake::legacy(), {}, {bytes_of(dst, bytes)}, "cudaMemcpy to the device");
  }
  void fill_bytes(void* dst, int, std::size_t bytes) {
    f->enqueue(fake::legacy(), {}, {bytes_of(dst, bytes)}, "cudaMemset");
  }
  void synchronize_legacy() {
    if (sync_after_fill) f->synchronize(fake::legacy());
  }
  // cudaMemcpy to pageable memory: on the legacy stream, returns when done.
  void to_host(void* dst, const void* src, std::size_t bytes) {
    f->enqueue(fake::legacy(), {bytes_of(src, bytes)}, {bytes_of(dst, bytes)},
               "cudaMemcpy to the host");
    f->synchronize(fake::legacy());
  }
};

// check_collectives' shape: fill a send buffer, poison a receive buffer, a collective on a
// non-blocking stream, synchronize it, read the result on the host.
std::vector<std::string> collective_round(bool sync_after_fill, bool sync_collective) {
  fake f;
  fake_setup_calls rt{.f = &f, .sync_after_fill = sync_after_fill, .blocks = {}, .allocations = 0};
  const fake::stream s = f.create_stream(/*non_blocking=*/true);
  {
    const std::vector<float> values = {1, 2, 3, 4};
    basic_device_vec<float, fake_setup_calls> send(rt, values);
    basic_device_vec<float, fake_setup_calls> recv(rt, std::size_t{4});
    f.enqueue(s, {bytes_of(send.p, 16)}, {bytes_of(recv.p, 16)}, "all_to_all_v");
    if (sync_collective) f.synchronize(s);  // the communicator's synchronize()
    const std::vector<float> got = recv.host();
    f.host_access({bytes_of(got.data(), 16)}, {}, "the check of the result");
  }
  return f.violations();
}

bool any_says(const std::vector<std::string>& v, const std::string& a, const std::string& b) {
  for (const auto& s : v)
    if (s.find(a) != std::string::npos && s.find(b) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("the GPU collectives test's set-up, as written, orders every access") {
  CHECK(collective_round(true, true).empty());
}

TEST_CASE("without the synchronization after a fill, the collective races the fill") {
  const auto v = collective_round(false, true);
  REQUIRE_FALSE(v.empty());
  // The collective on stream 1 reads buffer 0 (send), which the copy on the legacy stream wrote.
  CHECK(any_says(v, "all_to_all_v (stream 1) reads 'buffer 0'",
                 "cudaMemcpy to the device (stream 0) wrote"));
  // ... and writes buffer 1 (recv) while the poisoning memset may still be running.
  CHECK(any_says(v, "all_to_all_v (stream 1) writes 'buffer 1'", "cudaMemset (stream 0) wrote"));
}

TEST_CASE("without synchronizing the collective's stream, the copy back races the collective") {
  const auto v = collective_round(true, false);
  CHECK(any_says(v, "cudaMemcpy to the host (stream 0) reads 'buffer 1'",
                 "all_to_all_v (stream 1) wrote"));
}

TEST_CASE("stream order, events and host waits") {
  std::vector<std::byte> a(64), b(64);
  const fake::range A = bytes_of(a.data(), 64), B = bytes_of(b.data(), 64);
  SUBCASE("one stream is ordered") {
    fake f;
    const auto s = f.create_stream(true);
    f.enqueue(s, {}, {A}, "fill");
    f.enqueue(s, {A}, {B}, "kernel");
    f.synchronize(s);
    f.host_access({B}, {}, "check");
    CHECK(f.violations().empty());
  }
  SUBCASE("two non-blocking streams need an event") {
    for (bool with_event : {false, true}) {
      CAPTURE(with_event);
      fake f;
      const auto s1 = f.create_stream(true), s2 = f.create_stream(true);
      const auto e = f.create_event();
      f.enqueue(s1, {}, {A}, "producer");
      f.record(e, s1);
      if (with_event) f.wait(s2, e);
      f.enqueue(s2, {A}, {}, "consumer");
      CHECK(f.violations().empty() == with_event);
    }
  }
  SUBCASE("the legacy stream orders blocking streams, not non-blocking ones") {
    for (bool non_blocking : {false, true}) {
      CAPTURE(non_blocking);
      fake f;
      const auto s = f.create_stream(non_blocking);
      f.enqueue(fake::legacy(), {}, {A}, "memset on the legacy stream");
      f.enqueue(s, {A}, {}, "kernel");
      CHECK(f.violations().empty() == !non_blocking);
    }
  }
  SUBCASE("the host reads a result only after a wait: stream, event or device") {
    for (int wait = 0; wait < 4; ++wait) {
      CAPTURE(wait);
      fake f;
      const auto s = f.create_stream(true);
      const auto e = f.create_event();
      f.enqueue(s, {A}, {B}, "copy to pinned host memory");
      f.record(e, s);
      if (wait == 1) f.synchronize(s);
      if (wait == 2) f.synchronize(e);
      if (wait == 3) f.synchronize_device();
      f.host_access({B}, {}, "host reads the copy");
      CHECK(f.violations().empty() == (wait != 0));
    }
  }
  SUBCASE("write after read: refilling a pinned source before its copy ran") {
    for (bool waited : {false, true}) {
      CAPTURE(waited);
      fake f;
      const auto s = f.create_stream(true);
      f.enqueue(s, {A}, {B}, "cudaMemcpyAsync from pinned memory");
      if (waited) f.synchronize(s);
      f.host_access({}, {A}, "host refills the source");
      CHECK(f.violations().empty() == waited);
      if (!waited)
        CHECK(any_says(f.violations(), "host refills the source (host) writes",
                       "cudaMemcpyAsync from pinned memory (stream 1) read"));
    }
  }
  SUBCASE("reads never conflict; disjoint bytes never conflict") {
    fake f;
    const auto s1 = f.create_stream(true), s2 = f.create_stream(true);
    f.enqueue(s1, {A}, {bytes_of(b.data(), 32)}, "first half");
    f.enqueue(s2, {A}, {bytes_of(b.data() + 32, 32)}, "second half");
    CHECK(f.violations().empty());
  }
}
