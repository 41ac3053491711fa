// libFuzzer target (clang -fsanitize=fuzzer,address,undefined): moefold-plan's model file reader
// (built with -DMOEFOLD_FUZZ_CLUSTER: the cluster file reader), examples/plan_files.hpp. Every
// input must give either a model that passes validate() or an error whose message is one line
// that names the rule broken (one of the message forms below); anything else aborts, and so do
// crashes, hangs and sanitizer reports. run_fuzz.py runs it in CI and replays the corpus through
// the tool.
#include <moefold/plan/cluster.hpp>
#include <moefold/plan/model.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "plan_files.hpp"

namespace {

#ifdef MOEFOLD_FUZZ_CLUSTER
constexpr const char* what = "cluster";
#else
constexpr const char* what = "model";
#endif

// The forms of every message the reader gives: where the text is malformed, which member breaks
// which rule, or what validate() refuses.
bool names_the_rule(const std::string& m) {
  const std::string w = what;
  const std::string_view forms[] = {"malformed JSON at line ", "malformed JSON: "};
  for (auto f : forms)
    if (m.starts_with(f)) return true;
  return m.starts_with("a " + w + " file must be a JSON object (got ") ||
         m.starts_with(w + " member \"") || m.starts_with("unknown " + w + " member \"") ||
         m.starts_with("the " + w + " file lacks the required member \"") ||
         m.starts_with(w + " '");
}

[[noreturn]] void fail(const char* why, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", why, message.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
#ifdef MOEFOLD_FUZZ_CLUSTER
  auto r = moefold::examples::cluster_from_json(text);
#else
  auto r = moefold::examples::model_from_json(text);
#endif
  if (r) {
    if (!moefold::plan::validate(*r)) fail("accepted a file that validate() refuses", "");
    return 0;
  }
  const std::string& m = r.error().message;
  if (m.empty()) fail("empty error message", m);
  if (m.find_first_of("\n\r") != std::string::npos) fail("error message of several lines", m);
  if (!names_the_rule(m)) fail("error message in no known form", m);
  return 0;
}
