// The README's API example, built and run as a test so it stays true. program::run (program/main.h)
// maps any failure to the documented exit status with one line on stderr.
#include <fmt/format.h>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/format.h"
#include "program/main.h"
using namespace dtensor;

int main() {
  return program::run("api-example", [] {
    collectives::run_ranks(4, [](collectives::Communicator& world) {  // 4 ranks as threads
      auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({2, 2}, {"dp", "tp"}), world);
      Tensor full = Tensor::arange({6, 4}, kernels::DType::kF32);       // same on every rank
      DTensor x = distribute_tensor(full, comms, parse_placements("S(0),R"));
      DTensor y = x.redistribute(parse_placements("R,S(1)"));           // planned, cached, run
      if (world.rank() == 0) fmt::print("plan {}\n", to_string(x.plan_to(y.placements())));
      fmt::print("rank {} holds {}\n", world.rank(), y.to_local());
    });
    return program::kOk;
  });
}
