// safetensors files, read lazily and written atomically, for the tools (moefold-upcycle and the
// training example). The format: an unsigned 64-bit little-endian header length N, N bytes of a
// JSON object (maybe padded with spaces) mapping each tensor name to {"dtype", "shape",
// "data_offsets": [begin, end]} (byte offsets into the data that follows the header) and an
// optional "__metadata__" object of strings, then the data, row-major, little-endian.
//
// The reader reads the header and then only the bytes asked for, with pread (no mmap, so that the
// bytes read are what /proc/self/io counts and a file shrinking under us is an error, not a
// SIGBUS). It is strict, as the reference implementation is: the data of all tensors must tile
// the data section exactly (no gap, no overlap, nothing after), each tensor's byte count must be
// its element count times its dtype's size, and a member name given twice is an error. Every
// error names the file, the tensor where there is one, and the rule broken.
#pragma once

#include <moefold/core/dtype.hpp>
#include <moefold/core/expected.hpp>

#include "json_document.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace moefold::examples::safetensors {

//! The largest header accepted, 100 MiB (the reference implementation allows 100,000,000 bytes,
//! slightly less): a header is read whole.
inline constexpr std::uint64_t max_header_bytes = 100u << 20;

//! The size in bytes of a safetensors dtype, 0 if the name is not one this reader knows (the
//! sub-byte F4/F6 types are not, as their tensors need not fill whole bytes).
[[nodiscard]] inline std::size_t dtype_size(std::string_view dtype) noexcept {
  constexpr std::pair<std::string_view, std::size_t> known[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8}};
  for (auto [name, size] : known)
    if (name == dtype) return size;
  return 0;
}

//! One tensor of a file: its byte range [begin, end) is absolute in the file.
struct tensor_info {
  std::string name;
  std::string dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;
  [[nodiscard]] std::uint64_t elements() const noexcept {
    std::uint64_t n = 1;
    for (auto d : shape) n *= d;  // checked against overflow when the header was read
    return n;
  }
};

namespace detail {

using examples::detail::quoted;

// A non-negative integer member of at most 2^64 - 1.
inline bool as_u64(const ordered_json& v, std::uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<std::uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    out = static_cast<std::uint64_t>(v.get<std::int64_t>());
    return true;
  }
  return false;
}

// An owned file descriptor.
class fd_handle {
 public:
  fd_handle() = default;
  explicit fd_handle(int fd) : fd_(fd) {}
  fd_handle(fd_handle&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  fd_handle& operator=(fd_handle&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  fd_handle(const fd_handle&) = delete;
  fd_handle& operator=(const fd_handle&) = delete;
  ~fd_handle() { reset(); }
  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Reads exactly out.size() bytes at `offset`, or says why not.
[[nodiscard]] inline status pread_all(int fd, std::span<std::byte> out, std::uint64_t offset,
                                      const std::string& what) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n =
        ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return make_error(errc::backend_error, what + ": read failed: " + std::strerror(errno));
    if (n == 0)
      return make_error(errc::invalid_argument,
                        what + ": truncated (the file ended " + std::to_string(out.size() - done) +
                            " bytes early; rule: the data section holds every tensor's bytes)");
    done += static_cast<std::size_t>(n);
  }
  return {};
}

}  // namespace detail

