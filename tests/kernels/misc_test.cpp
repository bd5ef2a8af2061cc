// ReduceOp names, Device names, Dims and mix64.
#include <catch2/catch.hpp>

#include "kernels/device.h"
#include "kernels/dims.h"
#include "kernels/error.h"
#include "kernels/hash.h"
#include "kernels/reduce_op.h"

using namespace kernels;

TEST_CASE("reduce op names round trip", "[kernels][reduce_op]") {
  const struct {
    ReduceOp op;
    const char* name;
  } cases[] = {{ReduceOp::kSum, "sum"},
               {ReduceOp::kAvg, "avg"},
               {ReduceOp::kMin, "min"},
               {ReduceOp::kMax, "max"},
               {ReduceOp::kProd, "prod"}};
  for (const auto& c : cases) {
    CHECK(to_string(c.op) == c.name);
    CHECK(parse_reduce_op(c.name) == c.op);
  }
  CHECK(parse_reduce_op("product") == ReduceOp::kProd);
}

TEST_CASE("parse_reduce_op rejects unknown names", "[kernels][reduce_op]") {
  REQUIRE_THROWS_AS(parse_reduce_op("mean"), InvalidArgument);
  REQUIRE_THROWS_WITH(
      parse_reduce_op("mean"),
      "unknown reduce op 'mean': expected one of sum, avg, min, max, prod (or product)");
  REQUIRE_THROWS_WITH(parse_reduce_op("SUM"), Catch::Contains("'SUM'"));
  REQUIRE_THROWS_WITH(parse_reduce_op(""), Catch::Contains("''"));
}

TEST_CASE("device names and CUDA presence", "[kernels][device]") {
  CHECK(to_string(Device{}) == "cpu");
  CHECK(to_string(Device::cpu()) == "cpu");
  CHECK(to_string(Device::cuda()) == "cuda:0");
  CHECK(to_string(Device::cuda(3)) == "cuda:3");
  CHECK(Device::cuda(1) == Device::cuda(1));
  CHECK_FALSE(Device::cuda(1) == Device::cuda(0));
  CHECK(Device::cuda().is_cuda());
  CHECK(Device{}.is_cpu());
  CHECK(cuda_device_count() >= 0);
  if (!cuda_built()) CHECK(cuda_device_count() == 0);
}

TEST_CASE("Dims behaves like a small vector", "[kernels][dims]") {
  Dims d{4, 3};
  d.push_back(2);
  CHECK(d.size() == 3);
  CHECK(d == Dims{4, 3, 2});
  CHECK(d.product() == 24);
  CHECK(Dims{}.product() == 1);
  d.insert(0, 7);
  CHECK(d == Dims{7, 4, 3, 2});
  d.erase(1);
  CHECK(d == Dims{7, 3, 2});
  CHECK(Dims::filled(3, 5) == Dims{5, 5, 5});
  CHECK(d.vec() == std::vector<int64_t>{7, 3, 2});
  Dims full = Dims::filled(kMaxDims, 1);
  REQUIRE_THROWS_WITH(full.push_back(1), Catch::Contains("at most 8"));
  REQUIRE_THROWS_AS(Dims(std::vector<int64_t>(9, 1)), InvalidArgument);
}

TEST_CASE("parse_shape: the programs' shape grammar", "[kernels][dims]") {
  const struct {
    const char* text;
    Dims want;
  } good[] = {{"13,2", Dims{13, 2}}, {"4x8x2", Dims{4, 8, 2}}, {"0", Dims{0}}, {"", Dims{}}, {"7,0x3", Dims{7, 0, 3}}};
  int ran = 0;
  for (const auto& c : good) {
    INFO(c.text);
    CHECK(parse_shape(c.text) == c.want);
    ++ran;
  }
  CHECK(ran == 5);
  // Errors name the flag and the text, and what was expected.
  CHECK_THROWS_WITH(parse_shape("4,,3", "--shape"),
                    Catch::Contains("--shape '4,,3' is malformed at ''") && Catch::Contains("expected"));
  CHECK_THROWS_AS(parse_shape("4,-1"), InvalidArgument);
  CHECK_THROWS_WITH(parse_shape("4,-1"), Catch::Contains("malformed at '-1'"));
  CHECK_THROWS_WITH(parse_shape("2,a"), Catch::Contains("malformed at 'a'"));
  CHECK_THROWS_WITH(parse_shape("3,"), Catch::Contains("malformed at ''"));
  CHECK_THROWS_WITH(parse_shape("99999999999999999999"), Catch::Contains("out of range"));
  CHECK_THROWS_WITH(parse_shape("1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1"), Catch::Contains("more than"));
}

TEST_CASE("mix64 is splitmix64's finaliser", "[kernels][hash]") {
  // splitmix64's outputs from state 0: mix64(k * golden) for k = 0, 1, 2 (the state before the add).
  const uint64_t golden = 0x9E3779B97F4A7C15ull;
  CHECK(mix64(0) == 0xE220A8397B1DCDAFull);
  CHECK(mix64(golden) == 0x6E789E6AA1B965F4ull);
  CHECK(mix64(2 * golden) == 0x06C45D188009454Full);
  STATIC_REQUIRE(mix64(0) == 0xE220A8397B1DCDAFull);  // usable in constant expressions
}
