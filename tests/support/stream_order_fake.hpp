// A host fake of CUDA streams and events that checks ordering, not data: each operation names
// the bytes it reads and writes, and the fake asserts that every access to a byte happens after
// the last write of that byte (and every write after the reads and writes before it), where
// "happens after" is CUDA's order: program order on the host, stream order, event record/wait,
// stream and event synchronization, and the legacy default stream's implicit barriers with the
// blocking streams. This is the class of bug gpu-design.md section 5 lists (a buffer filled on
// the legacy stream and read by a collective on a non-blocking stream; an asynchronous copy or
// memset the host takes for finished): a GPU shows it only as a rare wrong result, the fake as
// a violation naming both operations and the buffer.
//
// Happens-before is tracked with vector clocks over agents: agent 0 is the host, agent 1 + i
// stream i (stream 0: the legacy default stream).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace moefold::test {

class stream_order_fake {
 public:
  struct stream {
    int id = 0;
  };
  struct event {
    int id = -1;
  };
  //! Bytes [p, p + bytes) of host or device memory (the fake does not tell them apart).
  struct range {
    const void* p = nullptr;
    std::size_t bytes = 0;
  };

  stream_order_fake() {
    streams_.push_back({.non_blocking = false, .clock = {}});  // the legacy default stream
    host_.assign(1, 0);
  }

  //! The legacy default stream (CUDA's stream 0 / nullptr).
  [[nodiscard]] static constexpr stream legacy() noexcept { return {0}; }
  //! cudaStreamCreate (blocking: ordered with the legacy stream) or cudaStreamCreateWithFlags(
  //! cudaStreamNonBlocking).
  stream create_stream(bool non_blocking) {
    streams_.push_back({.non_blocking = non_blocking, .clock = {}});
    return {static_cast<int>(streams_.size()) - 1};
  }
  event create_event() {
    events_.emplace_back();
    return {static_cast<int>(events_.size()) - 1};
  }
  //! A name for messages (buffers without one are named by address).
  void name(range r, std::string n) { names_.push_back({r, std::move(n)}); }

  //! An operation enqueued by the host on stream s (a kernel, an asynchronous copy or memset, a
  //! collective): after everything the host did before the call and everything enqueued on s
  //! before it (and on the legacy stream: everything on the blocking streams, and the reverse).
  void enqueue(stream s, std::initializer_list<range> reads, std::initializer_list<range> writes,
               const std::string& what) {
    std::vector<std::uint64_t> c = join(streams_[idx(s)].clock, host_);
    if (s.id == 0) {
      for (std::size_t i = 1; i < streams_.size(); ++i)
        if (!streams_[i].non_blocking) c = join(c, streams_[i].clock);
    } else if (!streams_[idx(s)].non_blocking) {
      c = join(c, streams_[0].clock);
    }
    tick(c, agent(s));
    streams_[idx(s)].clock = c;
    access(c, agent(s), reads, writes, what + " (stream " + std::to_string(s.id) + ")");
  }
  //! The host itself reading or writing memory (a result it checks, a source it refills).
  void host_access(std::initializer_list<range> reads, std::initializer_list<range> writes,
                   const std::string& what) {
    tick(host_, 0);
    access(host_, 0, reads, writes, what + " (host)");
  }
  //! cudaEventRecord(e, s), cudaStreamWaitEvent(s, e), cudaEventSynchronize(e).
  void record(event e, stream s) {
    events_[static_cast<std::size_t>(e.id)] = streams_[idx(s)].clock;
  }
  void wait(stream s, event e) {
    streams_[idx(s)].clock = join(streams_[idx(s)].clock, events_[static_cast<std::size_t>(e.id)]);
  }
  void synchronize(event e) { host_ = join(host_, events_[static_cast<std::size_t>(e.id)]); }
  //! cudaStreamSynchronize(s): the host waits for everything enqueued on s.
  void synchronize(stream s) { host_ = join(host_, streams_[idx(s)].clock); }
  //! cudaDeviceSynchronize.
  void synchronize_device() {
    for (const auto& st : streams_) host_ = join(host_, st.clock);
  }

  //! What was found, one line each: the later access, the earlier one, the buffer.
  [[nodiscard]] const std::vector<std::string>& violations() const noexcept { return violations_; }

 private:
  struct stream_state {
    bool non_blocking = false;
    std::vector<std::uint64_t> clock;
  };
  struct access_record {
    range r;
    bool write = false;
    int agent = 0;
    std::uint64_t tick = 0;  // the agent's clock at the access
    std::string what;
  };
  struct named {
    range r;
    std::string name;
  };

  static std::size_t idx(stream s) { return static_cast<std::size_t>(s.id); }
  static int agent(stream s) { return 1 + s.id; }
  static std::vector<std::uint64_t> join(std::vector<std::uint64_t> a,
                                         const std::vector<std::uint64_t>& b) {
    if (a.size() < b.size()) a.resize(b.size(), 0);
    for (std::size_t i = 0; i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
    return a;
  }
  static void tick(std::vector<std::uint64_t>& c, int agent) {
    const auto a = static_cast<std::size_t>(agent);
    if (c.size() <= a) c.resize(a + 1, 0);
    ++c[a];
  }
  static bool overlap(range a, range b) {
    const auto* pa = static_cast<const std::byte*>(a.p);
    const auto* pb = static_cast<const std::byte*>(b.p);
    return a.bytes > 0 && b.bytes > 0 && pa < pb + b.bytes && pb < pa + a.bytes;
  }
  std::string name_of(range r) const {
    for (const auto& n : names_)
      if (overlap(n.r, r)) return "'" + n.name + "'";
    return "bytes at " + std::to_string(reinterpret_cast<std::uintptr_t>(r.p));
  }
  // An earlier access happens before one whose clock c has seen its agent's tick.
  static bool ordered(const access_record& earlier, const std::vector<std::uint64_t>& c) {
    const auto a = static_cast<std::size_t>(earlier.agent);
    return a < c.size() && c[a] >= earlier.tick;
  }
  void check(const std::vector<std::uint64_t>& c, range r, bool write, const std::string& what) {
    for (const auto& e : log_)
      if ((e.write || write) && overlap(e.r, r) && !ordered(e, c))
        violations_.push_back(what + (write ? " writes " : " reads ") + name_of(r) + ", which " +
                              e.what + (e.write ? " wrote" : " read") +
                              ", with nothing ordering the two");
  }
  void access(const std::vector<std::uint64_t>& c, int agent, std::initializer_list<range> reads,
              std::initializer_list<range> writes, const std::string& what) {
    for (range r : reads) check(c, r, false, what);
    for (range r : writes) check(c, r, true, what);
    const std::uint64_t t = c[static_cast<std::size_t>(agent)];
    for (range r : reads) log_.push_back({r, false, agent, t, what});
    for (range r : writes) log_.push_back({r, true, agent, t, what});
  }

  std::vector<stream_state> streams_;
  std::vector<std::vector<std::uint64_t>> events_;
  std::vector<std::uint64_t> host_;
  std::vector<access_record> log_;
  std::vector<named> names_;
  std::vector<std::string> violations_;
};

}  // namespace moefold::test