//! A safetensors file opened for reading: its header parsed and checked, no data read yet.
class reader {
 public:
  //! Opens `path` and reads its header (8 + N bytes); every rule of the format is checked here.
  [[nodiscard]] static expected<reader> open(const std::filesystem::path& path) {
    reader r;
    r.path_ = path.string();
    r.fd_ = detail::fd_handle(
        ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));  // a FIFO must not block
    if (r.fd_.get() < 0)
      return make_error(errc::invalid_argument,
                        r.path_ + ": cannot open: " + std::string(std::strerror(errno)));
    struct stat st {};
    if (::fstat(r.fd_.get(), &st) != 0 || !S_ISREG(st.st_mode))
      return make_error(errc::invalid_argument, r.path_ + ": not a regular file");
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < 8)
      return make_error(
          errc::invalid_argument,
          r.path_ + ": truncated (" + std::to_string(size) +
              " bytes; rule: a safetensors file starts with an 8-byte header length)");
    std::array<std::byte, 8> len{};
    if (auto s = detail::pread_all(r.fd_.get(), len, 0, r.path_); !s)
      return unexpected<error>(s.error());
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(len[i]);
    if (n > size - 8)
      return make_error(errc::invalid_argument, r.path_ + ": truncated (the header length " +
                                                    std::to_string(n) + " exceeds the " +
                                                    std::to_string(size - 8) + " bytes after it)");
    if (n > max_header_bytes)
      return make_error(errc::invalid_argument, r.path_ + ": header of " + std::to_string(n) +
                                                    " bytes exceeds the limit of " +
                                                    std::to_string(max_header_bytes));
    if (n < 2)
      return make_error(errc::invalid_argument, r.path_ + ": header of " + std::to_string(n) +
                                                    " bytes (rule: the header is a JSON object)");
    std::string text(n, '\0');
    if (auto s = detail::pread_all(
            r.fd_.get(), std::as_writable_bytes(std::span<char>(text.data(), text.size())), 8,
            r.path_);
        !s)
      return unexpected<error>(s.error());
    r.header_bytes_ = 8 + n;
    if (auto s = r.parse_header(text, size - 8 - n); !s) return unexpected<error>(s.error());
    return r;
  }

  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  //! The bytes of the length field and the header, which open() has read.
  [[nodiscard]] std::uint64_t header_bytes() const noexcept { return header_bytes_; }
  [[nodiscard]] const std::vector<tensor_info>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept {
    return metadata_;
  }
  //! The tensor called `name`, or nullptr.
  [[nodiscard]] const tensor_info* find(std::string_view name) const noexcept {
    auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                               [](const tensor_info& t, std::string_view n) { return t.name < n; });
    return it != tensors_.end() && it->name == name ? &*it : nullptr;
  }

  //! Reads rows [row0, row0 + rows) and columns [col0, col0 + cols) of the 2-D tensor `t` into
  //! `out` ([rows, cols] row-major, raw bytes in the file's dtype): one pread per row, or one in
  //! all when the rectangle spans whole rows, so that only these bytes are read.
  [[nodiscard]] status read_rect(const tensor_info& t, std::uint64_t row0, std::uint64_t rows,
                                 std::uint64_t col0, std::uint64_t cols,
                                 std::span<std::byte> out) const {
    const std::string what = path_ + ": tensor " + detail::quoted(t.name);
    if (t.shape.size() != 2)
      return make_error(errc::shape_mismatch, what + ": a matrix was expected, the tensor has " +
                                                  std::to_string(t.shape.size()) + " dimensions");
    const std::uint64_t R = t.shape[0], C = t.shape[1], es = dtype_size(t.dtype);
    if (row0 > R || rows > R - row0 || col0 > C || cols > C - col0)
      return make_error(errc::shape_mismatch,
                        what + ": rows [" + std::to_string(row0) + ", +" + std::to_string(rows) +
                            ") x columns [" + std::to_string(col0) + ", +" + std::to_string(cols) +
                            ") lie outside its shape [" + std::to_string(R) + ", " +
                            std::to_string(C) + "]");
    if (out.size() != rows * cols * es)
      return make_error(errc::shape_mismatch, what + ": output buffer of the wrong size");
    if (cols == C || rows <= 1)
      return detail::pread_all(fd_.get(), out, t.begin + (row0 * C + col0) * es, what);
    for (std::uint64_t i = 0; i < rows; ++i)
      if (auto s = detail::pread_all(fd_.get(), out.subspan(i * cols * es, cols * es),
                                     t.begin + ((row0 + i) * C + col0) * es, what);
          !s)
        return s;
    return {};
  }

 private:
  reader() = default;

  status bad(const std::string& tensor, const std::string& rule) const {
    return make_error(
        errc::invalid_argument,
        path_ + (tensor.empty() ? "" : ": tensor " + detail::quoted(tensor)) + ": " + rule);
  }

  status parse_header(std::string_view text, std::uint64_t data_bytes) {
    if (text.front() != '{')
      return bad("", "the header does not start with '{' (rule: it is one JSON object)");
    auto doc = parse_json_document(text);
    if (!doc) return bad("", "header: " + doc.error().message);
    if (!doc->is_object()) return bad("", "the header is not a JSON object");
    for (const auto& [name, v] : doc->items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) return bad("", "__metadata__ must be an object of strings");
        for (const auto& [k, s] : v.items()) {
          if (!s.is_string())
            return bad("", "__metadata__ member " + detail::quoted(k) + " must be a string");
          metadata_[k] = s.get<std::string>();
        }
        continue;
      }
      if (!v.is_object())
        return bad(name, "its entry must be an object {dtype, shape, data_offsets}");
      tensor_info t;
      t.name = name;
      for (const auto& [k, m] : v.items())
        if (k != "dtype" && k != "shape" && k != "data_offsets")
          return bad(name, "unknown member " + detail::quoted(k) +
                               " (rule: an entry has dtype, shape and data_offsets)");
      if (!v.contains("dtype") || !v["dtype"].is_string())
        return bad(name, "dtype missing or not a string");
      t.dtype = v["dtype"].get<std::string>();
      const std::size_t es = dtype_size(t.dtype);
      if (es == 0) return bad(name, "unknown dtype " + detail::quoted(t.dtype));
      if (!v.contains("shape") || !v["shape"].is_array())
        return bad(name, "shape missing or not an array");
      std::uint64_t count = 1;
      for (const auto& d : v["shape"]) {
        std::uint64_t x = 0;
        if (!detail::as_u64(d, x)) return bad(name, "a shape entry is not a non-negative integer");
        if (x != 0 && count > UINT64_MAX / x) return bad(name, "the element count overflows");
        count *= x;
        t.shape.push_back(x);
      }
      if (count > UINT64_MAX / es) return bad(name, "the byte count overflows");
      const auto* offs = v.contains("data_offsets") ? &v["data_offsets"] : nullptr;
      std::uint64_t b = 0, e = 0;
      if (offs == nullptr || !offs->is_array() || offs->size() != 2 ||
          !detail::as_u64((*offs)[0], b) || !detail::as_u64((*offs)[1], e))
        return bad(name, "data_offsets must be two non-negative integers [begin, end]");
      if (b > e || e > data_bytes)
        return bad(name, "truncated: data_offsets [" + std::to_string(b) + ", " +
                             std::to_string(e) + "] end past the " + std::to_string(data_bytes) +
                             " data bytes in the file");
      if (e - b != count * es)
        return bad(name, "data_offsets hold " + std::to_string(e - b) + " bytes, its " + t.dtype +
                             " shape needs " + std::to_string(count * es));
      t.begin = header_bytes_ + b;
      t.end = header_bytes_ + e;
      tensors_.push_back(std::move(t));
    }
    // The tensors must tile the data section: sorted by offset, each begins where the last ended.
    std::vector<const tensor_info*> by_offset;
    for (const auto& t : tensors_) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    std::uint64_t at = header_bytes_;
    for (const auto* t : by_offset) {
      if (t->begin != at)
        return bad(t->name, t->begin < at
                                ? "its data overlaps another tensor's"
                                : "a gap precedes its data (rule: tensors tile the data)");
      at = t->end;
    }
    if (at != header_bytes_ + data_bytes)
      return bad("", std::to_string(header_bytes_ + data_bytes - at) +
                         " bytes after the last tensor (rule: tensors tile the data)");
    std::sort(tensors_.begin(), tensors_.end(),
              [](const tensor_info& a, const tensor_info& b) { return a.name < b.name; });
    return {};
  }

  std::string path_;
  detail::fd_handle fd_;
  std::uint64_t header_bytes_ = 0;
  std::vector<tensor_info> tensors_;  // sorted by name
  std::map<std::string, std::string> metadata_;
};

