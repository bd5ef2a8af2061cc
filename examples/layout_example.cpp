// The README's ten-line API example, built and run as a test so it stays true.
#include <fmt/ranges.h>

#include "dtensor/spec.h"
#include "program/main.h"
using namespace dtensor;

int main() {
  return program::run("layout-example", [] {
    auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({4, 2}, {"dp", "tp"}));
    auto spec = make_spec(mesh, parse_placements("_S(0,2),S(0)"), {18, 2}, kernels::DType::kF32);
    for (int rank : mesh->ranks()) {
      ShardLayout l = *spec.layout(rank);  // local_shape, global_offset, runs of held indices
      fmt::print("rank {} coord {} rows {}\n", rank, *mesh->coord_of(rank), l.indices(0));
    }
    return program::kOk;
  });
}
