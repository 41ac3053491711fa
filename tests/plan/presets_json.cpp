// Writes every model and cluster preset as a model or cluster file into the directory given
// (model-NAME.json, cluster-NAME.json), for the schema test (schema_test.py), after checking that
// the tool reads each one back to the same preset. Exit 1 if one does not round-trip.
#include <moefold/plan/cluster.hpp>
#include <moefold/plan/model_flops.hpp>
#include <moefold/plan/model_presets.hpp>

#include <cstdio>
#include <fstream>
#include <string>

#include "plan_files.hpp"

int main(int argc, char** argv) {
  namespace mp = moefold::plan;
  namespace ex = moefold::examples;
  if (argc != 2) {
    std::fprintf(stderr, "usage: presets_json OUTDIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  int bad = 0;
  for (auto n : mp::model_preset_names) {
    const auto m = mp::model_preset(n).value();
    const std::string text = ex::model_to_json(m).dump(2);
    const auto back = ex::model_from_json(text);
    if (!back || back->total_params() != m.total_params() ||
        mp::megatron_model_flops(*back, 1) != mp::megatron_model_flops(m, 1) ||
        ex::model_to_json(*back) != ex::model_to_json(m)) {
      std::fprintf(stderr, "model preset %s does not read back: %s\n", std::string(n).c_str(),
                   back ? "different numbers" : back.error().message.c_str());
      ++bad;
    }
    std::ofstream(dir + "/model-" + std::string(n) + ".json") << text << "\n";
  }
  for (auto n : mp::cluster_preset_names) {
    const auto c = mp::cluster_preset(n).value();
    const std::string text = ex::cluster_to_json(c).dump(2);
    const auto back = ex::cluster_from_json(text);
    if (!back || ex::cluster_to_json(*back) != ex::cluster_to_json(c)) {
      std::fprintf(stderr, "cluster preset %s does not read back: %s\n", std::string(n).c_str(),
                   back ? "different numbers" : back.error().message.c_str());
      ++bad;
    }
    std::ofstream(dir + "/cluster-" + std::string(n) + ".json") << text << "\n";
  }
  std::printf("%zu model and %zu cluster presets written to %s\n", mp::model_preset_names.size(),
              mp::cluster_preset_names.size(), dir.c_str());
  return bad ? 1 : 0;
}
