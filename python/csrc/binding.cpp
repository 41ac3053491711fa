// moefold_torch._C: the torch-facing unit (g++, the only one that includes torch/extension.h).
// moefold's communicator over a torch process group (torch_communicator) and moefold's MoE layer
// (compiled in the layer units behind layer_api.hpp, which include no torch header), exposed to
// Python for CPU tensors. Errors raise moefold_torch.MoefoldError with the rule that was broken and
// moefold's error kind (`code`); arguments this unit refuses raise ValueError.
#include <torch/extension.h>

#include <moefold/comm/thread_exchange.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/comm/torch/torch_communicator.hpp>
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "layer_api.hpp"

namespace py = pybind11;
using namespace moefold;
using moefold_torch::layer_spec;
using moefold_torch::param_counts;
using moefold_torch::param_pointers;

namespace {

// moefold_torch.MoefoldError, created at import.
PyObject* moefold_error = nullptr;

[[noreturn]] void raise(const error& e) {
  py::object err = py::reinterpret_borrow<py::object>(moefold_error);
  py::object ex = err(e.message);
  ex.attr("code") = py::str(std::string(to_string(e.code)));
  PyErr_SetObject(moefold_error, ex.ptr());
  throw py::error_already_set();
}
void check(const status& st) {
  if (!st) raise(st.error());
}

// Runs a collective with the GIL released (other Python threads go on while it waits for its
// peers: the ranks of a thread world are Python threads); its status is raised after the GIL is
// taken back.
template <class F>
auto without_gil(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

// An argument this binding refuses before moefold sees it: ValueError naming it.
[[noreturn]] void bad(const std::string& what) { throw py::value_error("moefold_torch: " + what); }

// A CPU tensor's rows: [n] as [n, 1], [n, w] as is; contiguous.
void check_cpu(const at::Tensor& t, const char* name) {
  if (!t.device().is_cpu()) {
    const std::string m = std::string("moefold_torch: ") + name + " is a " + t.device().str() +
                          " tensor: moefold_torch runs CPU tensors over gloo so far (CUDA "
                          "tensors over NCCL are not implemented yet)";
    PyErr_SetString(PyExc_NotImplementedError, m.c_str());
    throw py::error_already_set();
  }
  if (!t.is_contiguous()) bad(std::string(name) + " must be contiguous");
  if (t.dim() < 1 || t.dim() > 2) bad(std::string(name) + " must be [n] or [n, width]");
}
int rows_of(const at::Tensor& t) { return static_cast<int>(t.size(0)); }
int width_of(const at::Tensor& t) { return t.dim() == 2 ? static_cast<int>(t.size(1)) : 1; }

// Calls f.template operator()<T>() with T the element type of `t` (the types moefold moves).
template <class F>
void by_dtype(const at::Tensor& t, bool reduction, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: return f.template operator()<float>();
    case at::kDouble: return f.template operator()<double>();
    case at::kBFloat16: return f.template operator()<bfloat16>();
    case at::kHalf: return f.template operator()<float16>();
    case at::kInt:
      if (!reduction) return f.template operator()<std::int32_t>();
      break;
    case at::kLong:
      if (!reduction) return f.template operator()<std::int64_t>();
      break;
    default: break;
  }
  bad(std::string("tensors of ") + c10::toString(t.scalar_type()) +
      (reduction ? " are not reduced (float32, float64, bfloat16, float16)"
                 : " are not moved (float32, float64, bfloat16, float16, int32, int64)"));
}

template <class T>
row_view<T> rows(at::Tensor& t) {
  return row_view<T>(reinterpret_cast<T*>(t.data_ptr()), rows_of(t), width_of(t));
}
template <class T>
row_view<const T> crows(const at::Tensor& t) {
  return row_view<const T>(reinterpret_cast<const T*>(t.const_data_ptr()), rows_of(t), width_of(t));
}

reduce_op op_of(const std::string& op) {
  if (op == "sum") return reduce_op::sum;
  if (op == "max") return reduce_op::max;
  bad("op must be 'sum' or 'max' (got '" + op + "')");
}

void same_dtype(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type())
    bad(std::string("send and receive tensors differ in dtype (") + c10::toString(a.scalar_type()) +
        ", " + c10::toString(b.scalar_type()) + ")");
}

