// A dense model's checkpoint as Hugging Face ships it, for moefold-upcycle: one safetensors file,
// or a folder with model.safetensors.index.json ({"weight_map": {tensor: shard file}}) and its
// shards (or a folder with one model.safetensors). Only headers are read on opening; the FFN
// tensors of a layer, model.layers.{i}.mlp.gate_proj / up_proj / down_proj.weight, are found and
// checked here and read later, slice by slice, through safetensors::reader::read_rect.
#pragma once

#include <moefold/core/expected.hpp>
#include <moefold/experts/activation.hpp>
#include <moefold/upcycle/upcycle_experts.hpp>
#include <moefold/upcycle/upcycle_options.hpp>

#include "json_document.hpp"
#include "safetensors_file.hpp"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace moefold::examples {

//! Where one tensor lives.
struct located_tensor {
  const safetensors::reader* file = nullptr;
  const safetensors::tensor_info* info = nullptr;
};

//! One dense layer's FFN: its tensors (gate absent when not gated), shape and dtype.
struct dense_layer {
  int index = 0;
  std::optional<located_tensor> gate;
  located_tensor up, down;
  //! Biases, when the checkpoint has them (mlp_bias): gate and up [F_d] (together when gated),
  //! down [H].
  std::optional<located_tensor> gate_bias, up_bias, down_bias;
  dense_ffn_shape shape;
  std::string dtype;  //!< F32, BF16, F16 or F64, the same for the layer's tensors

  //! The tensor a dense slice names (gate only of a gated layer, as upcycle_slices states).
  [[nodiscard]] const located_tensor& source(dense_tensor t) const {
    return t == dense_tensor::gate ? *gate : t == dense_tensor::up ? up : down;
  }
};

inline std::string ffn_name(int layer, std::string_view proj) {
  return "model.layers." + std::to_string(layer) + ".mlp." + std::string(proj) + ".weight";
}

namespace detail {
// Reads a small text file whole (config.json, the index); these bytes count as headers.
inline expected<std::string> read_small(const std::filesystem::path& p) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(p, ec);
  if (ec) return make_error(errc::invalid_argument, p.string() + ": cannot read: " + ec.message());
  if (size > safetensors::max_header_bytes)
    return make_error(
        errc::invalid_argument,
        p.string() + ": larger than " + std::to_string(safetensors::max_header_bytes) + " bytes");
  std::ifstream in(p, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof())
    return make_error(errc::invalid_argument, p.string() + ": cannot read");
  return text;
}

// The layer index of a name "model.layers.{i}.…", or -1.
inline long long layer_of(std::string_view name) {
  constexpr std::string_view prefix = "model.layers.";
  if (!name.starts_with(prefix)) return -1;
  name.remove_prefix(prefix.size());
  long long i = 0;
  std::size_t n = 0;
  while (n < name.size() && name[n] >= '0' && name[n] <= '9' && n < 9)
    i = i * 10 + (name[n++] - '0');
  return n > 0 && n < name.size() && name[n] == '.' ? i : -1;
}
}  // namespace detail

//! The activation Hugging Face's `hidden_act` names, for a dense FFN that is gated or not; an
//! error for what moefold has no exact counterpart of (gelu_pytorch_tanh: our GELU is erf's).
[[nodiscard]] inline expected<activation> activation_of_hidden_act(std::string_view act,
                                                                   bool gated) {
  if (act == "silu" || act == "swish") return gated ? activation::swiglu : activation::silu;
  if (act == "gelu") return gated ? activation::geglu : activation::gelu;
  if (act == "relu" && !gated) return activation::relu;
  if (act == "relu2" && !gated) return activation::squared_relu;
  return make_error(errc::not_supported,
                    "hidden_act \"" + std::string(act) + "\" has no moefold activation for a " +
                        (gated ? "gated" : "non-gated") +
                        " FFN (silu, swish and gelu, or relu and relu2 when not gated); give "
                        "--activation");
}

//! A dense checkpoint opened lazily (headers only).
class dense_checkpoint {
 public:
  //! The most layers a checkpoint may name (the largest published decoders have a few hundred).
  static constexpr long long max_layers = 1 << 16;