//! The whole tensor `t` of `r`, converted to D (from F32, BF16, F16 or F64; bf16 and fp16 widen
//! exactly through fp32).
template <class D>
[[nodiscard]] expected<std::vector<D>> read_as(const reader& r, const tensor_info& t) {
  const auto convert = [&]<class S>(S) -> expected<std::vector<D>> {
    std::vector<S> raw(t.elements());
    if (auto s = detail::pread_all(r.fd(), std::as_writable_bytes(std::span<S>(raw)), t.begin,
                                   r.path() + ": tensor " + detail::quoted(t.name));
        !s)
      return unexpected<error>(s.error());
    std::vector<D> out(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) {
      if constexpr (std::is_arithmetic_v<S>)
        out[i] = static_cast<D>(raw[i]);
      else
        out[i] = static_cast<D>(static_cast<float>(raw[i]));
    }
    return out;
  };
  if (t.dtype == "F32") return convert(float{});
  if (t.dtype == "F64") return convert(double{});
  if (t.dtype == "BF16") return convert(bfloat16{});
  if (t.dtype == "F16") return convert(float16{});
  return make_error(errc::not_supported, r.path() + ": tensor " + detail::quoted(t.name) +
                                             ": dtype " + t.dtype +
                                             " (rule: F32, BF16, F16 or F64 values)");
}

//! A tensor to be written: its data follows in declaration order.
struct tensor_decl {
  std::string name;
  std::string dtype;
  std::vector<std::uint64_t> shape;
};

