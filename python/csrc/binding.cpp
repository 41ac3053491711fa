// moefold_torch._C: the torch-facing unit (g++, the only one that includes torch/extension.h).
// For now: moefold's communicator over a torch process group (torch_communicator), exposed to
// Python for CPU tensors, so that trainers and the tests can run moefold's collectives on the
// groups their job has. Errors raise moefold_torch.MoefoldError with the rule that was broken and
// moefold's error kind (`code`).
#include <torch/extension.h>

#include <moefold/comm/torch/torch_communicator.hpp>
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
using namespace moefold;

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
// peers); its status is raised after the GIL is taken back.
template <class F>
status without_gil(F&& f) {
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
}