  [[nodiscard]] static expected<dense_checkpoint> open(const std::filesystem::path& path) {
    dense_checkpoint c;
    std::error_code ec;
    std::filesystem::path folder = path;
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(path, ec)) {
      const auto index = path / "model.safetensors.index.json";
      if (std::filesystem::exists(index, ec)) {
        auto text = detail::read_small(index);
        if (!text) return unexpected<error>(text.error());
        c.header_bytes_ += text->size();
        auto doc = parse_json_document(*text);
        if (!doc)
          return make_error(errc::invalid_argument, index.string() + ": " + doc.error().message);
        if (!doc->is_object() || !doc->contains("weight_map") || !(*doc)["weight_map"].is_object())
          return make_error(errc::invalid_argument,
                            index.string() +
                                ": no \"weight_map\" object (rule: the index maps "
                                "each tensor to its shard file)");
        std::set<std::string> shards;
        for (const auto& [name, file] : (*doc)["weight_map"].items()) {
          const std::string f = file.is_string() ? file.get<std::string>() : "";
          if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
            return make_error(errc::invalid_argument,
                              index.string() + ": tensor " + detail::quoted(name) +
                                  ": the shard must be a file name in the same folder");
          c.wanted_[name] = f;
          shards.insert(f);
        }
        for (const auto& f : shards) files.push_back(path / f);
      } else if (std::filesystem::exists(path / "model.safetensors", ec)) {
        files.push_back(path / "model.safetensors");
      } else {
        return make_error(
            errc::invalid_argument,
            path.string() + ": a folder without model.safetensors.index.json or model.safetensors");
      }
    } else {
      files.push_back(path);
      folder = path.parent_path();
    }
    c.folder_ = folder.empty() ? std::filesystem::path(".") : folder;
    c.source_ = path.string();
    for (const auto& f : files) {
      auto r = safetensors::reader::open(f);
      if (!r) return unexpected<error>(r.error());
      c.header_bytes_ += r->header_bytes();
      c.files_.push_back(std::make_unique<safetensors::reader>(std::move(*r)));
    }
    // Every tensor by name; in a sharded checkpoint, the index says which shard holds it.
    for (const auto& file : c.files_) {
      const std::string shard = std::filesystem::path(file->path()).filename().string();
      for (const auto& t : file->tensors()) {
        if (!c.wanted_.empty()) {
          auto it = c.wanted_.find(t.name);
          if (it == c.wanted_.end() || it->second != shard) continue;
        }
        if (!c.by_name_.emplace(t.name, located_tensor{file.get(), &t}).second)
          return make_error(errc::invalid_argument,
                            file->path() + ": tensor " + detail::quoted(t.name) +
                                " is also in another file (rule: each tensor once)");
        c.num_layers_ = std::max<long long>(c.num_layers_, detail::layer_of(t.name) + 1);
      }
    }
    for (const auto& [name, shard] : c.wanted_)
      if (!c.by_name_.contains(name))
        return make_error(errc::invalid_argument, (c.folder_ / shard).string() + ": tensor " +
                                                      detail::quoted(name) +
                                                      " is missing (the index names it)");
    const auto config = c.folder_ / "config.json";
    if (std::filesystem::exists(config, ec)) {
      auto text = detail::read_small(config);
      if (!text) return unexpected<error>(text.error());
      c.header_bytes_ += text->size();
      auto doc = parse_json_document(*text);
      if (!doc)
        return make_error(errc::invalid_argument, config.string() + ": " + doc.error().message);
      if (doc->is_object() && doc->contains("hidden_act")) {
        if (!(*doc)["hidden_act"].is_string())
          return make_error(errc::invalid_argument,
                            config.string() + ": hidden_act is not a string");
        c.hidden_act_ = (*doc)["hidden_act"].get<std::string>();
      }
    }
    if (c.num_layers_ > max_layers)
      return make_error(errc::invalid_argument, path.string() + ": a tensor names layer " +
                                                    std::to_string(c.num_layers_ - 1) +
                                                    " (rule: at most " +
                                                    std::to_string(max_layers) + " layers)");
    if (c.num_layers_ == 0)
      return make_error(errc::invalid_argument,
                        path.string() +
                            ": no tensor named model.layers.{i}.… (not a decoder "
                            "checkpoint in the Hugging Face layout)");
    return c;
  }

  //! Layers counted over every tensor named model.layers.{i}.… (max i + 1).
  [[nodiscard]] int num_layers() const noexcept { return static_cast<int>(num_layers_); }
  //! Bytes of every header, index and config read so far.
  [[nodiscard]] std::uint64_t header_bytes() const noexcept { return header_bytes_; }
  [[nodiscard]] const std::optional<std::string>& hidden_act() const noexcept {
    return hidden_act_;
  }
  [[nodiscard]] const std::filesystem::path& folder() const noexcept { return folder_; }

  [[nodiscard]] const located_tensor* find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &it->second;
  }

  //! Layer i's FFN tensors, checked: up [F_d, H], down [H, F_d], gate (if any) like up, one
  //! floating-point dtype for all three.
  [[nodiscard]] expected<dense_layer> layer(int i) const {
    dense_layer l;
    l.index = i;
    const auto missing = [&](std::string_view proj) {
      return make_error(errc::invalid_argument,
                        source_ + ": tensor " + ffn_name(i, proj) +
                            " is missing (rule: every upcycled layer has up_proj and down_proj)");
    };
    const located_tensor* up = find(ffn_name(i, "up_proj"));
    const located_tensor* down = find(ffn_name(i, "down_proj"));
    if (up == nullptr) return missing("up_proj");
    if (down == nullptr) return missing("down_proj");
    l.up = *up;
    l.down = *down;
    if (const located_tensor* gate = find(ffn_name(i, "gate_proj"))) l.gate = *gate;
    for (auto [proj, slot] :
         {std::pair{"gate_proj", &l.gate_bias}, std::pair{"up_proj", &l.up_bias},
          std::pair{"down_proj", &l.down_bias}}) {
      std::string bias = ffn_name(i, proj);
      bias.replace(bias.size() - 6, 6, "bias");  // ".weight" -> ".bias"
      if (const located_tensor* b = find(bias)) *slot = *b;
    }
    const auto where = [](const located_tensor& t) {
      return t.file->path() + ": tensor " + t.info->name;
    };
    const auto shape_text = [](const safetensors::tensor_info& t) {
      std::string s = "[";
      for (std::size_t k = 0; k < t.shape.size(); ++k)
        s += (k ? ", " : "") + std::to_string(t.shape[k]);
      return s + "]";
    };
    const auto& u = *l.up.info;
    if (u.shape.size() != 2 || u.shape[0] == 0 || u.shape[1] == 0 || u.shape[0] > INT32_MAX ||
        u.shape[1] > INT32_MAX)
      return make_error(errc::shape_mismatch, where(l.up) + ": shape " + shape_text(u) +
                                                  " (rule: up_proj is [F_d, H], both >= 1)");
    l.shape = {.hidden = static_cast<int>(u.shape[1]),
               .ffn = static_cast<int>(u.shape[0]),
               .gated = l.gate.has_value()};
    l.dtype = u.dtype;
    if (l.dtype != "F32" && l.dtype != "BF16" && l.dtype != "F16" && l.dtype != "F64")
      return make_error(errc::not_supported, where(l.up) + ": dtype " + l.dtype +
                                                 " (rule: F32, BF16, F16 or F64 weights)");
    const auto& dn = *l.down.info;
    if (dn.shape != std::vector<std::uint64_t>{u.shape[1], u.shape[0]})
      return make_error(errc::shape_mismatch,
                        where(l.down) + ": shape " + shape_text(dn) + ", up_proj's " +
                            shape_text(u) + " needs down_proj [H, F_d] = [" +
                            std::to_string(u.shape[1]) + ", " + std::to_string(u.shape[0]) + "]");
    if (dn.dtype != l.dtype)
      return make_error(errc::invalid_argument, where(l.down) + ": dtype " + dn.dtype +
                                                    " differs from up_proj's " + l.dtype);
    if (l.gate) {
      const auto& g = *l.gate->info;
      if (g.shape != u.shape)
        return make_error(errc::shape_mismatch, where(*l.gate) + ": shape " + shape_text(g) +
                                                    " differs from up_proj's " + shape_text(u));
      if (g.dtype != l.dtype)
        return make_error(errc::invalid_argument, where(*l.gate) + ": dtype " + g.dtype +
                                                      " differs from up_proj's " + l.dtype);
    }
    // Biases: 1-D, the weights' dtype, gate and up [F_d] together (up alone when not gated),
    // down [H].
    const auto bias_rule = [&](const located_tensor& t, std::uint64_t n, const std::string& rule) {
      return make_error(errc::shape_mismatch,
                        where(t) + ": shape " + shape_text(*t.info) + ", dtype " + t.info->dtype +
                            " (rule: " + rule + " [" + std::to_string(n) + "] in " + l.dtype + ")");
    };
    for (auto [b, n, rule] : {std::tuple{&l.gate_bias, u.shape[0], "gate_proj.bias is"},
                              std::tuple{&l.up_bias, u.shape[0], "up_proj.bias is"},
                              std::tuple{&l.down_bias, u.shape[1], "down_proj.bias is"}})
      if (*b &&
          ((*b)->info->shape != std::vector<std::uint64_t>{n} || (*b)->info->dtype != l.dtype))
        return bias_rule(**b, n, rule);
    if (l.gate_bias && !l.gate)
      return make_error(errc::invalid_argument,
                        where(*l.gate_bias) + ": a gate bias without gate_proj.weight");
    if (l.gate.has_value() && l.gate_bias.has_value() != l.up_bias.has_value())
      return make_error(errc::invalid_argument,
                        where(l.gate_bias ? *l.gate_bias : *l.up_bias) +
                            ": gate_proj and up_proj must both have a bias or neither (rule: "
                            "they form one fc1)");
    return l;
  }

 private:
  std::filesystem::path folder_;
  std::string source_;  // the path given: a file or a folder
  std::vector<std::unique_ptr<safetensors::reader>> files_;
  std::map<std::string, std::string> wanted_;  // the index's weight_map (sharded only)
  std::map<std::string, located_tensor> by_name_;
  long long num_layers_ = 0;
  std::uint64_t header_bytes_ = 0;
  std::optional<std::string> hidden_act_;
};

}  // namespace moefold::examples