// One rank's communicator over a Python process group. Counts are rows per peer.
class py_communicator {
 public:
  explicit py_communicator(const c10::intrusive_ptr<c10d::ProcessGroup>& g) {
    auto c = torch_communicator::wrap(g);
    if (!c) raise(c.error());
    c_.emplace(std::move(*c));
  }
  int rank() const { return c_->rank(); }
  int size() const { return c_->size(); }
  bool broken() const { return c_->broken(); }

  void all_to_all_v(const at::Tensor& send, const std::vector<int>& send_counts, at::Tensor& recv,
                    const std::vector<int>& recv_counts) {
    check_cpu(send, "send");
    check_cpu(recv, "recv");
    same_dtype(send, recv);
    // The backend sends from `send` while rows arrive in `recv` (no staging): apart or refused.
    const auto* s0 = static_cast<const std::byte*>(send.data_ptr());
    const auto* r0 = static_cast<const std::byte*>(recv.data_ptr());
    if (send.nbytes() && recv.nbytes() && s0 < r0 + recv.nbytes() && r0 < s0 + send.nbytes())
      bad("all_to_all_v: send and recv overlap (rows would be overwritten before they are sent)");
    by_dtype(send, false, [&]<class T>() {
      host_exec x;
      check(without_gil([&] {
        return c_->all_to_all_v(x, crows<T>(send), send_counts, rows<T>(recv), recv_counts);
      }));
    });
  }
  void all_gather_v(const at::Tensor& send, at::Tensor& recv, const std::vector<int>& counts) {
    check_cpu(send, "send");
    check_cpu(recv, "recv");
    same_dtype(send, recv);
    by_dtype(send, false, [&]<class T>() {
      host_exec x;
      check(
          without_gil([&] { return c_->all_gather_v(x, crows<T>(send), rows<T>(recv), counts); }));
    });
  }
  void reduce_scatter_v(const at::Tensor& send, const std::vector<int>& counts, at::Tensor& recv,
                        const std::string& op) {
    check_cpu(send, "send");
    check_cpu(recv, "recv");
    same_dtype(send, recv);
    const reduce_op o = op_of(op);
    by_dtype(send, true, [&]<class T>() {
      if constexpr (reducible<T>) {
        host_exec x;
        check(without_gil(
            [&] { return c_->reduce_scatter_v(x, crows<T>(send), counts, rows<T>(recv), o); }));
      }
    });
  }
  void all_reduce(at::Tensor& buf, const std::string& op) {
    check_cpu(buf, "buf");
    const reduce_op o = op_of(op);
    by_dtype(buf, true, [&]<class T>() {
      if constexpr (reducible<T>) {
        host_exec x;
        check(without_gil([&] { return c_->all_reduce(x, rows<T>(buf), o); }));
      }
    });
  }
  void broadcast(at::Tensor& buf, int root) {
    check_cpu(buf, "buf");
    by_dtype(buf, false, [&]<class T>() {
      host_exec x;
      check(without_gil([&] { return c_->broadcast(x, rows<T>(buf), root); }));
    });
  }
  void barrier() {
    check(without_gil([&] { return c_->barrier(); }));
  }
  void fail(const std::string& why) {
    check(without_gil([&] { return c_->fail(why); }));
  }

 private:
  std::optional<torch_communicator> c_;
};

// The groups of the layer's kinds under moefold's Megatron-Core layout of a fold: for each kind,
// every group's global ranks in group order (what moefold_torch.new_groups creates with
// dist.new_group, and what groups_from checks a trainer's groups against).
py::dict megatron_group_ranks(int world, int tp, int cp, int pp, int ep, int etp,
                              const std::string& order) {
  auto f = make_folded(
      {.world = world, .tp = tp, .cp = cp, .pp = pp, .ep = ep, .etp = etp, .order = order});
  if (!f) throw py::value_error("moefold_torch: " + f.error().message);
  const megatron_groups g(*f);
  py::dict out;
  for (group_kind k : {group_kind::tp, group_kind::cp, group_kind::dp, group_kind::pp,
                       group_kind::dp_cp, group_kind::tp_cp, group_kind::tp_dp_cp, group_kind::ep,
                       group_kind::etp, group_kind::tp_ep, group_kind::edp}) {
    const group_list l = g(k);
    py::list groups;
    for (int i = 0; i < l.count(); ++i) {
      py::list ranks;
      for (int j = 0; j < l.group_size(); ++j) ranks.append(l(i, j));
      groups.append(ranks);
    }
    out[py::str(to_string(k))] = groups;
  }
  return out;
}

