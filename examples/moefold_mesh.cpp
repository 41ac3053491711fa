// moefold-mesh: describe a cluster's attention mapping and MoE mapping, check the fold, and print
// every process group exactly as Megatron-Core builds it (text, JSON or SVG).
//
//   moefold-mesh --world 128 --tp 2 --pp 8 --ep 8 --etp 1
//   moefold-mesh --world 64 --tp 2 --pp 4 --ep 8 --etp 1 --format json
//
// Invalid input of any kind exits with status 2, prints nothing on stdout and one line on stderr
// that starts with "error:" and names the rule broken.
#include <moefold/moefold.hpp>

#include "cli_args.hpp"
#include "moefold_mesh_flags.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using moefold::examples::mesh_cli::options;

std::string group_text(const moefold::group_view& g) {
  std::string s = "[";
  for (int k = 0; k < g.size(); ++k) s += (k ? "," : "") + std::to_string(g[k]);
  return s + "]";
}

// How many groups of a list lie inside one node.
int groups_inside_a_node(const moefold::group_list& l, int gpus_per_node) {
  int inside = 0;
  for (auto g : l) {
    bool same = true;
    for (int k = 1; k < g.size(); ++k) same = same && g[k] / gpus_per_node == g[0] / gpus_per_node;
    inside += same ? 1 : 0;
  }
  return inside;
}

void print_json(const options& o, const moefold::dynamic_folded_mesh& f,
                const moefold::megatron_groups& groups) {
  std::ostringstream out;
  out << "{\"config\": {\"world_size\": " << f.world_size() << ", \"tp\": " << f.tp()
      << ", \"cp\": " << f.cp() << ", \"pp\": " << f.pp() << ", \"dp\": " << f.dp()
      << ", \"ep\": " << f.ep() << ", \"etp\": " << f.etp() << ", \"edp\": " << f.edp()
      << ", \"order\": \"" << f.order().str()
      << "\", \"dist_opt_instances\": " << o.dist_opt_instances << ", \"hierarchical_cp\": [";
  for (std::size_t i = 0; i < o.hierarchical_cp.size(); ++i)
    out << (i ? ", " : "") << o.hierarchical_cp[i];
  out << "], \"rank_offset\": " << o.rank_offset << "},\n \"groups\": {";
  for (int i = 0; i < groups.num_kinds(); ++i) {
    const auto kind = groups.kind_at(i);
    out << (i ? ",\n  " : "\n  ") << '"' << to_string(kind) << "\": [";
    bool first = true;
    for (auto g : groups(kind)) {
      out << (first ? "" : ", ") << group_text(g);
      first = false;
    }
    out << "]";
  }
  out << "}}\n";
  std::cout << out.str();
}

void print_text(const options& o, const moefold::dynamic_folded_mesh& f,
                const moefold::megatron_groups& groups) {
  std::ostringstream out;
  const int world = f.world_size();
  const int gpn = o.gpus_per_node;
  const int first_node = o.rank_offset / gpn;
  const int last_node = (o.rank_offset + world - 1) / gpn;
  out << "moefold-mesh: " << world << " ranks, order " << f.order().str() << "\n"
      << "  attention mesh: tp " << f.tp() << " x cp " << f.cp() << " x dp " << f.dp() << " x pp "
      << f.pp() << "\n"
      << "  MoE mesh:       etp " << f.etp() << " x ep " << f.ep() << " x edp " << f.edp()
      << " x pp " << f.pp() << "   (edp derived: world / (etp*ep*pp))\n"
      << "  " << gpn << " GPUs per node: ranks " << o.rank_offset << ".."
      << o.rank_offset + world - 1 << " on " << last_node - first_node + 1 << " node(s)\n";
  if (o.dist_opt_instances > 1)
    out << "  distributed-optimizer instances: " << o.dist_opt_instances << "\n";
  if (!o.hierarchical_cp.empty()) {
    out << "  hierarchical context parallel:";
    for (int h : o.hierarchical_cp) out << " " << h;
    out << "\n";
  }
  std::vector<std::string> inside, across;
  out << "\n";
  for (int i = 0; i < groups.num_kinds(); ++i) {
    const auto kind = groups.kind_at(i);
    const auto list = groups(kind);
    const int in = groups_inside_a_node(list, gpn);
    const std::string name = to_string(kind);
    (in == list.count() ? inside : across).push_back(name);
    char head[160];
    std::snprintf(head, sizeof head, "%-24s %-4s %5d group(s) of %-5d %s", name.c_str(),
                  moefold::is_moe_kind(kind.kind) ? "MoE" : "attn", list.count(), list.group_size(),
                  in == list.count() ? "inside a node"
                  : in == 0          ? "every group crosses nodes"
                                     : "some groups cross nodes");
    out << head << "\n";
    std::string line = "   ";
    for (auto g : list) {
      const std::string t = " " + group_text(g);
      if (line.size() + t.size() > 100) {
        out << line << "\n";
        line = "   ";
      }
      line += t;
    }
    out << line << "\n";
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s.empty() ? std::string("(none)") : s;
  };
  out << "\ninside a node: " << join(inside) << "\ncross nodes:   " << join(across) << "\n";
  std::cout << out.str();
}

