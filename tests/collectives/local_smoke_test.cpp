#include <catch2/catch.hpp>

#include "collectives/local.h"
#include "kernels/error.h"

using namespace collectives;
using kernels::DType;

TEST_CASE("local smoke: all_gather, all_reduce, timeout, exception", "[collectives][local]") {
  run_ranks(4, [](Communicator& world) {
    Tensor x = Tensor::full({3}, world.rank(), DType::kF32);
    Tensor all = Tensor::empty({12}, DType::kF32);
    world.wait(world.all_gather(x, all));
    for (int i = 0; i < 12; ++i) REQUIRE(all.item({i}) == i / 3);
    Tensor s = Tensor::full({5}, world.rank() + 1, DType::kF32);
    world.wait(world.all_reduce(s, s, ReduceOp::kSum));
    for (int i = 0; i < 5; ++i) REQUIRE(s.item({i}) == 10);
    std::vector<int> g = world.rank() < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    auto sub = world.split(g, "pair");
    REQUIRE(sub->size() == 2);
    Tensor y = Tensor::full({1}, world.rank(), DType::kI64);
    sub->wait(sub->all_reduce(y, y, ReduceOp::kMax));
    REQUIRE(y.item({0}) == (world.rank() < 2 ? 1 : 3));
  });
  REQUIRE_THROWS_WITH(run_ranks(3, [](Communicator& world) {
                        if (world.rank() == 2) return;
                        Tensor x = Tensor::zeros({1}, DType::kF32);
                        world.all_reduce(x, x, ReduceOp::kSum)->wait(Milliseconds{200});
                      }),
                      Catch::Contains("ranks [2] never joined"));
  REQUIRE_THROWS_WITH(run_ranks(3, [](Communicator& world) {
                        if (world.rank() == 1) throw kernels::InvalidArgument("boom");
                        Tensor x = Tensor::zeros({1}, DType::kF32);
                        world.wait(world.all_reduce(x, x, ReduceOp::kSum));
                      }),
                      "boom");
}