// --- The thread world (tests): ranks as Python threads of one process ---------------------------

// One rank's thread-world communicator, handed to Python until a layer takes it (split() gives
// the communicators of a mapping's groups).
class py_thread_comm {
 public:
  explicit py_thread_comm(thread_communicator c) : c_(std::move(c)) {}
  int rank() const { return live().rank(); }
  int size() const { return live().size(); }
  py_thread_comm split(int color, int key) {
    auto c = without_gil([&] { return live().split(color, key); });
    if (!c) raise(c.error());
    return py_thread_comm(std::move(*c));
  }
  // Consumed: the communicator moves into the exchange backend of a layer's group.
  exchange_communicator take() {
    auto c = exchange_communicator::make(std::make_unique<thread_exchange>(std::move(live())));
    c_.reset();
    if (!c) raise(c.error());
    return std::move(*c);
  }

 private:
  thread_communicator& live() {
    if (!c_) bad("this thread-world communicator was given to a layer already");
    return *c_;
  }
  const thread_communicator& live() const {
    if (!c_) bad("this thread-world communicator was given to a layer already");
    return *c_;
  }
  std::optional<thread_communicator> c_;
};

// fn(world) on n threads, each a rank of a thread world holding the GIL while it runs Python (and
// releasing it inside every collective). Returns each rank's error message ('' where it
// returned); a rank that raises is a dead peer to the others (they fail at once).
std::vector<std::string> run_threads(int n, const py::function& fn, double timeout_s) {
  std::vector<std::string> errors(static_cast<std::size_t>(std::max(n, 1)));
  const auto ms = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
  std::vector<status> st;
  {
    py::gil_scoped_release nogil;
    st = run_thread_world(n,
                          [&](thread_communicator& world) -> status {
                            py::gil_scoped_acquire gil;
                            try {
                              fn(py_thread_comm(std::move(world)));
                            } catch (py::error_already_set& e) {
                              return make_error(errc::comm_peer_failed, e.what());
                            }
                            return {};
                          },
                          {.timeout = ms});
  }
  for (std::size_t r = 0; r < st.size() && r < errors.size(); ++r)
    if (!st[r]) errors[r] = st[r].error().message;
  return errors;
}

// --- The layer ----------------------------------------------------------------------------------

// A layer's group of one kind: a ProcessGroup, a thread-world communicator, or None (one rank).
exchange_communicator comm_of(const py::dict& groups, const char* kind) {
  if (!groups.contains(kind)) bad(std::string("groups: no group of kind '") + kind + "'");
  py::handle h = groups[kind];
  if (h.is_none()) {
    auto c = exchange_communicator::make(std::make_unique<single_rank_exchange>());
    if (!c) raise(c.error());
    return std::move(*c);
  }
  if (py::isinstance<py_thread_comm>(h)) return h.cast<py_thread_comm&>().take();
  auto pg = h.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  auto c = torch_communicator::wrap(pg);
  if (!c) raise(c.error());
  return exchange_communicator(std::move(*c));
}

template <class V>
V get(const py::dict& d, const char* key) {
  if (!d.contains(key)) bad(std::string("layer spec: '") + key + "' is missing");
  return d[key].cast<V>();
}
template <class V>
std::optional<V> get_optional(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return d[key].cast<V>();
}

template <class E, std::size_t N>
E pick(const std::string& v, const char* arg,
       const std::array<std::pair<const char*, E>, N>& opts) {
  std::string names;
  for (const auto& [name, e] : opts) {
    if (v == name) return e;
    names += std::string(names.empty() ? "" : ", ") + "'" + name + "'";
  }
  bad(std::string(arg) + " must be one of " + names + " (got '" + v + "')");
}

