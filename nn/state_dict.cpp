#include "nn/state_dict.h"

#include <fmt/format.h>

#include "kernels/error.h"
#include "kernels/format.h"

namespace nn {

using dtensor::DTensor;
using kernels::InvalidArgument;
using kernels::Tensor;

const DTensor* StateDict::find(std::string_view key) const {
  for (const auto& [k, t] : tensors)
    if (k == key) return &t;
  return nullptr;
}

DTensor* StateDict::find(std::string_view key) {
  for (auto& [k, t] : tensors)
    if (k == key) return &t;
  return nullptr;
}

void StateDict::merge(const StateDict& other, const std::string& prefix) {
  for (const auto& [k, t] : other.tensors) {
    const std::string key = prefix + k;
    if (find(key)) throw InvalidArgument(fmt::format("state dict: tensor '{}' appears twice", key));
    tensors.emplace_back(key, t);
  }
  for (const auto& [k, v] : other.values) {
    const std::string key = prefix + k;
    if (!values.emplace(key, v).second)
      throw InvalidArgument(fmt::format("state dict: value '{}' appears twice", key));
  }
}

StateDict StateDict::sub(const std::string& prefix) const {
  StateDict out;
  for (const auto& [k, t] : tensors)
    if (k.compare(0, prefix.size(), prefix) == 0) out.tensors.emplace_back(k.substr(prefix.size()), t);
  for (const auto& [k, v] : values)
    if (k.compare(0, prefix.size(), prefix) == 0) out.values.emplace(k.substr(prefix.size()), v);
  return out;
}

int64_t StateDict::int_value(const std::string& key) const {
  auto it = values.find(key);
  if (it == values.end()) throw InvalidArgument(fmt::format("state dict: no value '{}'", key));
  if (const auto* i = std::get_if<int64_t>(&it->second)) return *i;
  if (const auto* d = std::get_if<double>(&it->second))
    if (*d == static_cast<double>(static_cast<int64_t>(*d))) return static_cast<int64_t>(*d);
  throw InvalidArgument(fmt::format("state dict: value '{}' is not an integer", key));
}

double StateDict::double_value(const std::string& key) const {
  auto it = values.find(key);
  if (it == values.end()) throw InvalidArgument(fmt::format("state dict: no value '{}'", key));
  if (const auto* i = std::get_if<int64_t>(&it->second)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(&it->second)) return *d;
  throw InvalidArgument(fmt::format("state dict: value '{}' is not a number", key));
}

void for_each_full_tensor(const StateDict& sd, bool rank0_only,
                          const std::function<void(const std::string&, const Tensor&)>& fn) {
  for (const auto& [key, t] : sd.tensors) {
    if (!t.comms()->in_mesh()) continue;
    Tensor full = t.full_tensor();
    const bool first = t.device_mesh().ranks().front() == t.comms()->rank();
    if (rank0_only && !first) continue;
    fn(key, full.device().is_cpu() ? full : full.to(kernels::Device{}));
  }
}

void copy_into(const std::string& key, const DTensor& dst, const DTensor& src) {
  if (!(dst.shape() == src.shape()))
    throw InvalidArgument(
        fmt::format("load_state_dict: '{}' has shape {} in the state dict but {} here", key, src.shape(), dst.shape()));
  if (!(dst.device_mesh() == src.device_mesh()))
    throw InvalidArgument(fmt::format(
        "load_state_dict: '{}' lives on mesh {} in the state dict but {} here; load a checkpoint "
        "(checkpoint::load reshards onto any mesh) or redistribute first",
        key, dtensor::to_string(src.device_mesh()), dtensor::to_string(dst.device_mesh())));
  if (!dst.comms()->in_mesh()) return;
  if (dst.placements() == src.placements()) {
    Tensor out = dst.to_local();
    out.copy_(src.to_local());
    return;
  }
  DTensor moved = src.redistribute(dst.placements());
  Tensor out = dst.to_local();
  out.copy_(moved.to_local());
}

}  // namespace nn
