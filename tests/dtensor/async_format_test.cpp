#include <catch2/catch.hpp>

#include "collectives/local.h"
#include "dtensor/format.h"
#include "support/dtensor_data.h"

using namespace dtensor;

TEST_CASE("redistribute_async yields the same data; fmt prints dtensor types", "[dtensor][api][async]") {
  auto mesh = DeviceMesh::from_shape({2, 2});
  std::vector<std::string> errors(4);
  collectives::run_ranks(4, [&](collectives::Communicator& world) {
    auto comms = std::make_shared<MeshComms>(mesh, world);
    DTensor x = distribute_tensor(Tensor::arange({7, 5}, kernels::DType::kF32), comms,
                                  parse_placements("S(0),S(1)"));
    RedistributeHandle pending = redistribute_async(x, parse_placements("S(1),R"));
    DTensor y = pending.wait();
    DTensor z = x.redistribute(parse_placements("S(1),R"));
    if (!kernels::equal(y.to_local(), z.to_local())) errors[world.rank()] = "async result differs";
    if (fmt::format("{}", y.placements()[0]) != "S(1)") errors[world.rank()] = "placement format";
    if (fmt::format("{}", mesh) != "[[0,1],[2,3]]") errors[world.rank()] = "mesh format";
    if (fmt::format("{}", y).find("placements=[S(1),R]") == std::string::npos)
      errors[world.rank()] = "dtensor format: " + fmt::format("{}", y);
    try {
      (void)redistribute_async(x, parse_placements("S(0),P(avg)"));
      errors[world.rank()] = "S -> P(avg) must throw on the caller";
    } catch (const kernels::Unsupported&) {
    }
  });
  for (const auto& e : errors) CHECK(e == "");
}