layer_spec spec_of(const py::dict& d) {
  layer_spec s;
  moe_layer_options& o = s.options;
  o.hidden = get<int>(d, "hidden_size");
  s.ffn = get<int>(d, "ffn_hidden_size");
  o.max_tokens = get<int>(d, "max_tokens");
  o.batch = get<int>(d, "micro_batch");
  o.max_recv_rows = get_optional<int>(d, "max_recv_rows");
  o.router.num_experts = get<int>(d, "num_experts");
  o.router.topk = get<int>(d, "router_topk");
  o.router.score = pick(get<std::string>(d, "router_score_function"), "router_score_function",
                        std::array{std::pair{"softmax", score_function::softmax},
                                   std::pair{"sigmoid", score_function::sigmoid},
                                   std::pair{"sqrt_softplus", score_function::sqrt_softplus}});
  o.router.pre_softmax = get<bool>(d, "router_pre_softmax");
  o.router.scaling_factor = get_optional<double>(d, "router_topk_scaling_factor");
  o.router.num_groups = get_optional<int>(d, "router_num_groups").value_or(0);
  o.router.group_topk = get_optional<int>(d, "router_group_topk").value_or(0);
  o.router.expert_bias = get<bool>(d, "router_enable_expert_bias");
  o.expert_bias_update_rate = get<float>(d, "router_bias_update_rate");
  o.aux_loss_coeff = get<double>(d, "aux_loss_coeff");
  o.z_loss_coeff = get<double>(d, "z_loss_coeff");
  o.seq_aux_loss_coeff = get<double>(d, "seq_aux_loss_coeff");
  o.global_aux_loss_coeff = get<double>(d, "global_aux_loss_coeff");
  o.dispatcher = pick(get<std::string>(d, "token_dispatcher_type"), "token_dispatcher_type",
                      std::array{std::pair{"alltoall", dispatcher_kind::all_to_all},
                                 std::pair{"allgather", dispatcher_kind::all_gather}});
  s.act =
      pick(get<std::string>(d, "activation"), "activation",
           std::array{std::pair{"swiglu", activation::swiglu},
                      std::pair{"geglu", activation::geglu}, std::pair{"gelu", activation::gelu},
                      std::pair{"silu", activation::silu}, std::pair{"relu", activation::relu},
                      std::pair{"squared_relu", activation::squared_relu}});
  o.shared_expert.ffn = get<int>(d, "shared_expert_intermediate_size");
  o.shared_expert.gate = get<bool>(d, "shared_expert_gate");
  o.shared_expert.act = s.act;
  const drop_by by = pick(
      get<std::string>(d, "token_drop_policy"), "token_drop_policy",
      std::array{std::pair{"probs", drop_by::probs}, std::pair{"position", drop_by::position}});
  if (const auto cf = get_optional<double>(d, "expert_capacity_factor")) {
    const bool pad = get<bool>(d, "pad_expert_input_to_capacity");
    if (get<bool>(d, "full_sequence_dropping"))
      s.policy = full_sequence{.capacity_factor = *cf, .pad_to_capacity = pad, .by = by};
    else
      s.policy = sub_sequence{.capacity_factor = *cf, .pad_to_capacity = pad, .by = by};
  }
  s.dtype = pick(get<std::string>(d, "params_dtype"), "params_dtype",
                 std::array{std::pair{"float32", moefold_torch::element::f32},
                            std::pair{"bfloat16", moefold_torch::element::bf16},
                            std::pair{"float64", moefold_torch::element::f64}});
  return s;
}

at::ScalarType scalar_of(moefold_torch::element e) {
  switch (e) {
    case moefold_torch::element::f64: return at::kDouble;
    case moefold_torch::element::f32: return at::kFloat;
    case moefold_torch::element::bf16: break;
  }
  return at::kBFloat16;
}

// A tensor the layer reads or writes: CPU, contiguous, of `type`, `elems` elements.
void* checked(const at::Tensor& t, const char* name, at::ScalarType type, std::size_t elems) {
  if (!t.device().is_cpu()) check_cpu(t, name);  // NotImplementedError naming the device
  if (!t.is_contiguous()) bad(std::string(name) + " must be contiguous");
  if (t.scalar_type() != type)
    bad(std::string(name) + " must be " + c10::toString(type) + " (got " +
        c10::toString(t.scalar_type()) + ")");
  if (static_cast<std::size_t>(t.numel()) != elems)
    bad(std::string(name) + " must have " + std::to_string(elems) + " elements (got " +
        std::to_string(t.numel()) + ")");
  return t.data_ptr();
}

