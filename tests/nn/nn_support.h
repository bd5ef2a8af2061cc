// Helpers of the nn tests: ranks on a local world with a mesh, deterministic values, full-tensor
// conversions.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/tensor.h"
#include "nn/module.h"
#include "support/local_mesh.h"

namespace nn_test {

using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using dtensor::Placements;
using kernels::DType;
using kernels::Tensor;

// fn(comms, world) on every rank of a local world shaped like a mesh.
using testing_support::on_mesh;

// Values in [-1, 1) as a function of the flat index and a salt.
inline Tensor values(const Dims& shape, int salt, DType dtype = DType::kF64) {
  const int64_t n = shape.product();
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[i] = static_cast<double>(((i + 1) * 7919 + salt * 104729) % 211) / 105.5 - 1.0;
  return Tensor::from_vector(v, shape, dtype);
}

inline Tensor ids(const Dims& shape, int64_t classes, int salt) {
  const int64_t n = shape.product();
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(((i + 3) * 2654435761ll + salt * 97) % classes);
  return Tensor::from_vector(v, shape, DType::kI64);
}

// A DTensor of `full` with `placements` (each rank takes its piece locally).
inline DTensor place(const Tensor& full, const std::shared_ptr<const MeshComms>& comms,
                     const char* placements) {
  return dtensor::distribute_tensor(full, comms, dtensor::parse_placements(placements), std::nullopt);
}

inline DTensor replicated(const Tensor& full, const std::shared_ptr<const MeshComms>& comms) {
  return dtensor::distribute_tensor(full, comms, Placements(comms->mesh().ndim(), dtensor::Replicate{}),
                                    std::nullopt);
}

// Overwrites every parameter with values(shape, salt + i) * scale (norm weights and biases
// included, so their gradients are exercised away from 1 and 0).
inline void randomize(nn::Module& m, int salt, double scale = 0.5) {
  int i = 0;
  for (auto& [name, p] : m.named_parameters()) {
    const Tensor full = values(p->shape(), salt + i++, p->dtype());
    DTensor d =
        dtensor::distribute_tensor(kernels::Tensor::from_vector(full.to_vector(), p->shape(), p->dtype()),
                                   p->comms(), p->placements(), std::nullopt);
    Tensor local = d.to_local();
    std::vector<double> v = local.to_vector();
    for (double& x : v) x *= scale;
    p->set_data(DTensor(d.comms(), d.spec(), Tensor::from_vector(v, local.shape(), p->dtype())));
  }
}

inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double m = x.size() == y.size() ? 0.0 : INFINITY;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

}  // namespace nn_test
