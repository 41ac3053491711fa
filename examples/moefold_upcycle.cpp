// moefold-upcycle: turn a dense Hugging Face checkpoint's FFNs into MoE experts, one file per rank
// of a folded mapping, each holding exactly what that rank owns (its experts' ETP shards on its
// pipeline stage and the fp32 routers), reading only the dense slices those need.
//
//   moefold-upcycle --dense llama/ --out moe/ --experts 8 --topk 2 --world 16 --pp 2 --ep 4 --etp 2
//
// Writes DIR/rank-RRRRR.safetensors and DIR/index.json (the mapping, the options, and for each
// rank its tensors and the dense slices each came from), every file under a temporary name then
// renamed; a failed run removes what it wrote. Bad input exits with status 2 and one "error:" line
// on stderr naming the file, the tensor and the rule. At exit, rchar from /proc/self/io is printed:
// the bytes this process read, which tests hold to the slices + headers + 1 MiB.
#include <moefold/mesh/fold.hpp>
#include <moefold/upcycle/pipeline_layers.hpp>
#include <moefold/upcycle/router_init.hpp>
#include <moefold/upcycle/upcycle_biases.hpp>
#include <moefold/upcycle/upcycle_experts.hpp>
#include <moefold/version.hpp>

#include "cli_args.hpp"
#include "dense_checkpoint.hpp"
#include "moefold_upcycle_flags.hpp"
#include "safetensors_file.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace st = moefold::examples::safetensors;
using moefold::examples::dense_checkpoint;
using moefold::examples::dense_layer;
using moefold::examples::ordered_json;
using moefold::examples::upcycle_cli::options;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this tool reads it in place");

// Thrown for any failure after parsing; main turns it into the one error line and exit 2.
struct tool_error {
  std::string message;
};

template <class T>
T value_or_throw(moefold::expected<T> r) {
  if (!r) throw tool_error{r.error().message};
  return std::move(*r);
}
void ok_or_throw(const moefold::status& s, const std::string& where = "") {
  if (!s) throw tool_error{where + s.error().message};
}

// Calls f with a value of the C++ type of a floating-point safetensors dtype.
template <class F>
void with_type(const std::string& dtype, F&& f) {
  if (dtype == "F32") return f(float{});
  if (dtype == "BF16") return f(moefold::bfloat16{});
  if (dtype == "F16") return f(moefold::float16{});
  if (dtype == "F64") return f(double{});
  throw tool_error{"unsupported dtype " + dtype};
}

moefold::activation activation_named(const std::string& s) {
  using moefold::activation;
  for (auto a : {activation::swiglu, activation::geglu, activation::relu, activation::squared_relu,
                 activation::gelu, activation::silu})
    if (to_string(a) == s) return a;
  throw tool_error{"unknown activation " + s};
}

std::string rank_file(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  return name;
}

// Bytes this process has read through read(2) and pread(2), from /proc/self/io.
long long rchar() {
  std::ifstream io("/proc/self/io");
  std::string key;
  long long v = -1;
  while (io >> key >> v)
    if (key == "rchar:") return v;
  return -1;
}

// What a run wrote, removed unless the run completes.
struct output_guard {
  fs::path dir;
  bool created_dir = false;
  fs::path created_top;  // the outermost folder the run created
  std::vector<fs::path> files;
  bool done = false;
  ~output_guard() {
    if (done) return;
    std::error_code ec;
    for (const auto& f : files) fs::remove(f, ec);
    if (created_dir) fs::remove_all(created_top, ec);
  }
};

struct plan_layer {
  dense_layer dense;
  moefold::upcycle_options opt;
  std::string out_dtype;
};

