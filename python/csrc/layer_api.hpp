// The interface between moefold_torch's torch-facing unit (binding.cpp, g++ with torch's headers)
// and the units that compile the layer (layer_f32_f64.cpp, layer_bf16.cpp: no torch header, so
// they compile in parallel with it and the CUDA units to come can be nvcc units behind the same
// interface). Tensors cross it as host pointers of the layer's element type T (or its gradient
// type G: fp32 for bf16), contiguous, in the layouts docs/pytorch.md gives.
#pragma once

#include <moefold/comm/exchange_communicator.hpp>
#include <moefold/core/expected.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace moefold_torch {

enum class element { f64, f32, bf16 };

//! Everything a layer is made from besides its communicators.
struct layer_spec {
  moefold::moe_layer_options options{};  //!< with options.dispatcher set
  int ffn = 0;                           //!< the routed experts' FFN size F (unsharded)
  moefold::drop_policy_variant policy{};
  moefold::activation act = moefold::activation::swiglu;
  element dtype = element::f32;
};

using layer_communicators = moefold::moe_layer_communicators<moefold::exchange_communicator>;

//! The layer's parameters (T) or their gradient buffers (G), this rank's shards; null where the
//! layer has no such parameter (no shared expert, no gate).
struct param_pointers {
  void* router = nullptr;       //!< [E, H]
  void* fc1 = nullptr;          //!< [L, F1, H]
  void* fc2 = nullptr;          //!< [L, H, F / ETP]
  void* shared_fc1 = nullptr;   //!< [F1s / TP, H]
  void* shared_fc2 = nullptr;   //!< [H, Fs / TP]
  void* shared_gate = nullptr;  //!< [1, H]
};

//! Element counts of each parameter on this rank (0: the layer has none).
struct param_counts {
  std::size_t router = 0, fc1 = 0, fc2 = 0, shared_fc1 = 0, shared_fc2 = 0, shared_gate = 0;
};

//! One forward's results besides its output.
struct forward_values {
  std::array<double, 4> losses{};  //!< aux, seq_aux, global_aux, z (moefold::moe_loss order)
  std::vector<std::int64_t> rows_per_local_expert;  //!< [L], padding included
  std::vector<std::int64_t> routed, kept;           //!< [E], pairs of this rank's tokens
  std::int64_t dropped_pairs = 0;
};

//! One rank's layer. Forwards in flight are contexts named by the id forward() returns; each holds
//! its saved activations until backward() or release(). Calls are collective over the layer's
//! groups, as the layer's own.
class layer_api {
 public:
  virtual ~layer_api() = default;
  [[nodiscard]] virtual param_counts counts() const = 0;
  //! Points the layer at the caller's weights and gradient buffers (read in place, gradients
  //! accumulated; checked against counts()); all-null `grads`: the weights alone (the gradient
  //! buffers stay as bound; a forward writes none). Called before every forward and backward, so
  //! the caller may replace its tensors at any time between steps.
  [[nodiscard]] virtual moefold::status bind(const param_pointers& weights,
                                             const param_pointers& grads) = 0;
  //! out [n, H] for x [n, H] (order_keys [n] or null); `keep`: keep the context for a backward
  //! (its id returned), else it is released at once (-1 returned).
  [[nodiscard]] virtual moefold::expected<int> forward(const void* x, int n,
                                                       const std::int64_t* order_keys, void* out,
                                                       bool keep, forward_values& values) = 0;
  //! Frees the saved activations of context `id` (activation checkpointing); the forward's
  //! losses' terms stay, so recompute() can refill it before its backward.
  [[nodiscard]] virtual moefold::status drop_activations(int id) = 0;
  //! Refills context `id` (its activations) from the same input; changes no layer state.
  [[nodiscard]] virtual moefold::status recompute(int id, const void* x, int n,
                                                  const std::int64_t* order_keys, void* out) = 0;
  //! dx [n, H] from dout [n, H] of context `id` (n must be its forward's token count); seeds
  //! weight the output's gradient and each loss (output, aux, seq_aux, global_aux, z). The
  //! forward stays held (its activations dropped) until release(): recompute() and another
  //! backward give the same bits again.
  [[nodiscard]] virtual moefold::status backward(int id, const void* dout, int n,
                                                 const std::array<double, 5>& seeds, void* dx) = 0;
  virtual void release(int id) noexcept = 0;
  //! Whether context `id` holds its activations (a backward may run without a recompute).
  [[nodiscard]] virtual bool ready(int id) const noexcept = 0;
  //! Contexts held (forwards not released).
  [[nodiscard]] virtual int in_flight() const noexcept = 0;
  //! The bound gradients summed over their groups (layer::reduce_gradients).
  [[nodiscard]] virtual moefold::status reduce_gradients() = 0;
  [[nodiscard]] virtual moefold::status end_global_batch() = 0;
  virtual void set_training(bool training) noexcept = 0;
  [[nodiscard]] virtual moefold::expected<moefold::moe_layer_state> save_state() = 0;
  [[nodiscard]] virtual moefold::status load_state(const moefold::moe_layer_state& s) = 0;
  //! The options it was made with (EP, ETP, TP from its communicators).
  [[nodiscard]] virtual const moefold::moe_layer_options& options() const noexcept = 0;
};

//! The layer of one element type; each is defined in its own unit.
[[nodiscard]] moefold::expected<std::unique_ptr<layer_api>> make_layer_f64(
    const layer_spec& spec, layer_communicators comms);
[[nodiscard]] moefold::expected<std::unique_ptr<layer_api>> make_layer_f32(
    const layer_spec& spec, layer_communicators comms);
[[nodiscard]] moefold::expected<std::unique_ptr<layer_api>> make_layer_bf16(
    const layer_spec& spec, layer_communicators comms);

//! By spec.dtype.
[[nodiscard]] inline moefold::expected<std::unique_ptr<layer_api>> make_layer(
    const layer_spec& spec, layer_communicators comms) {
  switch (spec.dtype) {
    case element::f64: return make_layer_f64(spec, std::move(comms));
    case element::f32: return make_layer_f32(spec, std::move(comms));
    case element::bf16: break;
  }
  return make_layer_bf16(spec, std::move(comms));
}

}  // namespace moefold_torch
