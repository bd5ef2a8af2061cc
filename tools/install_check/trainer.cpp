// Built by tools/install_check.sh against an installed prefix only (pkg-config and CMake), never
// against the source tree: a small program that uses every layer a trainer needs. It prints one
// line per layer and exits 0.
#include <cstdio>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "fsdp/fully_shard.h"
#include "nn/layers.h"
#include "program/main.h"

int main() {
  return program::run("install-check", [] {
    collectives::run_ranks(2, [](collectives::Communicator& world) {
      auto comms = std::make_shared<dtensor::MeshComms>(dtensor::DeviceMesh::from_shape({2}), world);
      const kernels::Tensor full = kernels::Tensor::arange({4, 2}, kernels::DType::kF32);  // 0..7
      dtensor::DTensor x = dtensor::distribute_tensor(full, comms, dtensor::parse_placements("S(0)"));
      const kernels::Tensor back = x.redistribute(dtensor::parse_placements("R")).to_local();
      nn::Linear layer({.comms = comms}, 4, 2);
      nn::materialize(layer, /*seed=*/1);
      fsdp::fully_shard(layer, comms);
      if (world.rank() == 0) {
        std::printf("dtensor: S(0) -> R gives element [3,1] = %g\n", back.item({3, 1}));
        std::printf("fsdp: a Linear sharded with %zu parameters\n", layer.named_parameters().size());
      }
    });
    try {
      (void)checkpoint::read_metadata("/nonexistent/dtensor-runtime-install-check");
      std::printf("checkpoint: read a directory that does not exist\n");
    } catch (const kernels::Error&) {
      std::printf("checkpoint: refused a missing directory\n");
    }
    return program::kOk;
  });
}