// One rank's file: the router of each of its layers, then each local expert's fc1 and fc2.
ordered_json write_rank(const options& o, const moefold::dynamic_folded_mesh& fold, int rank,
                        const std::vector<plan_layer>& layers, int num_layers, output_guard& guard,
                        std::uint64_t& slice_bytes) {
  const moefold::moe_coord c = fold.moe_coord_of(rank);
  const moefold::upcycle_rank me{
      .ep = fold.ep(), .ep_rank = c.ep, .etp = fold.etp(), .etp_rank = c.etp};
  std::vector<const plan_layer*> mine;
  for (const auto& l : layers)
    if (moefold::check_layer_on_stage(num_layers, fold.pp(), c.pp, l.dense.index))
      mine.push_back(&l);
  // Declarations first: the header precedes the data.
  std::vector<st::tensor_decl> decls;
  ordered_json tensors = ordered_json::array();
  // Each layer's expert shape on this rank and the dense slices it reads, for the declarations
  // and then for the data.
  std::vector<std::pair<moefold::mlp_shape, std::vector<moefold::dense_slice>>> plans;
  for (const plan_layer* l : mine) {
    const auto& d = l->dense.shape;
    const std::string layer = "layers." + std::to_string(l->dense.index);
    decls.push_back(
        {layer + ".router.weight",
         "F32",
         {static_cast<std::uint64_t>(l->opt.num_experts), static_cast<std::uint64_t>(d.hidden)}});
    const auto& [shape, plan] =
        plans.emplace_back(value_or_throw(moefold::upcycled_shape(d, l->opt, me)),
                           value_or_throw(moefold::upcycle_slices(d, l->opt, me)));
    const std::uint64_t fs_ = static_cast<std::uint64_t>(shape.ffn / me.etp);
    const std::uint64_t f1 = (d.gated ? 2 : 1) * fs_, H = static_cast<std::uint64_t>(d.hidden);
    tensors.push_back({{"name", decls.back().name},
                       {"layer", l->dense.index},
                       {"dtype", "F32"},
                       {"shape", decls.back().shape},
                       {"sources", ordered_json::array()}});
    for (int k = 0; k < shape.num_local_experts; ++k) {
      const int e = me.ep_rank * shape.num_local_experts + k;
      const int part = e % l->opt.granularity;
      ordered_json fc1_src = ordered_json::array(), fc2_src = ordered_json::array();
      for (const auto& s : plan) {
        if (s.part != part) continue;
        const auto* t = &l->dense.source(s.tensor);
        ordered_json src = {{"file", fs::path(t->file->path()).filename().string()},
                            {"tensor", t->info->name},
                            {"rows", {s.first_row, s.first_row + s.rows}},
                            {"cols", {s.first_col, s.first_col + s.cols}}};
        (s.tensor == moefold::dense_tensor::down ? fc2_src : fc1_src).push_back(src);
      }
      const std::string ex = layer + ".experts." + std::to_string(e);
      const auto declare = [&](const std::string& name, std::vector<std::uint64_t> shape,
                               const ordered_json& sources) {
        decls.push_back({name, l->out_dtype, std::move(shape)});
        tensors.push_back({{"name", name},
                           {"layer", l->dense.index},
                           {"expert", e},
                           {"dtype", l->out_dtype},
                           {"shape", decls.back().shape},
                           {"sources", sources}});
      };
      // A bias is read whole (it is F_d or H values): its source is all of it.
      const auto whole = [&](const std::optional<moefold::examples::located_tensor>& t) {
        return ordered_json{{"file", fs::path(t->file->path()).filename().string()},
                            {"tensor", t->info->name},
                            {"rows", {0, t->info->shape[0]}}};
      };
      declare(ex + ".fc1.weight", {f1, H}, fc1_src);
      if (l->dense.up_bias) {
        ordered_json src = ordered_json::array();
        if (l->dense.gate_bias) src.push_back(whole(l->dense.gate_bias));
        src.push_back(whole(l->dense.up_bias));
        declare(ex + ".fc1.bias", {f1}, src);
      }
      declare(ex + ".fc2.weight", {H, fs_}, fc2_src);
      if (l->dense.down_bias)
        declare(ex + ".fc2.bias", {H}, ordered_json::array({whole(l->dense.down_bias)}));
    }
  }
  const fs::path path = fs::path(o.out) / rank_file(rank);
  auto w = value_or_throw(st::writer::create(
      path, decls,
      {{"format", "pt"}, {"producer", "moefold-upcycle " + std::string(moefold::version_string)}}));
  guard.files.push_back(path);
  for (std::size_t li = 0; li < mine.size(); ++li) {
    const plan_layer* l = mine[li];
    const auto& d = l->dense.shape;
    const std::string where =
        l->dense.up.file->path() + ": layer " + std::to_string(l->dense.index) + ": ";
    std::vector<float> router(static_cast<std::size_t>(l->opt.num_experts) *
                              static_cast<std::size_t>(d.hidden));
    ok_or_throw(moefold::upcycle_router(d, l->opt, router), where);
    ok_or_throw(w.write(std::as_bytes(std::span<const float>(router))));
    const auto& plan = plans[li].second;
    const auto sizes = moefold::mlp_sizes(plans[li].first);
    with_type(l->dense.dtype, [&]<class S>(S) {
      // The slices this rank needs, read once each: [rows, cols] row-major.
      std::vector<std::vector<S>> data;
      std::vector<std::span<const S>> views;
      for (const auto& s : plan) {
        const auto* t = &l->dense.source(s.tensor);
        auto& buf =
            data.emplace_back(static_cast<std::size_t>(s.rows) * static_cast<std::size_t>(s.cols));
        ok_or_throw(t->file->read_rect(
            *t->info, static_cast<std::uint64_t>(s.first_row), static_cast<std::uint64_t>(s.rows),
            static_cast<std::uint64_t>(s.first_col), static_cast<std::uint64_t>(s.cols),
            std::as_writable_bytes(std::span<S>(buf))));
        slice_bytes += buf.size() * sizeof(S);
      }
      for (const auto& b : data) views.emplace_back(b);
      // The biases, whole and widened exactly to fp64 (empty when absent).
      std::vector<double> gb, ub, db;
      for (auto [t, dst] : {std::pair{&l->dense.gate_bias, &gb}, std::pair{&l->dense.up_bias, &ub},
                            std::pair{&l->dense.down_bias, &db}}) {
        if (!*t) continue;
        *dst = value_or_throw(st::read_as<double>(*(*t)->file, *(*t)->info));
        slice_bytes += dst->size() * sizeof(S);
      }
      with_type(l->out_dtype, [&]<class T>(T) {
        std::vector<T> fc1(sizes.fc1), fc2(sizes.fc2);
        ok_or_throw(moefold::upcycle_experts<S, T>(d, l->opt, me, views, {fc1, fc2}), where);
        const std::size_t L = static_cast<std::size_t>(l->opt.num_experts / me.ep);
        const std::size_t n1 = sizes.fc1 / L, n2 = sizes.fc2 / L;
        const std::size_t b1 = ub.empty() ? 0 : n1 / static_cast<std::size_t>(d.hidden),
                          b2 = db.empty() ? 0 : static_cast<std::size_t>(d.hidden);
        std::vector<T> bias1(L * b1), bias2(L * b2);
        ok_or_throw(moefold::upcycle_biases<double, T>(
                        d, l->opt, me, {.gate = gb, .up = ub, .down = db}, {bias1, bias2}),
                    where);
        const auto bytes = [](const std::vector<T>& v, std::size_t at, std::size_t n) {
          return std::as_bytes(std::span<const T>(v).subspan(at, n));
        };
        for (std::size_t k = 0; k < L; ++k) {
          ok_or_throw(w.write(bytes(fc1, k * n1, n1)));
          if (b1 > 0) ok_or_throw(w.write(bytes(bias1, k * b1, b1)));
          ok_or_throw(w.write(bytes(fc2, k * n2, n2)));
          if (b2 > 0) ok_or_throw(w.write(bytes(bias2, k * b2, b2)));
        }
      });
    });
  }
  ok_or_throw(w.commit());
  const moefold::attention_coord a = fold.attention_coord_of(rank);
  return {{"rank", rank},
          {"file", rank_file(rank)},
          {"attention", {{"tp", a.tp}, {"cp", a.cp}, {"dp", a.dp}, {"pp", a.pp}}},
          {"moe", {{"etp", c.etp}, {"ep", c.ep}, {"edp", c.edp}, {"pp", c.pp}}},
          {"tensors", tensors}};
}