// A picture of the fold: GPUs as cells, nodes as rows; the attention mesh on the left (cells
// coloured by tensor x context group, i.e. the ranks that share one attention model replica slice)
// and the MoE mesh on the right (cells coloured by expert-parallel group).
void print_svg(const options& o, const moefold::dynamic_folded_mesh& f,
               const moefold::megatron_groups& groups) {
  const int world = f.world_size();
  const int gpn = o.gpus_per_node;
  const int first_node = o.rank_offset / gpn;
  const int nodes = (o.rank_offset + world - 1) / gpn - first_node + 1;
  const int cols = std::min(gpn, 64);
  const int rows_per_node = (gpn + cols - 1) / cols;
  const int cw = 74, ch = 46, gap = 40, left = 70, top = 70;
  const int panel_w = cols * cw;
  const int width = left + 2 * panel_w + gap + 20;
  const int height = top + nodes * rows_per_node * ch + 30;
  // The colour of each rank: its group's index, found in one pass over the groups (one
  // group_list::find per rank would take time quadratic in the world).
  auto group_of = [&](moefold::group_kind kind) {
    const auto l = groups(kind);
    std::vector<int> of(static_cast<std::size_t>(world));
    for (int g = 0; g < l.count(); ++g)
      for (int k = 0; k < l.group_size(); ++k)
        of[static_cast<std::size_t>(l(g, k) - o.rank_offset)] = g;
    return of;
  };
  const std::vector<int> attn_group = group_of(moefold::group_kind::tp_cp);
  const std::vector<int> ep_group = group_of(moefold::group_kind::ep);
  auto color = [](int i) {
    const int hue = (i * 47) % 360;
    return "hsl(" + std::to_string(hue) + ",70%," + std::to_string(i % 2 ? 78 : 68) + "%)";
  };
  std::ostringstream s;
  s << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" viewBox=\"0 0 " << width << ' ' << height << "\" font-family=\"monospace\">\n"
    << "<title>moefold fold: world " << world << ", attention tp" << f.tp() << " cp" << f.cp()
    << " dp" << f.dp() << " pp" << f.pp() << ", MoE etp" << f.etp() << " ep" << f.ep() << " edp"
    << f.edp() << " pp" << f.pp() << ", order " << f.order().str() << "</title>\n"
    << "<rect x=\"0\" y=\"0\" width=\"" << width << "\" height=\"" << height
    << "\" fill=\"white\"/>\n";
  const char* titles[2] = {"attention: colour = tp-cp group", "MoE: colour = ep group"};
  for (int panel = 0; panel < 2; ++panel) {
    const int x0 = left + panel * (panel_w + gap);
    s << "<text x=\"" << x0 << "\" y=\"28\" font-size=\"15\">" << titles[panel] << "</text>\n";
    s << "<g class=\"panel " << (panel == 0 ? "attention" : "moe") << "\">\n";
    for (int r = 0; r < world; ++r) {
      const int global = o.rank_offset + r;
      const int node = global / gpn - first_node;
      const int slot = global % gpn;
      const int x = x0 + (slot % cols) * cw;
      const int y = top + (node * rows_per_node + slot / cols) * ch;
      std::string label1 = "r" + std::to_string(global), label2;
      int group = 0;
      if (panel == 0) {
        const auto c = f.attention_coord_of(r);
        group = attn_group[static_cast<std::size_t>(r)];
        label2 = "t" + std::to_string(c.tp) + "c" + std::to_string(c.cp) + "d" +
                 std::to_string(c.dp) + "p" + std::to_string(c.pp);
      } else {
        const auto c = f.moe_coord_of(r);
        group = ep_group[static_cast<std::size_t>(r)];
        label2 = "e" + std::to_string(c.ep) + "t" + std::to_string(c.etp) + "d" +
                 std::to_string(c.edp) + "p" + std::to_string(c.pp);
      }
      s << "<rect class=\"gpu\" data-rank=\"" << global << "\" x=\"" << x << "\" y=\"" << y
        << "\" width=\"" << cw - 4 << "\" height=\"" << ch - 4 << "\" rx=\"4\" fill=\""
        << color(group) << "\" stroke=\"#333\"/>\n"
        << "<text x=\"" << x + 4 << "\" y=\"" << y + 17 << "\" font-size=\"12\">" << label1
        << "</text><text x=\"" << x + 4 << "\" y=\"" << y + 33 << "\" font-size=\"11\">" << label2
        << "</text>\n";
    }
    s << "</g>\n";
  }
  for (int n = 0; n < nodes; ++n)
    s << "<text x=\"6\" y=\"" << top + n * rows_per_node * ch + 26 << "\" font-size=\"12\">node "
      << first_node + n << "</text>\n";
  s << "<text x=\"" << left << "\" y=\"52\" font-size=\"11\">labels: rank; attention t=tp c=cp "
    << "d=dp p=pp; MoE e=ep t=etp d=edp p=pp</text>\n</svg>\n";
  std::cout << s.str();
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  if (const int rc = moefold::examples::report(moefold::examples::mesh_cli::parse(argc, argv, o));
      rc >= 0)
    return rc;
  auto fold = moefold::make_folded({.world = o.world,
                                    .tp = o.tp,
                                    .cp = o.cp,
                                    .pp = o.pp,
                                    .ep = o.ep,
                                    .etp = o.etp,
                                    .order = o.order});
  if (!fold)
    return moefold::examples::fail(fold.error().message + " [" +
                                   std::string(to_string(fold.error().code)) + "]");
  moefold::group_options opt{.dist_opt_instances = o.dist_opt_instances,
                             .rank_offset = o.rank_offset};
  for (int h : o.hierarchical_cp)
    opt.hierarchical_cp.sizes[static_cast<std::size_t>(opt.hierarchical_cp.levels++)] = h;
  auto groups = moefold::megatron_groups::make(*fold, opt);
  if (!groups)
    return moefold::examples::fail(groups.error().message + " [" +
                                   std::string(to_string(groups.error().code)) + "]");
  if (o.format == "json")
    print_json(o, *fold, *groups);
  else if (o.format == "svg")
    print_svg(o, *fold, *groups);
  else
    print_text(o, *fold, *groups);
  return 0;
}