// What a make or call error becomes: ValueError for arguments moefold refused, else MoefoldError.
[[noreturn]] void raise_layer(const error& e) {
  if (e.code == errc::invalid_argument || e.code == errc::invalid_size ||
      e.code == errc::shape_mismatch || e.code == errc::rank_out_of_range)
    throw py::value_error("moefold_torch: " + e.message);
  raise(e);
}

class py_layer {
 public:
  py_layer(const py::dict& spec, const py::dict& groups) {
    const layer_spec s = spec_of(spec);
    moefold_torch::layer_communicators c{.tp = comm_of(groups, "tp"),
                                         .tp_cp = comm_of(groups, "tp-cp"),
                                         .tp_dp_cp = comm_of(groups, "tp-dp-cp"),
                                         .dp_cp = comm_of(groups, "dp-cp"),
                                         .ep = comm_of(groups, "ep"),
                                         .etp = comm_of(groups, "etp"),
                                         .tp_ep = comm_of(groups, "tp-ep"),
                                         .edp = comm_of(groups, "edp")};
    auto l = without_gil([&] { return moefold_torch::make_layer(s, std::move(c)); });
    if (!l) raise_layer(l.error());
    l_ = std::move(*l);
    type_ = scalar_of(s.dtype);
    grad_type_ = s.dtype == moefold_torch::element::f64 ? at::kDouble : at::kFloat;
    hidden_ = s.options.hidden;
  }

  py::dict counts() const {
    const param_counts n = l_->counts();
    py::dict d;
    d["router"] = n.router;
    d["fc1"] = n.fc1;
    d["fc2"] = n.fc2;
    d["shared_fc1"] = n.shared_fc1;
    d["shared_fc2"] = n.shared_fc2;
    d["shared_gate"] = n.shared_gate;
    return d;
  }
  std::string grad_dtype() const { return c10::toString(grad_type_); }

  // weights and grads: [router, fc1, fc2, shared_fc1, shared_fc2, shared_gate], None where absent.
  void bind(const std::vector<std::optional<at::Tensor>>& w,
            const std::vector<std::optional<at::Tensor>>& g) {
    if (w.size() != 6 || g.size() != 6) bad("bind takes 6 weights and 6 gradient buffers");
    const param_counts n = l_->counts();
    const std::array<std::size_t, 6> sizes{n.router,     n.fc1,        n.fc2,
                                           n.shared_fc1, n.shared_fc2, n.shared_gate};
    static constexpr std::array<const char*, 6> names{"router.weight",     "experts.fc1",
                                                      "experts.fc2",       "shared_expert.fc1",
                                                      "shared_expert.fc2", "shared_expert.gate"};
    // All gradient buffers None: the weights alone (a forward).
    const bool weights_only = std::none_of(g.begin(), g.end(), [](const auto& t) { return t; });
    std::array<void*, 6> wp{}, gp{};
    for (std::size_t i = 0; i < 6; ++i) {
      if (sizes[i] == 0) continue;
      if (!w[i] || (!weights_only && !g[i])) bad(std::string(names[i]) + ": no tensor given");
      wp[i] = checked(*w[i], names[i], type_, sizes[i]);
      if (!weights_only)
        gp[i] =
            checked(*g[i], (std::string(names[i]) + "'s gradient").c_str(), grad_type_, sizes[i]);
    }
    const auto ptrs = [](const std::array<void*, 6>& p) {
      return param_pointers{.router = p[0],
                            .fc1 = p[1],
                            .fc2 = p[2],
                            .shared_fc1 = p[3],
                            .shared_fc2 = p[4],
                            .shared_gate = p[5]};
    };
    if (auto st = l_->bind(ptrs(wp), ptrs(gp)); !st) raise_layer(st.error());
  }

