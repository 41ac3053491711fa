// libFuzzer target (clang -fsanitize=fuzzer,address,undefined): the safetensors reader and the
// dense-checkpoint layer checks of moefold-upcycle (examples/safetensors_file.hpp,
// examples/dense_checkpoint.hpp). Each input is a whole file, handed to the reader through a
// memfd. A file the reader accepts must have tensors that tile its data section exactly, and every
// rectangle of every matrix must then read without error (no read outside the file); a file it
// refuses must give a one-line message naming the file. Anything else aborts, as do crashes, hangs
// and sanitizer reports. run_fuzz.py runs it in CI and replays the corpus through the tool.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dense_checkpoint.hpp"
#include "safetensors_file.hpp"

namespace {

[[noreturn]] void fail(const char* why, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", why, message.c_str());
  std::abort();
}

void check_message(const std::string& m, const std::string& path) {
  if (m.empty()) fail("empty error message", m);
  if (m.find_first_of("\n\r") != std::string::npos) fail("error message of several lines", m);
  if (m.find(path) == std::string::npos) fail("error message does not name the file", m);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace st = moefold::examples::safetensors;
  const int fd = ::memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) fail("memfd_create", "");
  for (std::size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) fail("write", "");
    done += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (auto r = st::reader::open(path)) {
    std::uint64_t bytes = 0;
    for (const auto& t : r->tensors()) {
      if (t.end - t.begin != t.elements() * st::dtype_size(t.dtype)) fail("size rule", t.name);
      bytes += t.end - t.begin;
      if (t.shape.size() != 2 || t.end == t.begin) continue;
      const std::uint64_t R = t.shape[0], C = t.shape[1], es = st::dtype_size(t.dtype);
      // The whole matrix (bounded), its last row and its last column: all inside the file.
      const std::uint64_t rows = R < 64 ? R : 64;
      std::vector<std::byte> buf(rows * C * es);
      if (!r->read_rect(t, 0, rows, 0, C, buf)) fail("read of an accepted tensor failed", t.name);
      buf.resize(C * es);
      if (!r->read_rect(t, R - 1, 1, 0, C, buf)) fail("read of its last row failed", t.name);
      buf.resize(rows * es);
      if (!r->read_rect(t, 0, rows, C - 1, 1, buf)) fail("read of its last column failed", t.name);
    }
    if (r->header_bytes() + bytes != size) fail("tensors do not tile the data", path);
    if (auto c = moefold::examples::dense_checkpoint::open(path)) {
      for (int i = 0; i < c->num_layers() && i < 4; ++i)
        if (auto l = c->layer(i); !l) check_message(l.error().message, path);
    } else {
      check_message(c.error().message, path);
    }
  } else {
    check_message(r.error().message, path);
  }
  ::close(fd);
  return 0;
}
