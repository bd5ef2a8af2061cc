// Parameter: a DTensor and its gradient DTensor, with the recipe of its initial value.
//
//   auto p = std::make_shared<Parameter>(comms, Dims{64, 32}, DType::kF32, Init::normal(0, 0.02));
//   p->is_meta();                               // true: shape, dtype, placements only
//   p->set_placements(parse_placements("S(0)"));// a meta parameter just records them
//   p->materialize(/*seed=*/7, "blocks.0.mlp.fc1.weight");
//   // each rank allocates only its shard; element (i, j) is init(7, name, i * 32 + j) on every
//   // rank and under every sharding, so differently sharded models start identical.
//
// Shard first, then initialise (FSDP): fully_shard records the sharded placements on a meta
// parameter and a materialize target (a view into its group's flat buffer); materialize() then
// writes the same values, element for element, straight into that view: no full tensor exists.
//
// FSDP-style use: set_data() swaps another DTensor of the same global shape onto the
// parameter (an unsharded view in pre-forward, the sharded one after); set_grad_buffer() makes
// backward write the gradient into a caller-provided DTensor (a view of a flat buffer).
// Parameters are shared (std::shared_ptr) so weight tying is one object in two modules.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "dtensor/dtensor.h"
#include "dtensor/ops/ops.h"

namespace nn {

using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using dtensor::Placements;
using kernels::DType;
using kernels::Tensor;

// An initial value as a function of (seed, parameter name, global element index).
struct Init {
  enum class Kind { kZeros, kOnes, kConstant, kNormal, kUniform };
  Kind kind = Kind::kNormal;
  double a = 0.0;   // normal: mean; uniform: low; constant: the value
  double b = 0.02;  // normal: standard deviation; uniform: high

  static Init zeros() { return {Kind::kZeros, 0, 0}; }
  static Init ones() { return {Kind::kOnes, 1, 0}; }
  static Init constant(double v) { return {Kind::kConstant, v, 0}; }
  static Init normal(double mean, double std) { return {Kind::kNormal, mean, std}; }
  static Init uniform(double low, double high) { return {Kind::kUniform, low, high}; }

  // The value of global element `index` of parameter `name`.
  double value(uint64_t seed, std::string_view name, int64_t index) const;
};
std::string to_string(const Init& init);

class Parameter {
 public:
  // A meta parameter on `comms`' mesh (all-Replicate unless placements are given).
  Parameter(std::shared_ptr<const MeshComms> comms, Dims shape, DType dtype, Init init,
            std::optional<Placements> placements = std::nullopt, kernels::Device device = {});

  bool is_meta() const { return !data_.has_value(); }
  const Dims& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  const Placements& placements() const { return placements_; }
  const std::shared_ptr<const MeshComms>& comms() const { return comms_; }
  const Init& init() const { return init_; }
  kernels::Device device() const { return device_; }
  int64_t numel() const { return shape_.product(); }

  // The value. Throws InvalidArgument when the parameter is still meta.
  const DTensor& data() const;
  // Replaces the value by another DTensor of the same global shape, on any placements and any
  // floating dtype (FSDP: an unsharded bf16 view before forward, the sharded f32 one after).
  // placements() and dtype() follow.
  void set_data(DTensor value);
  // New placements: recorded on a meta parameter, redistributed on a materialised one (the
  // gradient, if any, is dropped).
  void set_placements(const Placements& placements);
  // Allocates this rank's shard (or takes the materialize target's) and fills it with
  // init.value(seed, name, global index).
  void materialize(uint64_t seed, std::string_view name);
  // Allocates this rank's shard without values (PyTorch's to_empty), for a loader that writes
  // every element next. A no-op on a materialised parameter. `name` is for messages.
  void to_empty(std::string_view name);
  // Where materialize() and to_empty() put this rank's shard: target() returns a tensor of the
  // local shape of the parameter's placements, in its dtype, on its device (FSDP: a view into
  // its group's flat buffer, which the first call allocates). Unset: a fresh tensor from the
  // mesh's allocator. Throws InvalidArgument at materialize when the shape or dtype differs.
  void set_materialize_target(std::function<Tensor()> target) { target_ = std::move(target); }
  // A new dtype for the value (meta: recorded; materialised: cast).
  void set_dtype(DType dtype);
  // Drops the value and the gradient: the parameter is meta again (shape, dtype, placements
  // kept). For a value stored elsewhere, e.g. FSDP's frozen NF4 weights (fsdp::quantize_frozen).
  void release_data() {
    data_.reset();
    grad_.reset();
    grad_maker_ = nullptr;
  }

  bool requires_grad = true;
  // The gradient, in the placements backward produced it (Partial over mesh dims that split
  // the batch until reduce_gradients / FSDP's reduce-scatter), or in the buffer's placements.
  std::optional<DTensor>& grad() { return grad_; }
  const std::optional<DTensor>& grad() const { return grad_; }
  // set_to_none drops the gradient; otherwise it is zero-filled (kept as a buffer).
  void zero_grad(bool set_to_none = true);
  // Backward writes the next gradient into `buffer` (same global shape): over its contents when
  // accumulate is false, else added. Later gradients (tied weights, microbatches) add.
  void set_grad_buffer(DTensor buffer, bool accumulate);
  // set_grad_buffer(make(), false) deferred to the first gradient write (grad_sink): the buffer
  // exists only once backward produces a gradient (FSDP's flat gradient input is allocated at
  // its group's first write, not before the group's backward). Until then grad() is empty and
  // grad_unwritten() true. Dropped, unused, by zero_grad, set_grad_buffer and release_data.
  // REQUIRES: make() returns a DTensor of this parameter's global shape (checked at the write).
  void set_grad_buffer_lazy(std::function<DTensor()> make);
  // Where the next gradient goes (for the layers' backward). Marks the gradient as written:
  // writes after this one accumulate.
  dtensor::ops::GradSink grad_sink();
  // True while a buffer given by set_grad_buffer(.., false) has not been handed to a backward:
  // no gradient was written over it yet (FSDP zeroes such a parameter's part of a flat buffer).
  bool grad_unwritten() const { return !accumulate_next_; }

 private:
  std::shared_ptr<const MeshComms> comms_;
  Dims shape_;
  DType dtype_;
  Placements placements_;
  Init init_;
  kernels::Device device_;
  std::optional<DTensor> data_;
  std::optional<DTensor> grad_;
  bool accumulate_next_ = true;
  std::function<Tensor()> target_;
  std::function<DTensor()> grad_maker_;  // set_grad_buffer_lazy: armed until the first write

  // This rank's shard for materialize / to_empty: the target's tensor, else a fresh allocation
  // (checked against what the allocator can hand out first).
  Tensor shard_storage(std::string_view name, const dtensor::DTensorSpec& spec, const dtensor::ShardLayout& layout);
};

}  // namespace nn
