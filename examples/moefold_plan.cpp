// moefold-plan: choose the folded mapping (tp, cp, ep, etp, pp, vpp, micro-batch) for an MoE
// model on a cluster, from an explicit model of memory and time (docs/planner.md).
//
//   moefold-plan --model mixtral-8x22b --cluster h100-sxm --gpus 128 --top 5
//   moefold-plan --model qwen2-57b-a14b --cluster h100-sxm --gpus 64
//                --tp 2 --cp 1 --ep 8 --etp 1 --pp 4 --vpp 1 --mbs 1 --format json  (one line)
//
// Invalid input of any kind exits with status 2, prints nothing on stdout and one line on stderr
// that starts with "error:".
#include <moefold/plan/plan.hpp>

#include "calibration_file.hpp"
#include "cli_args.hpp"
#include "moefold_plan_flags.hpp"
#include "plan_files.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using moefold::examples::usage_error;

namespace mp = moefold::plan;

using moefold::examples::plan_cli::options;

//! The largest model or cluster file read: the files are a few hundred bytes, and a bound keeps
//! a path such as /dev/zero from being read without end.
constexpr std::size_t max_file_bytes = 1 << 20;

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw usage_error{std::string("unknown ") + what + " '" + path +
                      "': not a preset name and not a readable file (see --help)"};
  std::string text(max_file_bytes + 1, '\0');
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (f.bad() || (!f.eof() && f.fail()))
    throw usage_error{std::string("cannot read ") + what + " file '" + path + "'"};
  text.resize(static_cast<std::size_t>(f.gcount()));
  if (text.size() > max_file_bytes)
    throw usage_error{std::string(what) + " file '" + path + "' is larger than the limit of " +
                      std::to_string(max_file_bytes) + " bytes"};
  return text;
}

mp::model_config load_model(const std::string& name) {
  if (auto p = mp::model_preset(name)) return *p;
  auto m = moefold::examples::model_from_json(read_file(name, "model"));
  if (!m) throw usage_error{"model file '" + name + "': " + m.error().message};
  return *m;
}

mp::cluster_config load_cluster(const std::string& name) {
  if (auto p = mp::cluster_preset(name)) return *p;
  auto c = moefold::examples::cluster_from_json(read_file(name, "cluster"));
  if (!c) throw usage_error{"cluster file '" + name + "': " + c.error().message};
  return *c;
}

std::string num(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      o += '\\';
      o += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", ch);
      o += b;
    } else {
      o += ch;
    }
  }
  return o;
}

std::string to_json(const mp::plan_result& r) {
  std::ostringstream o;
  const auto& m = r.map;
  o << "{\"mapping\": {\"tp\": " << m.tp << ", \"cp\": " << m.cp << ", \"ep\": " << m.ep
    << ", \"etp\": " << m.etp << ", \"pp\": " << m.pp << ", \"vpp\": " << m.vpp
    << ", \"dp\": " << m.dp << ", \"edp\": " << m.edp << ", \"mbs\": " << m.mbs << "}"
    << ", \"feasible\": " << (r.feasible ? "true" : "false") << ", \"reason\": \""
    << json_escape(r.reason) << "\", \"mfu\": " << num(r.mfu, 4)
    << ", \"step_time_s\": " << num(r.step_time_s, 4)
    << ", \"memory_gib\": " << num(r.memory_gib, 2) << ", \"breakdown\": {\"time_s\": {";
  bool first = true;
  for (auto [name, v] : mp::time_components(r.time)) {
    o << (first ? "" : ", ") << '"' << name << "\": " << num(v, 5);
    first = false;
  }
  const auto& mem = r.memory;
  o << "}, \"memory_gib\": {\"weights\": " << num(mem.weights / mp::gib, 3)
    << ", \"grads\": " << num(mem.grads / mp::gib, 3)
    << ", \"optimizer\": " << num(mem.optimizer / mp::gib, 3)
    << ", \"activations\": " << num(mem.activations / mp::gib, 3)
    << ", \"buffers\": " << num(mem.transient / mp::gib, 3)
    << ", \"reserved\": " << num(mem.reserved / mp::gib, 3) << "}"
    << ", \"recompute\": \"" << to_string(r.rc) << "\", \"microbatches\": " << r.microbatches
    << ", \"tflops_per_gpu\": " << num(r.tflops_per_gpu, 1);
  // The range measurements have fallen in around such a prediction (validation.hpp).
  const auto [mfu_lo, mfu_hi] = mp::measured_range(r.mfu);
  const auto [tf_lo, tf_hi] = mp::measured_range(r.tflops_per_gpu);
  o << ", \"mfu_band\": [" << num(mfu_lo, 4) << ", " << num(mfu_hi, 4) << "], \"tflops_band\": ["
    << num(tf_lo, 1) << ", " << num(tf_hi, 1) << "], \"placement\": {";
  const std::pair<const char*, const mp::group_placement*> groups[] = {
      {"tp", &r.placement.tp},   {"cp", &r.placement.cp},       {"ep", &r.placement.ep},
      {"etp", &r.placement.etp}, {"dp_cp", &r.placement.dp_cp}, {"edp", &r.placement.edp},
      {"pp", &r.placement.pp}};
  first = true;
  for (auto [name, g] : groups) {
    o << (first ? "" : ", ") << '"' << name << "\": {\"size\": " << g->size
      << ", \"nodes\": " << g->nodes << "}";
    first = false;
  }
  o << "}}}";
  return o.str();
}