  // (id, [aux, seq_aux, global_aux, z], rows_per_local_expert, routed, kept, dropped_pairs)
  py::tuple forward(const at::Tensor& x, const std::optional<at::Tensor>& keys, at::Tensor& out,
                    bool keep) {
    const int n = tokens_of(x, "x");
    checked(out, "out", type_, static_cast<std::size_t>(x.numel()));
    const std::int64_t* k = nullptr;
    if (keys)
      k = static_cast<const std::int64_t*>(
          checked(*keys, "order_keys", at::kLong, static_cast<std::size_t>(n)));
    moefold_torch::forward_values v;
    auto id = without_gil([&] { return l_->forward(x.data_ptr(), n, k, out.data_ptr(), keep, v); });
    if (!id) raise_layer(id.error());
    return py::make_tuple(*id, std::vector<double>(v.losses.begin(), v.losses.end()),
                          v.rows_per_local_expert, v.routed, v.kept, v.dropped_pairs);
  }
  void recompute(int id, const at::Tensor& x, const std::optional<at::Tensor>& keys,
                 at::Tensor& out) {
    const int n = tokens_of(x, "x");
    checked(out, "out", type_, static_cast<std::size_t>(x.numel()));
    const std::int64_t* k = nullptr;
    if (keys)
      k = static_cast<const std::int64_t*>(
          checked(*keys, "order_keys", at::kLong, static_cast<std::size_t>(n)));
    if (auto st =
            without_gil([&] { return l_->recompute(id, x.data_ptr(), n, k, out.data_ptr()); });
        !st)
      raise_layer(st.error());
  }
  void backward(int id, const at::Tensor& dout, const std::vector<double>& seeds, at::Tensor& dx) {
    if (seeds.size() != 5) bad("backward takes 5 seeds (output, aux, seq_aux, global_aux, z)");
    const int n = tokens_of(dout, "dout");
    checked(dx, "dx", type_, static_cast<std::size_t>(dout.numel()));
    std::array<double, 5> s{};
    std::copy(seeds.begin(), seeds.end(), s.begin());
    if (auto st =
            without_gil([&] { return l_->backward(id, dout.data_ptr(), n, s, dx.data_ptr()); });
        !st)
      raise_layer(st.error());
  }
  void drop_activations(int id) { check(l_->drop_activations(id)); }
  void release(int id) { l_->release(id); }
  int in_flight() const { return l_->in_flight(); }
  bool ready(int id) const { return l_->ready(id); }
  void reduce_gradients() {
    check(without_gil([&] { return l_->reduce_gradients(); }));
  }
  void end_global_batch() {
    check(without_gil([&] { return l_->end_global_batch(); }));
  }
  void set_training(bool t) { l_->set_training(t); }
  py::dict save_state() {
    auto st = without_gil([&] { return l_->save_state(); });
    if (!st) raise(st.error());
    py::dict d;
    d["expert_bias"] = st->expert_bias;
    d["expert_bias_counts"] = st->expert_bias_counts;
    d["global_aux_counts"] = st->global_aux_counts;
    d["global_aux_steps"] = st->global_aux_steps;
    return d;
  }
  void load_state(const py::dict& d) {
    moe_layer_state st{.expert_bias = get<std::vector<float>>(d, "expert_bias"),
                       .expert_bias_counts = get<std::vector<float>>(d, "expert_bias_counts"),
                       .global_aux_counts = get<std::vector<double>>(d, "global_aux_counts"),
                       .global_aux_steps = get<int>(d, "global_aux_steps")};
    if (auto s = without_gil([&] { return l_->load_state(st); }); !s) raise_layer(s.error());
  }

 private:
  // x [n, H] of the layer's dtype: n.
  int tokens_of(const at::Tensor& x, const char* name) const {
    check_cpu(x, name);
    if (x.dim() != 2 || x.size(1) != hidden_)
      bad(std::string(name) + " must be [N, " + std::to_string(hidden_) + "] (got " +
          c10::str(x.sizes()) + ")");
    if (x.scalar_type() != type_)
      bad(std::string(name) + " must be " + c10::toString(type_) + " (got " +
          c10::toString(x.scalar_type()) + ")");
    return static_cast<int>(x.size(0));
  }

  std::unique_ptr<moefold_torch::layer_api> l_;
  at::ScalarType type_ = at::kFloat, grad_type_ = at::kFloat;
  int hidden_ = 0;
};

