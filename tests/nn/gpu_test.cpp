// [gpu] nn on a CUDA device: the optimizers create their state on the parameters' device (it was
// CPU memory, and the first AdamW step on a CUDA parameter failed: fsdp-train --backend nccl on an
// H100) and their steps equal the CPU's. Exits 77 (skipped) without a GPU.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/device.h"
#include "nn/optim.h"
#include "nn/parameter.h"

namespace {

using collectives::Communicator;
using dtensor::DeviceMesh;
using dtensor::Dims;
using dtensor::DTensor;
using dtensor::MeshComms;
using kernels::Device;
using kernels::DType;
using kernels::Tensor;

struct Stepped {
  std::vector<Tensor> params;               // on the CPU, after the steps
  std::vector<std::string> state_devices;  // of every state tensor
};

// Three steps of `optimizer` on two parameters of a one-rank mesh, on `device`; the gradients
// are a function of the global index and the step.
Stepped three_steps(const std::string& optimizer, Device device) {
  Stepped out;
  collectives::run_ranks(1, [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape({1}), world);
    nn::NamedParameters params;
    for (const auto& [name, shape] : {std::pair<std::string, Dims>{"w", Dims{7, 5}}, {"b", Dims{5}}}) {
      auto p = std::make_shared<nn::Parameter>(comms, shape, DType::kF32, nn::Init::uniform(-1, 1), std::nullopt,
                                               device);
      p->materialize(3, name);
      params.emplace_back(name, p);
    }
    std::unique_ptr<nn::Optimizer> opt;
    if (optimizer == "adamw") {
      kernels::AdamWOptions o;
      o.lr = 1e-2;
      o.weight_decay = 0.1;
      opt = std::make_unique<nn::AdamW>(params, o);
    } else {
      kernels::SgdOptions o;
      o.lr = 0.1;
      o.momentum = 0.9;
      opt = std::make_unique<nn::SGD>(params, o);
    }
    for (int step = 0; step < 3; ++step) {
      for (auto& [name, p] : params) {
        Tensor g = Tensor::empty(p->shape(), DType::kF32);
        const Dims shape = p->shape();
        g.fill_index_([&](std::span<const int64_t> i) {
          int64_t flat = 0;
          for (size_t d = 0; d < i.size(); ++d) flat = flat * shape[static_cast<int>(d)] + i[d];
          return std::sin(0.37 * static_cast<double>(flat) + step);
        });
        p->grad() = DTensor(comms, p->data().spec(), device.is_cpu() ? g : g.to(device));
      }
      opt->step();
    }
    for (auto& [name, p] : params) {
      out.params.push_back(p->data().to_local().to(Device{}));
      for (const std::string& key : opt->state_keys())
        out.state_devices.push_back(kernels::to_string(opt->state(name, key).to_local().device()));
    }
  });
  return out;
}

}  // namespace

TEST_CASE("optimizers keep their state on the parameters' GPU and step as on the CPU", "[nn][gpu]") {
  int ran = 0;
  for (const std::string optimizer : {"adamw", "sgd"}) {
    INFO(optimizer);
    const Stepped cpu = three_steps(optimizer, Device{});
    const Stepped gpu = three_steps(optimizer, Device::cuda(0));
    REQUIRE(gpu.params.size() == 2);
    REQUIRE(cpu.params.size() == gpu.params.size());
    for (size_t i = 0; i < cpu.params.size(); ++i) {
      REQUIRE(cpu.params[i].shape() == gpu.params[i].shape());
      CHECK(kernels::allclose(gpu.params[i], cpu.params[i], /*rtol=*/0, /*atol=*/1e-5));
    }
    REQUIRE(!gpu.state_devices.empty());
    for (const std::string& d : gpu.state_devices) CHECK(d == "cuda:0");
    for (const std::string& d : cpu.state_devices) CHECK(d == "cpu");
    ++ran;
  }
  CHECK(ran == 2);
}

TEST_CASE("DTensor factories allocate each shard on the given GPU with the CPU's values", "[dtensor][gpu]") {
  std::vector<std::string> devices;
  std::vector<bool> same;  // per factory with values: the GPU's equal the CPU's
  collectives::run_ranks(1, [&](Communicator& world) {
    auto comms = MeshComms::create(DeviceMesh::from_shape({1}), world);
    const dtensor::Placements r{dtensor::Replicate{}};
    const Dims shape{6, 4};
    const auto made = [&](Device d) {
      return std::vector<DTensor>{dtensor::zeros(shape, DType::kF32, comms, r, d),
                                  dtensor::ones(shape, DType::kF32, comms, r, d),
                                  dtensor::full(shape, 2.5, DType::kBF16, comms, r, d),
                                  dtensor::rand(shape, 7, DType::kF32, comms, r, d),
                                  dtensor::empty(shape, DType::kF64, comms, r, d)};
    };
    const std::vector<DTensor> cpu = made(Device{}), gpu = made(Device::cuda(0));
    for (size_t i = 0; i < gpu.size(); ++i) {
      devices.push_back(kernels::to_string(gpu[i].to_local().device()));
      if (i + 1 == gpu.size()) break;  // empty: no values to compare
      same.push_back(kernels::equal(gpu[i].to_local().to(Device{}), cpu[i].to_local()));
    }
  });
  REQUIRE(devices.size() == 5);
  for (const std::string& d : devices) CHECK(d == "cuda:0");
  REQUIRE(same.size() == 4);
  for (bool s : same) CHECK(s);
}