std::string ep_place(const mp::plan_result& r) {
  const auto& g = r.placement.ep;
  if (g.size <= 1) return "-";
  return g.crosses_nodes() ? std::to_string(g.nodes) + " nodes" : "in node";
}

// What a calibration file changed, for the text and JSON outputs.
struct calibration_use {
  std::string file;
  const mp::calibration* cal = nullptr;
  std::vector<std::string> ignored;  //!< tables the chosen training stack does not use
  std::string caution;               //!< why the rates may not carry over (empty: no reason)
};

// Measured compute rates carry over as fractions of the measured GPU's peak: sound between GPUs
// of one tensor-core generation (an H200's on an H100: the same tensor cores and clocks), a
// guess across generations (an H200's fractions on a GB200, whose peak is 2.5x). A file without
// a `gpu` section is taken as measured on the planned GPU; the tool says so, since that is
// right only if it was (an H200's TFLOP/s read as a GB200's priced the GB200 validation points
// 34-47% too slow; docs/planner.md). Bandwidths alone (collectives) need no GPU named.
std::string calibration_caution(const mp::calibration& cal, const mp::cluster_config& c) {
  if (!(cal.measured_peak_flops > 0)) {
    if (cal.gemm.empty() && cal.expert_gemm.empty() && cal.attention.empty()) return {};
    return "the file names no GPU: its compute rates are read as measured on " + c.name +
           " itself (" + num(c.peak_bf16_flops / 1e12, 0) +
           " TFLOP/s bf16 peak); rates measured on another GPU need its `gpu` section";
  }
  const double ratio = cal.measured_peak_flops / c.peak_bf16_flops;
  if (ratio > 0.9 && ratio < 1.0 / 0.9) return {};
  return "measured on a GPU of " + num(cal.measured_peak_flops / 1e12, 0) +
         " TFLOP/s bf16 peak, planned on " + c.name + " at " + num(c.peak_bf16_flops / 1e12, 0) +
         " TFLOP/s" +
         ": its compute rates carry over as fractions of peak, which holds within one tensor-core "
         "generation only; measure on the planned GPU";
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

std::string stack_text(const mp::training_stack& s) {
  std::string t = s.dispatcher == mp::ep_dispatcher::deepep     ? "DeepEP"
                  : s.dispatcher == mp::ep_dispatcher::hybridep ? "HybridEP"
                                                                : "NCCL all-to-all";
  if (s.fp8_dispatch) t += ", fp8 dispatch";
  if (s.ep_overlap) t += ", EP overlap";
  if (s.cuda_graphs) t += ", CUDA graphs";
  return t;
}

std::string stack_json(const mp::training_stack& s) {
  return "{\"dispatcher\": \"" + std::string(to_string(s.dispatcher)) +
         "\", \"fp8_dispatch\": " + (s.fp8_dispatch ? "true" : "false") +
         ", \"ep_overlap\": " + (s.ep_overlap ? "true" : "false") +
         ", \"cuda_graphs\": " + (s.cuda_graphs ? "true" : "false") + "}";
}

// How far such predictions have been from published measurements (validation.hpp).
std::string band_text() {
  const auto& b = mp::validation_band;
  return "80% of " + std::to_string(b.points) + " held-out published runs measured within " +
         num(-100 * b.high / (1 + b.high), 0) + "% to +" + num(-100 * b.low / (1 + b.low), 0) +
         "% of the prediction (mean abs error " + num(100 * b.mean_abs, 0) +
         "%; docs/planner.md, Accuracy)";
}

void print_header(std::ostream& out, const mp::model_config& m, const mp::cluster_config& c,
                  const calibration_use& u, const mp::training_stack& stack) {
  out << "moefold-plan: " << m.name << " (" << num(m.total_params() / 1e9, 1) << "B params, "
      << num(m.active_params() / 1e9, 1) << "B active, "
      << (m.dtype == mp::precision::fp8 ? "fp8" : "bf16") << ") on " << c.gpus << " x " << c.name
      << " (" << c.gpus_per_node << " per node, " << num(c.memory_gib, 1) << " GiB)\n"
      << "  seq " << m.seq << ", global batch " << m.gbs << " sequences ("
      << static_cast<long long>(m.seq) * m.gbs << " tokens per step)\n"
      << "  EP dispatch: " << stack_text(stack) << "\n";
  if (u.cal != nullptr)
    out << "  calibration " << u.file << (u.cal->source.empty() ? "" : " (" + u.cal->source + ")")
        << "\n    measured: " << join(u.cal->measured_sections())
        << "\n    built-in: " << join(u.cal->builtin_sections()) << "\n"
        << (u.caution.empty() ? "" : "    caution: " + u.caution + "\n")
        << (u.ignored.empty() ? ""
                              : "    ignored: " + join(u.ignored) +
                                    " (DeepEP and HybridEP keep their own rates: their traffic is "
                                    "not an all-to-all's)\n");
}

std::string calibration_json(const calibration_use& u) {
  std::string s = "{\"file\": \"" + json_escape(u.file) + "\", \"measured\": [";
  const auto list = [](const std::vector<std::string>& v) {
    std::string o;
    for (std::size_t i = 0; i < v.size(); ++i) o += (i ? ", \"" : "\"") + json_escape(v[i]) + "\"";
    return o;
  };
  return s + list(u.cal->measured_sections()) + "], \"builtin\": [" +
         list(u.cal->builtin_sections()) + "], \"ignored\": [" + list(u.ignored) +
         "], \"caution\": \"" + json_escape(u.caution) + "\"}";
}

void print_one_text(const mp::model_config& m, const mp::cluster_config& c,
                    const mp::plan_result& r, const calibration_use& u,
                    const mp::training_stack& stack) {
  std::ostringstream out;
  print_header(out, m, c, u, stack);
  const auto [mfu_lo, mfu_hi] = mp::measured_range(r.mfu);
  out << "\nmapping: " << to_string(r.map) << "\n"
      << (r.feasible ? "feasible: " : "NOT feasible: ") << r.reason << "\n"
      << "MFU " << num(100 * r.mfu, 1) << "%, step " << num(r.step_time_s, 3) << " s, "
      << num(r.tflops_per_gpu, 0) << " TFLOP/s per GPU, " << num(r.memory_gib, 1)
      << " GiB per GPU, " << r.microbatches << " micro-batches, EP " << ep_place(r) << "\n"
      << "error band: MFU " << num(100 * mfu_lo, 1) << "% to " << num(100 * mfu_hi, 1)
      << "%: " << band_text() << "\n\n"
      << "step time by cause (s):\n";
  for (auto [name, v] : mp::time_components(r.time))
    out << "  " << name << std::string(14 - std::string(name).size(), ' ') << num(v, 4) << "  ("
        << num(100 * v / r.step_time_s, 1) << "%)\n";
  const auto& b = r.memory;
  out << "memory per GPU (GiB): weights " << num(b.weights / mp::gib, 1) << ", grads "
      << num(b.grads / mp::gib, 1) << ", optimizer " << num(b.optimizer / mp::gib, 1)
      << ", activations " << num(b.activations / mp::gib, 1) << ", buffers "
      << num(b.transient / mp::gib, 1) << ", reserved " << num(b.reserved / mp::gib, 1) << "\n";
  std::cout << out.str();
}

void print_ranked_text(const mp::model_config& m, const mp::cluster_config& c,
                       const mp::search_result& s, std::size_t top, double seconds,
                       const calibration_use& u, const mp::training_stack& stack) {
  std::ostringstream out;
  print_header(out, m, c, u, stack);
  out << "  searched " << s.legal << " legal folded mappings, " << s.feasible << " fit in memory ("
      << num(seconds, 2) << " s)\n  error band: " << band_text() << "\n\n";
  out << "rank  tp cp  ep etp pp vpp mbs   dp  edp    MFU  step s  TFLOP/s  GiB  recompute  EP\n";
  const std::size_t n = std::min(top, s.ranked.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto& r = s.ranked[i];
    const auto& p = r.map;
    char line[200];
    std::snprintf(
        line, sizeof line,
        "%4zu %3d %2d %3d %3d %2d %3d %3d %4d %4d %5.1f%% %7.3f %8.0f %4.0f  %-9s  %s%s\n", i + 1,
        p.tp, p.cp, p.ep, p.etp, p.pp, p.vpp, p.mbs, p.dp, p.edp, 100 * r.mfu, r.step_time_s,
        r.tflops_per_gpu, r.memory_gib, std::string(to_string(r.rc)).c_str(), ep_place(r).c_str(),
        r.feasible ? "" : "  (does not fit)");
    out << line;
    if (i + 1 < s.ranked.size())
      out << "      why: " << mp::explain_win(r, s.ranked[i + 1]) << "\n";
    else
      out << "      why: " << r.reason << "\n";
  }
  if (s.feasible == 0)
    out << "\nno mapping fits in memory; listed are the ones that come closest. "
        << s.ranked[0].reason << "\n";
  std::cout << out.str();
}

// A chart of predicted MFU across the candidates (best first) and the step-time breakdown of the
// best ones.
void print_svg(const mp::model_config& m, const mp::cluster_config& c, const mp::search_result& s,
               std::size_t top) {
  const std::size_t bars = std::min<std::size_t>(s.ranked.size(), 200);
  const std::size_t best = std::min(top, s.ranked.size());
  const int w = 960, chart_h = 260, left = 60, top_y = 60;
  const int row_h = 26, break_y = top_y + chart_h + 80;
  const int h = break_y + static_cast<int>(best) * row_h + 90;
  double max_mfu = 0.01, max_t = 1e-9;
  for (std::size_t i = 0; i < bars; ++i) max_mfu = std::max(max_mfu, s.ranked[i].mfu);
  for (std::size_t i = 0; i < best; ++i) max_t = std::max(max_t, s.ranked[i].step_time_s);
  // One colour per time component (explain.hpp's time_components).
  const char* colors[] = {"#4e79a7", "#a0cbe8", "#f28e2b", "#ffbe7d", "#59a14f",
                          "#e15759", "#ff9d9a", "#b07aa1", "#9c755f", "#bab0ac",
                          "#76b7b2", "#edc948", "#d37295", "#8cd17d"};
  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
    << "width=\"" << w << "\" height=\"" << h << "\" viewBox=\"0 0 " << w << ' ' << h
    << "\" font-family=\"sans-serif\">\n<title>moefold-plan: " << m.name << " on " << c.gpus
    << " x " << c.name << "</title>\n<rect x=\"0\" y=\"0\" width=\"" << w << "\" height=\"" << h
    << "\" fill=\"white\"/>\n<text x=\"" << left
    << "\" y=\"28\" font-size=\"16\">Predicted MFU of the " << bars << " best of " << s.legal
    << " legal folded mappings: " << m.name << ", " << c.gpus << " x " << c.name << "</text>\n";
  const double bw = static_cast<double>(w - left - 20) / std::max<std::size_t>(bars, 1);
  o << "<g class=\"mfu\">\n";
  for (std::size_t i = 0; i < bars; ++i) {
    const auto& r = s.ranked[i];
    const double bh = chart_h * r.mfu / max_mfu;
    o << "<rect class=\"candidate\" x=\"" << num(left + i * bw, 1) << "\" y=\""
      << num(top_y + chart_h - bh, 1) << "\" width=\"" << num(std::max(bw - 1, 0.5), 1)
      << "\" height=\"" << num(bh, 1) << "\" fill=\"" << (r.feasible ? "#4e79a7" : "#cccccc")
      << "\"><title>" << to_string(r.map) << ": MFU " << num(100 * r.mfu, 1)
      << "%</title></rect>\n";
  }
  o << "</g>\n<text x=\"8\" y=\"" << top_y + 10 << "\" font-size=\"11\">" << num(100 * max_mfu, 1)
    << "%</text><text x=\"8\" y=\"" << top_y + chart_h << "\" font-size=\"11\">0%</text>\n"
    << "<text x=\"" << left << "\" y=\"" << top_y + chart_h + 20
    << "\" font-size=\"12\">candidates, best first (grey: does not fit in memory)</text>\n"
    << "<text x=\"" << left << "\" y=\"" << break_y - 20 << "\" font-size=\"16\">Step time of the "
    << best << " best, by cause (longest bar " << num(max_t, 3) << " s)</text>\n";
  const int label_w = 250;
  for (std::size_t i = 0; i < best; ++i) {
    const auto& r = s.ranked[i];
    const int y = break_y + static_cast<int>(i) * row_h;
    o << "<text x=\"8\" y=\"" << y + 16 << "\" font-size=\"11\">#" << i + 1 << " tp" << r.map.tp
      << " cp" << r.map.cp << " ep" << r.map.ep << " etp" << r.map.etp << " pp" << r.map.pp
      << " vpp" << r.map.vpp << " mbs" << r.map.mbs << " " << num(100 * r.mfu, 1)
      << "%</text>\n<g class=\"breakdown\">\n";
    double x = left + label_w - left;
    int k = 0;
    for (auto [name, v] : mp::time_components(r.time)) {
      const double seg = (w - label_w - 20) * v / max_t;
      o << "<rect class=\"part\" data-part=\"" << name << "\" x=\"" << num(x, 1) << "\" y=\"" << y
        << "\" width=\"" << num(seg, 2) << "\" height=\"" << row_h - 6 << "\" fill=\""
        << colors[k++ % std::size(colors)] << "\"><title>" << name << ": " << num(v, 4)
        << " s</title></rect>\n";
      x += seg;
    }
    o << "</g>\n";
  }
  int k = 0, lx = 8;
  int ly = break_y + static_cast<int>(best) * row_h + 30;  // two legend rows fit in h
  for (auto [name, v] : mp::time_components(s.ranked[0].time)) {
    (void)v;
    o << "<rect x=\"" << lx << "\" y=\"" << ly << "\" width=\"10\" height=\"10\" fill=\""
      << colors[k++ % std::size(colors)] << "\"/><text x=\"" << lx + 13 << "\" y=\"" << ly + 9
      << "\" font-size=\"10\">" << name << "</text>\n";
    lx += 78;
    if (lx + 78 > w) lx = 8, ly += 18;
  }
  o << "</svg>\n";
  std::cout << o.str();
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  mp::model_config model;
  mp::cluster_config cluster;
  mp::calibration cal;
  calibration_use use;
  mp::efficiency eff;
  if (const int rc = moefold::examples::report(moefold::examples::plan_cli::parse(argc, argv, o));
      rc >= 0)
    return rc;
  try {
    model = load_model(o.model);
    cluster = load_cluster(o.cluster);
    if (!o.calibration.empty()) {
      auto c = moefold::examples::calibration_from_file_text(
          read_file(o.calibration, "calibration"), cluster.gpus_per_node);
      if (!c) throw usage_error{"calibration file '" + o.calibration + "': " + c.error().message};
      cal = std::move(*c);
      use = {.file = o.calibration, .cal = &cal, .ignored = {}, .caution = {}};
      eff.measured = &cal;
    }
  } catch (const usage_error& e) {
    return moefold::examples::report(e);
  }
  eff.stack = o.stack;
  // A measured all-to-all prices the alltoall dispatcher only (collectives.hpp): with DeepEP or
  // HybridEP its tables are set aside and named as such, not listed as measured.
  if (use.cal != nullptr && o.stack.dispatcher != mp::ep_dispatcher::alltoall) {
    const std::pair<std::vector<mp::sized_rate>*, const char*> a2a[] = {
        {&cal.collectives.a2a_intra, "all-to-all intra-node"},
        {&cal.collectives.a2a_inter, "all-to-all inter-node"}};
    for (auto [t, name] : a2a)
      if (!t->empty()) {
        use.ignored.emplace_back(name);
        t->clear();
      }
  }
  if (o.gbs) model.gbs = *o.gbs;
  if (o.seq) model.seq = *o.seq;
  cluster.gpus = o.gpus;
  if (auto ok = mp::validate(model); !ok) return moefold::examples::fail(ok.error().message);
  if (auto ok = mp::validate(cluster); !ok) return moefold::examples::fail(ok.error().message);
  if (use.cal != nullptr) use.caution = calibration_caution(cal, cluster);
  const auto& f = o.fixed;
  if (f.tp && f.cp && f.ep && f.etp && f.pp && f.vpp && f.mbs) {
    auto r = mp::evaluate(model, cluster,
                          {.tp = *f.tp,
                           .cp = *f.cp,
                           .ep = *f.ep,
                           .etp = *f.etp,
                           .pp = *f.pp,
                           .vpp = *f.vpp,
                           .mbs = *f.mbs},
                          eff);
    if (!r)
      return moefold::examples::fail(r.error().message + " [" +
                                     std::string(to_string(r.error().code)) + "]");
    if (o.format == "json")
      std::cout << "{"
                << (use.cal != nullptr ? "\"calibration\": " + calibration_json(use) + ", " : "")
                << "\"stack\": " << stack_json(o.stack) << ", " << to_json(*r).substr(1) << "\n";
    else if (o.format == "svg")
      print_svg(model, cluster, mp::search_result{{*r}, 1, r->feasible ? 1 : 0}, 1);
    else
      print_one_text(model, cluster, *r, use, o.stack);
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  auto last = start;
  bool shown = false;
  auto progress = [&](long long done, long long total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last < std::chrono::milliseconds(500) && done != total) return;
    if (!shown && done == total) return;  // short searches stay quiet
    last = now;
    shown = true;
    std::cerr << "moefold-plan: searched " << done << " of " << total << " folds\n";
  };
  const std::size_t keep = std::max<std::size_t>(static_cast<std::size_t>(o.top) + 1, 200);
  auto s = mp::search(model, cluster, o.fixed, keep, progress, eff);
  if (!s)
    return moefold::examples::fail(s.error().message + " [" +
                                   std::string(to_string(s.error().code)) + "]");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::size_t top = static_cast<std::size_t>(o.top);
  if (o.format == "json") {
    std::ostringstream out;
    out << "{" << (use.cal != nullptr ? "\"calibration\": " + calibration_json(use) + ", " : "")
        << "\"stack\": " << stack_json(o.stack) << ", \"ranked\": [";
    for (std::size_t i = 0; i < std::min(top, s->ranked.size()); ++i)
      out << (i ? ",\n  " : "\n  ") << to_json(s->ranked[i]);
    out << "]}\n";
    std::cout << out.str();
  } else if (o.format == "svg") {
    print_svg(model, cluster, *s, top);
  } else {
    print_ranked_text(model, cluster, *s, top, seconds, use, o.stack);
  }
  return 0;
}
