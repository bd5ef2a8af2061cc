#include "nn/parameter.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>
#include <span>
#include <vector>

#include "kernels/allocator.h"
#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/hash.h"

namespace nn {

using kernels::InvalidArgument;
using kernels::mix64;

namespace {

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// A uniform value in (0, 1] with 53 random bits.
double unit(uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1.0p-53; }

}  // namespace

double Init::value(uint64_t seed, std::string_view name, int64_t index) const {
  switch (kind) {
    case Kind::kZeros:
      return 0.0;
    case Kind::kOnes:
      return 1.0;
    case Kind::kConstant:
      return a;
    case Kind::kUniform:
    case Kind::kNormal: {
      const uint64_t key = mix64(seed ^ mix64(fnv1a(name)));
      const uint64_t i = static_cast<uint64_t>(index);
      const double u1 = unit(mix64(key + 2 * i)), u2 = unit(mix64(key + 2 * i + 1));
      if (kind == Kind::kUniform) return a + (b - a) * (u1 - 0x1.0p-53);
      // Box-Muller: u1 in (0, 1] keeps the logarithm finite.
      return a + b * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    }
  }
  return 0.0;
}

std::string to_string(const Init& init) {
  switch (init.kind) {
    case Init::Kind::kZeros:
      return "zeros";
    case Init::Kind::kOnes:
      return "ones";
    case Init::Kind::kConstant:
      return fmt::format("constant({})", init.a);
    case Init::Kind::kNormal:
      return fmt::format("normal(mean={}, std={})", init.a, init.b);
    case Init::Kind::kUniform:
      return fmt::format("uniform({}, {})", init.a, init.b);
  }
  return "?";
}

Parameter::Parameter(std::shared_ptr<const MeshComms> comms, Dims shape, DType dtype, Init init,
                     std::optional<Placements> placements, kernels::Device device)
    : comms_(std::move(comms)), shape_(shape), dtype_(dtype), init_(init), device_(device) {
  if (!comms_) throw InvalidArgument("Parameter: the mesh communicators are null");
  placements_ = placements ? *placements : Placements(comms_->mesh().ndim(), dtensor::Replicate{});
  placements_ = dtensor::normalize_placements(placements_, comms_->mesh().ndim(), shape_.size());
  if (!kernels::is_floating_point(dtype_))
    throw InvalidArgument(fmt::format("Parameter: dtype {} is not a floating dtype", dtype_));
}

const DTensor& Parameter::data() const {
  if (!data_)
    throw InvalidArgument(fmt::format("Parameter of shape {}: still meta (call materialize first)", shape_));
  return *data_;
}

void Parameter::set_data(DTensor value) {
  // Any floating dtype (FSDP's mixed precision swaps a bf16 unsharded view onto an f32
  // parameter); dtype() follows.
  if (!(value.shape() == shape_) || (value.dtype() != dtype_ && !kernels::is_floating_point(value.dtype())))
    throw InvalidArgument(fmt::format("Parameter::set_data: a {} {} tensor for a {} {} parameter",
                                      value.shape(), value.dtype(), shape_, dtype_));
  placements_ = value.placements();
  dtype_ = value.dtype();
  data_ = std::move(value);
}

void Parameter::set_placements(const Placements& placements) {
  const Placements p = dtensor::normalize_placements(placements, comms_->mesh().ndim(), shape_.size());
  for (size_t m = 0; m < p.size(); ++m)
    if (dtensor::is_partial(p[m]))
      throw InvalidArgument(
          fmt::format("Parameter::set_placements: {} on mesh dim {}: a parameter holds a value, "
                      "not a partial sum",
                      dtensor::to_string(p[m]), m));
  if (data_ && !(p == placements_)) {
    data_ = data_->redistribute(p);
    grad_.reset();
    grad_maker_ = nullptr;
  }
  placements_ = p;
}

void Parameter::set_dtype(DType dtype) {
  if (!kernels::is_floating_point(dtype))
    throw InvalidArgument(fmt::format("Parameter::set_dtype: {} is not a floating dtype", dtype));
  if (data_ && dtype != dtype_) {
    DTensor& d = *data_;
    dtensor::DTensorSpec spec = d.spec();
    spec.dtype = dtype;
    data_ = DTensor(d.comms(), spec, d.to_local().to(dtype));
    grad_.reset();
    grad_maker_ = nullptr;
  }
  dtype_ = dtype;
}

Tensor Parameter::shard_storage(std::string_view name, const dtensor::DTensorSpec& spec,
                                const dtensor::ShardLayout& layout) {
  if (target_) {
    Tensor t = target_();
    if (!(t.shape() == layout.local_shape) || t.dtype() != dtype_)
      throw InvalidArgument(fmt::format(
          "Parameter::materialize: '{}' ({} {} under {}): the materialize target is {} {}, expected the local shard "
          "{} {}",
          name, kernels::to_string(dtype_), shape_, dtensor::to_string(spec.placements), kernels::to_string(t.dtype()),
          t.shape(), kernels::to_string(dtype_), layout.local_shape));
    return t;
  }
  // The shard's bytes are checked against what the allocator can still hand out before anything
  // is allocated: a parameter too large for the machine is a ResourceError naming the bytes.
  const int64_t bytes = kernels::checked_bytes(layout.local_shape.product(), kernels::itemsize(dtype_),
                                               "Parameter::materialize: bytes of the local shard");
  const kernels::Allocator* allocator = comms_->allocator().get();
  const int64_t available =
      allocator ? allocator->available_bytes(device_) : kernels::machine_available_bytes(device_);
  if (available >= 0 && bytes > available)
    throw kernels::ResourceError(fmt::format(
        "Parameter::materialize: '{}' ({} {}, local shard {}) needs {} bytes ({:.1f} GiB) on rank {} ({}), but {} "
        "bytes ({:.1f} GiB) are available",
        name, kernels::to_string(dtype_), shape_, layout.local_shape, bytes, static_cast<double>(bytes) / (1 << 30),
        comms_->rank(), kernels::to_string(device_), available, static_cast<double>(available) / (1 << 30)));
  return Tensor::empty(layout.local_shape, dtype_, device_, comms_->allocator());
}

void Parameter::materialize(uint64_t seed, std::string_view name) {
  dtensor::DTensorSpec spec = dtensor::make_spec(
      std::shared_ptr<const dtensor::DeviceMesh>(comms_, &comms_->mesh()), placements_, shape_, dtype_);
  if (!comms_->in_mesh()) {
    data_ = DTensor(comms_, spec, Tensor::empty({0}, dtype_, device_));
    return;
  }
  const dtensor::ShardLayout layout = *spec.layout(comms_->rank());
  // A RaggedShard's layout is of the flattened view (NOTE [ragged view] in dtensor/layout.h),
  // whose row-major flat index is the tensor's.
  const Dims dims = dtensor::ragged_mesh_dim(placements_) >= 0 ? dtensor::ragged_view(shape_, placements_) : shape_;
  const int nd = dims.size();
  // The values are written in place from the layout's runs (no index lists, no staging copy).
  Tensor local = shard_storage(name, spec, layout);
  std::vector<dtensor::HeldIndices> held;
  for (int t = 0; t < nd; ++t) held.emplace_back(layout.runs[t]);
  local.fill_index_([&](std::span<const int64_t> pos) {
    int64_t flat = 0;
    for (int t = 0; t < nd; ++t) flat = flat * dims[t] + held[t][pos[t]];
    return init_.value(seed, name, flat);
  });
  data_ = DTensor(comms_, spec, local);
  grad_.reset();
  grad_maker_ = nullptr;
}

void Parameter::to_empty(std::string_view name) {
  if (data_) return;
  dtensor::DTensorSpec spec = dtensor::make_spec(
      std::shared_ptr<const dtensor::DeviceMesh>(comms_, &comms_->mesh()), placements_, shape_, dtype_);
  if (!comms_->in_mesh()) {
    data_ = DTensor(comms_, spec, Tensor::empty({0}, dtype_, device_));
    return;
  }
  data_ = DTensor(comms_, spec, shard_storage(name, spec, *spec.layout(comms_->rank())));
  grad_.reset();
  grad_maker_ = nullptr;
}

void Parameter::zero_grad(bool set_to_none) {
  grad_maker_ = nullptr;
  if (set_to_none) {
    grad_.reset();
    accumulate_next_ = true;
    return;
  }
  if (grad_ && comms_->in_mesh()) {
    Tensor g = grad_->to_local();
    g.fill_(0.0);
  }
  accumulate_next_ = true;
}

void Parameter::set_grad_buffer(DTensor buffer, bool accumulate) {
  if (!(buffer.shape() == shape_))
    throw InvalidArgument(
        fmt::format("Parameter::set_grad_buffer: a buffer of shape {} for a parameter of shape {}",
                    buffer.shape(), shape_));
  grad_ = std::move(buffer);
  accumulate_next_ = accumulate;
  grad_maker_ = nullptr;
}

void Parameter::set_grad_buffer_lazy(std::function<DTensor()> make) {
  grad_.reset();
  accumulate_next_ = false;
  grad_maker_ = std::move(make);
}

dtensor::ops::GradSink Parameter::grad_sink() {
  dtensor::ops::GradSink sink;
  sink.needed = requires_grad;
  if (grad_maker_ && requires_grad) {
    const std::function<DTensor()> make = std::move(grad_maker_);
    grad_maker_ = nullptr;
    set_grad_buffer(make(), false);
  }
  sink.into = &grad_;
  sink.accumulate = accumulate_next_;
  accumulate_next_ = true;
  return sink;
}

}  // namespace nn
