// libFuzzer target (clang -fsanitize=fuzzer,address,undefined): a tool's flag parsing, built once
// per tool with -DMOEFOLD_FUZZ_TOOL_MESH, _PLAN or _TRAIN (examples/<tool>_flags.hpp, the parse()
// the tool itself calls). The input is the argument list as /proc/PID/cmdline holds it: arguments
// each ended by a NUL (a last one without its NUL counts too), at most max_args of them. Parsing
// must go on (status -1), print the help or the version (status 0), or refuse with status 2 and
// an error that is one line of text and names the rule broken (one of the forms below); anything
// else aborts, and so do crashes, hangs, sanitizer reports and allocations over the limit
// run_fuzz.py sets. With MOEFOLD_FUZZ_VERDICTS=FILE set, each input run also appends what parsing
// came to (record()) to FILE, which run_fuzz.py compares with what the tool binary prints.
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#if defined(MOEFOLD_FUZZ_TOOL_MESH)
#include "moefold_mesh_flags.hpp"
namespace tool = moefold::examples::mesh_cli;
constexpr const char* tool_name = "moefold-mesh";
#elif defined(MOEFOLD_FUZZ_TOOL_PLAN)
#include "moefold_plan_flags.hpp"
namespace tool = moefold::examples::plan_cli;
constexpr const char* tool_name = "moefold-plan";
#elif defined(MOEFOLD_FUZZ_TOOL_TRAIN)
#include "train_moe_cpu_flags.hpp"
namespace tool = moefold::examples::train_cli;
constexpr const char* tool_name = "train_moe_cpu";
#else
#error "define MOEFOLD_FUZZ_TOOL_MESH, MOEFOLD_FUZZ_TOOL_PLAN or MOEFOLD_FUZZ_TOOL_TRAIN"
#endif

namespace {

//! More arguments than a flag set has any use for; longer inputs are not run.
constexpr std::size_t max_args = 256;

[[noreturn]] void fail(const char* why, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", why, message.c_str());
  std::abort();
}

moefold::examples::parse_outcome parse(const std::vector<std::string>& args) {
  std::vector<const char*> argv{tool_name};
  for (const auto& a : args) argv.push_back(a.c_str());
  tool::options o;
  return tool::parse(static_cast<int>(argv.size()), argv.data(), o);
}

// The tool's flags, as its --help lists them.
const std::set<std::string>& flags() {
  static const std::set<std::string> names = [] {
    const auto help = parse({"--help"});
    if (help.status != 0) fail("--help did not print the help", help.error);
    std::set<std::string> n;
    for (std::size_t at = help.out.find("--"); at != std::string::npos;
         at = help.out.find("--", at + 2)) {
      std::size_t end = at + 2;
      while (end < help.out.size() &&
             (std::islower(static_cast<unsigned char>(help.out[end])) || help.out[end] == '-'))
        ++end;
      if (end > at + 2) n.insert(help.out.substr(at, end - at));
    }
    if (n.size() < 5) fail("--help lists too few flags", help.out);
    return n;
  }();
  return names;
}

bool starts_with_a_flag(const std::string& m) {
  for (const auto& f : flags())
    if (m.starts_with(f) && m.size() > f.size() &&
        (m[f.size()] == ' ' || m[f.size()] == ':' || m[f.size()] == '='))
      return true;
  return false;
}

// The forms of every message a refusal gives: CLI11's (an argument not expected, a value that
// does not convert, the wrong number of values; each ends with " (see --help)"), and those that
// begin with the flag whose rule is broken (CLI11's checks of one flag and the tool's own); plus
// the one rule of train_moe_cpu that concerns many flags at once.
bool names_the_rule(const std::string& m) {
  const std::string_view cli11[] = {"The following argument was not expected: ",
                                    "The following arguments were not expected: ",
                                    "Could not convert: ",
                                    "The value ",
                                    "Expected exactly ",
                                    "Expected at least "};
  for (auto f : cli11)
    if (m.starts_with(f)) return m.ends_with(" (see --help)");
  return starts_with_a_flag(m) ||
         m == "sizes, steps and the learning rate must be positive (losses >= 0)";
}

// True when the text would not read as one line: a control character, or U+0085, U+2028, U+2029.
bool breaks_lines(const std::string& m) {
  for (std::size_t i = 0; i < m.size(); ++i)
    if (moefold::examples::detail::line_breaking_at(m, i) != 0) return true;
  return false;
}

// "INPUT-IN-HEX<TAB>STATUS<TAB>ERROR-LINE" (the line is empty unless the status is 2).
void record(std::string_view input, const moefold::examples::parse_outcome& p) {
  static const char* path = std::getenv("MOEFOLD_FUZZ_VERDICTS");
  if (!path) return;
  std::string hex;
  for (unsigned char ch : input) {
    hex += "0123456789abcdef"[ch >> 4];
    hex += "0123456789abcdef"[ch & 15];
  }
  if (std::FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%s\t%d\t%s\n", hex.c_str(), p.status,
                 p.status == 2 ? ("error: " + p.error).c_str() : "");
    std::fclose(f);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> args;
  for (std::size_t start = 0; start < text.size();) {
    const std::size_t nul = text.find('\0', start);
    const std::size_t end = nul == std::string_view::npos ? text.size() : nul;
    args.emplace_back(text.substr(start, end - start));
    start = end + 1;
    if (args.size() > max_args) return -1;  // not kept in the corpus
  }
  const auto p = parse(args);
  record(text, p);
  if (p.status == -1) {
    if (!p.out.empty() || !p.error.empty()) fail("went on but has something to print", p.out);
  } else if (p.status == 0) {
    if (p.out.empty() || !p.error.empty()) fail("exit 0 without output", p.error);
  } else if (p.status == 2) {
    if (!p.out.empty()) fail("a refusal that prints on stdout", p.out);
    if (p.error.empty()) fail("empty error message", p.error);
    if (breaks_lines(p.error)) fail("error message of several lines", p.error);
    if (!names_the_rule(p.error)) fail("error message in no known form", p.error);
  } else {
    fail("status neither -1, 0 nor 2", std::to_string(p.status));
  }
  return 0;
}
