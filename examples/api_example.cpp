// The README's API example, built and run as a test so it stays true.
#include <fmt/format.h>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/format.h"
using namespace dtensor;

int main() {
  collectives::run_ranks(4, [](collectives::Communicator& world) {  // 4 ranks as threads
    auto comms = std::make_shared<MeshComms>(DeviceMesh::from_shape({2, 2}, {"dp", "tp"}), world);
    Tensor full = Tensor::arange({6, 4}, kernels::DType::kF32);       // same on every rank
    DTensor x = distribute_tensor(full, comms, parse_placements("S(0),R"));
    DTensor y = x.redistribute(parse_placements("R,S(1)"));           // planned, cached, run
    if (world.rank() == 0) fmt::print("plan {}\n", to_string(x.plan_to(y.placements())));
    fmt::print("rank {} holds {}\n", world.rank(), y.to_local());
  });
}