int run(const options& o) {
  auto fold = moefold::make_folded(
      {.world = o.world, .tp = o.tp, .cp = o.cp, .pp = o.pp, .ep = o.ep, .etp = o.etp});
  if (!fold) throw tool_error{"the mapping: " + fold.error().message};

  output_guard guard;
  guard.dir = o.out;
  std::error_code ec;
  if (fs::exists(guard.dir, ec)) {
    if (!fs::is_directory(guard.dir, ec)) throw tool_error{o.out + ": --out is not a folder"};
    if (!fs::is_empty(guard.dir, ec))
      throw tool_error{o.out +
                       ": --out is not empty (rule: the tool writes into an empty or new "
                       "folder, so that no earlier run's files mix with its own)"};
  } else {
    // The outermost folder this run creates, removed whole if the run fails. The walk stops at
    // the first parent that exists or cannot be examined, so it never climbs into a folder that
    // was there before.
    fs::path top = fs::absolute(guard.dir, ec).lexically_normal();
    while (top.has_parent_path() && top.parent_path() != top) {
      std::error_code stat_ec;
      if (fs::exists(top.parent_path(), stat_ec) || stat_ec) break;
      top = top.parent_path();
    }
    if (!fs::create_directories(guard.dir, ec))
      throw tool_error{o.out + ": cannot create --out: " + ec.message()};
    guard.created_dir = true;
    guard.created_top = top;
  }

  const auto ckpt = value_or_throw(dense_checkpoint::open(o.dense));
  const int n = ckpt.num_layers();
  if (auto s = moefold::pipeline_stage_layers(n, o.pp, 0); !s)
    throw tool_error{o.dense + ": " + s.error().message};
  std::vector<int> selected = o.layers;
  if (selected.empty()) {
    selected.resize(static_cast<std::size_t>(n));
    std::iota(selected.begin(), selected.end(), 0);
  }
  std::sort(selected.begin(), selected.end());
  selected.erase(std::unique(selected.begin(), selected.end()), selected.end());
  for (int i : selected)
    if (i >= n)
      throw tool_error{"--layers: layer " + std::to_string(i) + " is out of range (" + o.dense +
                       " has " + std::to_string(n) + " layers)"};

  std::vector<plan_layer> layers;
  for (int i : selected) {
    plan_layer p;
    p.dense = value_or_throw(ckpt.layer(i));
    const auto& d = p.dense.shape;
    moefold::activation act{};
    if (!o.activation.empty()) {
      act = activation_named(o.activation);
    } else if (ckpt.hidden_act()) {
      auto a = moefold::examples::activation_of_hidden_act(*ckpt.hidden_act(), d.gated);
      if (!a) throw tool_error{(ckpt.folder() / "config.json").string() + ": " + a.error().message};
      act = *a;
    } else {
      throw tool_error{o.dense +
                       ": no config.json with hidden_act beside the weights; give "
                       "--activation"};
    }
    p.opt = {.num_experts = o.experts,
             .topk = o.topk,
             .granularity = o.granularity,
             .act = act,
             .pre_softmax = o.pre_softmax,
             .init = o.router_init == "uniform" ? moefold::router_init::uniform
                                                : moefold::router_init::random,
             .seed = o.seed + static_cast<std::uint64_t>(i)};
    p.out_dtype = o.dtype == "fp32" ? "F32" : o.dtype == "bf16" ? "BF16" : p.dense.dtype;
    // Every rule the options and the mapping must obey, before anything is written.
    const std::string where = p.dense.up.file->path() + ": tensor " + p.dense.up.info->name + ": ";
    if (auto shape = moefold::upcycled_shape(d, p.opt, {.ep = fold->ep(), .etp = fold->etp()});
        !shape)
      throw tool_error{where + shape.error().message};
    layers.push_back(std::move(p));
  }

  std::vector<int> ranks;
  if (o.rank) {
    ranks.push_back(*o.rank);
  } else {
    ranks.resize(static_cast<std::size_t>(o.world));
    std::iota(ranks.begin(), ranks.end(), 0);
  }
  std::uint64_t slice_bytes = 0;
  ordered_json rank_entries = ordered_json::array();
  const int per_stage = n / o.pp;
  for (int r : ranks)
    rank_entries.push_back(write_rank(o, *fold, r, layers, n, guard, slice_bytes));

  ordered_json index = {
      {"producer", "moefold-upcycle " + std::string(moefold::version_string)},
      {"dense",
       {{"path", fs::absolute(o.dense).lexically_normal().string()},
        {"num_layers", n},
        {"layers_per_stage", per_stage}}},
      {"mapping",
       {{"world", fold->world_size()},
        {"tp", fold->tp()},
        {"cp", fold->cp()},
        {"dp", fold->dp()},
        {"pp", fold->pp()},
        {"ep", fold->ep()},
        {"etp", fold->etp()},
        {"edp", fold->edp()},
        {"order", fold->order().str()}}},
      {"options",
       {{"experts", o.experts},
        {"topk", o.topk},
        {"granularity", o.granularity},
        {"activation", std::string(to_string(layers.empty() ? moefold::activation::swiglu
                                                            : layers.front().opt.act))},
        {"pre_softmax", o.pre_softmax},
        {"router_init", o.router_init},
        {"seed", o.seed},
        {"seed_of_layer", "seed + layer index"},
        {"dtype", o.dtype},
        {"weight_scale", layers.empty() ? 0.0
                                        : value_or_throw(moefold::upcycle_weight_scale(
                                              layers.front().dense.shape, layers.front().opt))}}},
      {"layers", selected},
      {"not_written",
       "every tensor of the dense checkpoint other than the upcycled FFNs (attention, norms, "
       "embeddings, the output layer): take them from the dense checkpoint"},
      {"ranks", rank_entries}};
  const fs::path index_path = fs::path(o.out) / "index.json";
  {
    const fs::path tmp = fs::path(o.out) / ("index.json.tmp-" + std::to_string(::getpid()));
    guard.files.push_back(tmp);
    std::ofstream out(tmp);
    // Paths need not be UTF-8: replace what is not rather than fail after every rank file.
    out << index.dump(1, ' ', false, ordered_json::error_handler_t::replace) << "\n";
    out.close();
    if (!out) throw tool_error{tmp.string() + ": write failed"};
    fs::rename(tmp, index_path, ec);
    if (ec) throw tool_error{index_path.string() + ": rename failed: " + ec.message()};
    guard.files.push_back(index_path);
  }
  guard.done = true;
  std::cout << "wrote " << ranks.size() << " rank file(s) and index.json to " << o.out << "\n"
            << "read: dense slices " << slice_bytes << " bytes, headers " << ckpt.header_bytes()
            << " bytes\n"
            << "rchar: " << rchar() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  if (const int rc =
          moefold::examples::report(moefold::examples::upcycle_cli::parse(argc, argv, o));
      rc >= 0)
    return rc;
  try {
    return run(o);
  } catch (const tool_error& e) {
    return moefold::examples::fail(e.message);
  } catch (const std::exception& e) {
    return moefold::examples::fail(std::string("unexpected failure: ") + e.what());
  }
}
