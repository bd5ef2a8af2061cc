// kernels/checked.h, Dims::product and the Tensor size checks: exact results below the int64
// limit, an InvalidArgument naming the operands at it, never a wrapped value.
#include <catch2/catch.hpp>

#include "kernels/checked.h"
#include "kernels/dims.h"
#include "kernels/error.h"
#include "kernels/tensor.h"

using namespace kernels;

TEST_CASE("checked arithmetic is exact up to int64 and throws past it", "[kernels][checked]") {
  constexpr int64_t kMax = kInt64Max;
  CHECK(checked_add(kMax - 1, 1, "x") == kMax);
  CHECK(checked_sub(-kMax, 1, "x") == -kMax - 1);
  CHECK(checked_mul(int64_t{1} << 31, int64_t{1} << 31, "x") == int64_t{1} << 62);
  REQUIRE_THROWS_AS(checked_add(kMax, 1, "offset"), InvalidArgument);
  REQUIRE_THROWS_WITH(checked_add(kMax, 1, "offset"),
                      "offset overflows int64: 9223372036854775807 + 1 > 9223372036854775807");
  REQUIRE_THROWS_WITH(checked_sub(-kMax - 1, 1, "offset"), Catch::Contains("-9223372036854775808 - 1 <"));
  REQUIRE_THROWS_WITH(checked_mul(int64_t{1} << 40, int64_t{1} << 30, "element count"),
                      "element count overflows int64: 1099511627776 x 1073741824 > 9223372036854775807");
  CHECK(checked_bytes(kMax / 8, 8, "bytes") == kMax / 8 * 8);
  REQUIRE_THROWS_AS(checked_bytes(kMax / 8 + 1, 8, "bytes"), InvalidArgument);
}

TEST_CASE("checked_ceil_div never forms a + b - 1", "[kernels][checked]") {
  CHECK(checked_ceil_div(kInt64Max, 2, "chunk") == int64_t{1} << 62);
  CHECK(checked_ceil_div(kInt64Max, kInt64Max, "chunk") == 1);
  CHECK(checked_ceil_div(0, 7, "chunk") == 0);
  CHECK(checked_ceil_div(9, 4, "chunk") == 3);
  CHECK(checked_ceil_div(8, 4, "chunk") == 2);
  REQUIRE_THROWS_WITH(checked_ceil_div(5, 0, "chunk size"), Catch::Contains("chunk size: ceil(5 / 0)"));
  REQUIRE_THROWS_AS(checked_ceil_div(-1, 2, "chunk size"), InvalidArgument);
}

TEST_CASE("checked_product: a zero entry wins, overflow names the operands", "[kernels][checked]") {
  const int64_t big[] = {int64_t{1} << 40, int64_t{1} << 40};
  const int64_t zero[] = {int64_t{1} << 40, int64_t{1} << 40, 0};
  const int64_t none[] = {7};
  CHECK(checked_product(zero, "n") == 0);
  CHECK(checked_product(none, "n") == 7);
  CHECK(checked_product({}, "n") == 1);
  REQUIRE_THROWS_WITH(checked_product(big, "element count"), Catch::Contains("1099511627776 x 1099511627776"));
  CHECK(checked_int(2147483647, "rank") == 2147483647);
  REQUIRE_THROWS_WITH(checked_int(int64_t{1} << 32, "rank"), Catch::Contains("rank 4294967296 is out of range"));
}

TEST_CASE("Dims::product is checked and names the list", "[kernels][checked][dims]") {
  CHECK(Dims{3037000499, 3037000499}.product() == int64_t{3037000499} * 3037000499);
  CHECK(Dims{int64_t{1} << 62, 4, 0}.product() == 0);  // as torch: a zero-size dim holds nothing
  REQUIRE_THROWS_AS((Dims{3037000500, 3037000500}.product()), InvalidArgument);
  REQUIRE_THROWS_WITH((Dims{4294967296, 4294967297}.product()),
                      Catch::Contains("[4294967296,4294967297]") && Catch::Contains("overflows int64"));
}

TEST_CASE("Tensor sizes, strides and views are checked", "[kernels][checked][tensor]") {
  // Element count, bytes and contiguous strides of an unallocatable shape: InvalidArgument
  // before any allocation (never a wrapped size that allocates a few bytes).
  REQUIRE_THROWS_AS(Tensor::empty({int64_t{1} << 32, int64_t{1} << 32}, DType::kU8), InvalidArgument);
  REQUIRE_THROWS_WITH(Tensor::empty({int64_t{1} << 62}, DType::kF32), Catch::Contains("needs more than"));
  // numel 0, but the strides of [0, 2^62, 4] overflow: refused like torch ("Stride calculation overflowed").
  REQUIRE_THROWS_WITH(Tensor::empty({0, int64_t{1} << 62, 4}, DType::kF32), Catch::Contains("contiguous stride"));
  CHECK(Tensor::empty({int64_t{1} << 62, 4, 0}, DType::kF32).numel() == 0);
  Tensor t = Tensor::zeros({4, 4}, DType::kF32);
  REQUIRE_THROWS_AS(t.as_strided({2, 2}, {kInt64Max, 1}, 0), InvalidArgument);
  REQUIRE_THROWS_AS(t.as_strided({3}, {1}, kInt64Max), InvalidArgument);
  REQUIRE_THROWS_AS(t.view({int64_t{1} << 62, 8, -1}), InvalidArgument);
  // An allocation the machine cannot give is a ResourceError naming the bytes.
  REQUIRE_THROWS_WITH(Tensor::empty({int64_t{1} << 60}, DType::kU8),
                      Catch::Contains("cannot allocate 1152921504606846976 bytes"));
  REQUIRE_THROWS_AS(Tensor::empty({int64_t{1} << 60}, DType::kU8), ResourceError);
}

TEST_CASE("clip cuts long quoted input and keeps it on one line", "[kernels][error]") {
  CHECK(clip("[[0,1],[2,3]]") == "[[0,1],[2,3]]");
  CHECK(clip("a\nb") == "a b");
  const std::string long_text(100000, '7');
  const std::string c = clip(long_text);
  CHECK(c.size() < 120);
  CHECK(c.find("(100000 chars)") != std::string::npos);
}