// A 64-bit digest of a contiguous CPU tensor's bytes: how the layer recognizes the input of a
// checkpoint's recomputation (the same bytes as its first pass, in a new tensor). Not
// cryptographic: a strong mix (a 64-bit finalizer) per 8-byte word, the length and tail folded in.
std::int64_t digest(const at::Tensor& t) {
  check_cpu(t, "x");
  const auto* p = static_cast<const unsigned char*>(t.data_ptr());
  const std::size_t n = t.nbytes();
  const auto mix = [](std::uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
  };
  const std::uint64_t h = without_gil([&] {
    std::uint64_t a = 0x9e3779b97f4a7c15ull ^ n;
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, p + i, 8);
      a = mix(a ^ w);
    }
    std::uint64_t w = 0;
    if (n > i) std::memcpy(&w, p + i, n - i);
    return mix(a ^ w ^ (std::uint64_t(n - i) << 56));
  });
  return static_cast<std::int64_t>(h);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moefold's C++ core for moefold_torch";
  moefold_error = PyErr_NewException("moefold_torch.MoefoldError", PyExc_RuntimeError, nullptr);
  m.add_object("MoefoldError", py::handle(moefold_error));
  m.def("megatron_group_ranks", &megatron_group_ranks, py::arg("world"), py::arg("tp"),
        py::arg("cp"), py::arg("pp"), py::arg("ep"), py::arg("etp"),
        py::arg("order") = "tp-cp-ep-dp-pp");
  py::class_<py_communicator>(m, "Communicator")
      .def(py::init<const c10::intrusive_ptr<c10d::ProcessGroup>&>(), py::arg("group"))
      .def_property_readonly("rank", &py_communicator::rank)
      .def_property_readonly("size", &py_communicator::size)
      .def_property_readonly("broken", &py_communicator::broken)
      .def("all_to_all_v", &py_communicator::all_to_all_v, py::arg("send"), py::arg("send_counts"),
           py::arg("recv"), py::arg("recv_counts"))
      .def("all_gather_v", &py_communicator::all_gather_v, py::arg("send"), py::arg("recv"),
           py::arg("counts"))
      .def("reduce_scatter_v", &py_communicator::reduce_scatter_v, py::arg("send"),
           py::arg("counts"), py::arg("recv"), py::arg("op") = "sum")
      .def("all_reduce", &py_communicator::all_reduce, py::arg("buf"), py::arg("op") = "sum")
      .def("broadcast", &py_communicator::broadcast, py::arg("buf"), py::arg("root"))
      .def("barrier", &py_communicator::barrier)
      .def("fail", &py_communicator::fail, py::arg("why"));
  py::class_<py_thread_comm>(m, "_ThreadComm")
      .def_property_readonly("rank", &py_thread_comm::rank)
      .def_property_readonly("size", &py_thread_comm::size)
      .def("split", &py_thread_comm::split, py::arg("color"), py::arg("key"));
  m.def("_digest", &digest, py::arg("x"));
  m.def("_run_thread_world", &run_threads, py::arg("n"), py::arg("fn"),
        py::arg("timeout_s") = 30.0);
  py::class_<py_layer>(m, "Layer")
      .def(py::init<const py::dict&, const py::dict&>(), py::arg("spec"), py::arg("groups"))
      .def("counts", &py_layer::counts)
      .def_property_readonly("grad_dtype", &py_layer::grad_dtype)
      .def("bind", &py_layer::bind, py::arg("weights"), py::arg("grads"))
      .def("forward", &py_layer::forward, py::arg("x"), py::arg("order_keys"), py::arg("out"),
           py::arg("keep"))
      .def("recompute", &py_layer::recompute, py::arg("id"), py::arg("x"), py::arg("order_keys"),
           py::arg("out"))
      .def("backward", &py_layer::backward, py::arg("id"), py::arg("dout"), py::arg("seeds"),
           py::arg("dx"))
      .def("drop_activations", &py_layer::drop_activations, py::arg("id"))
      .def("release", &py_layer::release, py::arg("id"))
      .def_property_readonly("in_flight", &py_layer::in_flight)
      .def("ready", &py_layer::ready, py::arg("id"))
      .def("reduce_gradients", &py_layer::reduce_gradients)
      .def("end_global_batch", &py_layer::end_global_batch)
      .def("set_training", &py_layer::set_training, py::arg("training"))
      .def("save_state", &py_layer::save_state)
      .def("load_state", &py_layer::load_state, py::arg("state"));
}