//! A safetensors file written in one pass: the header first (every tensor declared up front), then
//! each tensor's bytes in declaration order, all to a temporary name in the same folder that
//! commit() renames to the final one; a writer destroyed before commit() removes its temporary
//! file, so a failed run leaves nothing half-written under the final name.
class writer {
 public:
  [[nodiscard]] static expected<writer> create(std::filesystem::path path,
                                               std::vector<tensor_decl> tensors,
                                               const std::map<std::string, std::string>& meta) {
    writer w;
    w.final_ = std::move(path);
    w.temp_ = w.final_;
    w.temp_ += ".tmp-" + std::to_string(::getpid());
    ordered_json header = ordered_json::object();
    if (!meta.empty()) header["__metadata__"] = meta;
    std::uint64_t at = 0;
    for (auto& t : tensors) {
      const std::size_t es = dtype_size(t.dtype);
      if (es == 0 || t.name.empty() || t.name == "__metadata__" || header.contains(t.name))
        return make_error(
            errc::invalid_argument,
            w.final_.string() + ": tensor " + detail::quoted(t.name) +
                " has an unknown dtype or a name that is empty, reserved or repeated");
      std::uint64_t n = es;
      for (auto d : t.shape) n *= d;
      header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + n}}};
      w.sizes_.push_back(n);
      at += n;
    }
    std::string text = header.dump();
    // The data starts 8-byte aligned, as the reference writer pads it (with spaces).
    text.append((8 - text.size() % 8) % 8, ' ');
    w.fd_ =
        detail::fd_handle(::open(w.temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (w.fd_.get() < 0)
      return make_error(errc::backend_error,
                        w.temp_.string() + ": cannot create: " + std::string(std::strerror(errno)));
    w.created_ = true;
    std::array<std::byte, 8> len{};
    for (std::size_t i = 0; i < 8; ++i)
      len[i] = static_cast<std::byte>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xff);
    if (auto s = w.write_all(len); !s) return unexpected<error>(s.error());
    if (auto s = w.write_all(std::as_bytes(std::span<const char>(text.data(), text.size()))); !s)
      return unexpected<error>(s.error());
    w.names_.reserve(tensors.size());
    for (auto& t : tensors) w.names_.push_back(std::move(t.name));
    return w;
  }

  writer(writer&& o) noexcept
      : final_(std::move(o.final_)),
        temp_(std::move(o.temp_)),
        fd_(std::move(o.fd_)),
        names_(std::move(o.names_)),
        sizes_(std::move(o.sizes_)),
        next_(o.next_),
        created_(std::exchange(o.created_, false)) {}
  writer& operator=(writer&&) = delete;
  writer(const writer&) = delete;
  writer& operator=(const writer&) = delete;
  ~writer() {
    fd_.reset();
    if (created_) ::unlink(temp_.c_str());
  }

  //! The data of the next declared tensor, whole.
  [[nodiscard]] status write(std::span<const std::byte> data) {
    if (next_ >= sizes_.size() || data.size() != sizes_[next_])
      return make_error(
          errc::shape_mismatch,
          final_.string() + ": tensor data written out of order or of the wrong size");
    ++next_;
    return write_all(data);
  }

  //! After every tensor's data: flushes and renames the file to its final name.
  [[nodiscard]] status commit() {
    if (next_ != sizes_.size())
      return make_error(errc::shape_mismatch, final_.string() + ": " +
                                                  std::to_string(sizes_.size() - next_) +
                                                  " declared tensors were not written");
    const int fd = fd_.release();
    const bool synced = ::fsync(fd) == 0, closed = ::close(fd) == 0;
    if (!synced || !closed)
      return make_error(errc::backend_error,
                        temp_.string() + ": flush failed: " + std::string(std::strerror(errno)));
    if (::rename(temp_.c_str(), final_.c_str()) != 0)
      return make_error(errc::backend_error,
                        final_.string() + ": rename failed: " + std::string(std::strerror(errno)));
    created_ = false;
    return {};
  }

 private:
  writer() = default;

  status write_all(std::span<const std::byte> data) {
    std::size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::write(fd_.get(), data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return make_error(errc::backend_error,
                          temp_.string() + ": write failed: " + std::string(std::strerror(errno)));
      done += static_cast<std::size_t>(n);
    }
    return {};
  }

  std::filesystem::path final_, temp_;
  detail::fd_handle fd_;
  std::vector<std::string> names_;
  std::vector<std::uint64_t> sizes_;
  std::size_t next_ = 0;
  bool created_ = false;
};

}  // namespace moefold::examples::safetensors
