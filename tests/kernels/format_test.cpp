// fmt output of the kernels types; tensors print like PyTorch's.
#include "kernels/format.h"

#include <catch2/catch.hpp>
#include <limits>

using namespace kernels;

TEST_CASE("format small types", "[kernels][format]") {
  CHECK(fmt::format("{}", Dims{4, 3}) == "[4,3]");
  CHECK(fmt::format("{}", Dims{}) == "[]");
  CHECK(fmt::format("{}", Dims{-1}) == "[-1]");
  CHECK(fmt::format("{}", DType::kBF16) == "bf16");
  CHECK(fmt::format("{:>6}|", DType::kF32) == "   f32|");
  CHECK(fmt::format("{}", Device::cuda(1)) == "cuda:1");
  CHECK(fmt::format("{}", Device::cpu()) == "cpu");
  CHECK(fmt::format("{}", ReduceOp::kAvg) == "avg");
  CHECK(to_string(Dims{1, 2, 3}) == "[1,2,3]");
}

TEST_CASE("format tensors like PyTorch", "[kernels][format]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(fmt::format("{}", Tensor::arange({2, 2}, DType::kF32)) ==
        "tensor([[0., 1.],\n        [2., 3.]], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::arange({5}, DType::kI64)) ==
        "tensor([0, 1, 2, 3, 4], dtype=i64)");
  CHECK(fmt::format("{}", Tensor::from_vector({0.5, -1.25, 3}, {3})) ==
        "tensor([ 0.5000, -1.2500,  3.0000], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::from_vector({1e-5, 1}, {2})) ==
        "tensor([1.0000e-05, 1.0000e+00], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::from_vector({1, 1e9}, {2}, DType::kF64)) ==
        "tensor([1.0000e+00, 1.0000e+09], dtype=f64)");
  CHECK(fmt::format("{}", Tensor::from_vector({1, nan, inf, -inf}, {4})) ==
        "tensor([1., nan, inf, -inf], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::from_vector({-0.0, 1}, {2})) == "tensor([-0., 1.], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::full({}, 3, DType::kF32)) == "tensor(3., dtype=f32)");
  CHECK(fmt::format("{}", Tensor::full({}, -7, DType::kI32)) == "tensor(-7, dtype=i32)");
  CHECK(fmt::format("{}", Tensor::from_vector({0.1}, {1}, DType::kBF16)) ==
        "tensor([0.1001], dtype=bf16)");
  CHECK(fmt::format("{}", Tensor::arange({4}, DType::kF8E4M3)) ==
        "tensor([0., 1., 2., 3.], dtype=f8e4m3)");
  CHECK(fmt::format("{}", Tensor::zeros({2}, DType::kF16)) == "tensor([0., 0.], dtype=f16)");
  CHECK(fmt::format("{}", Tensor::arange({2, 2, 2}, DType::kI32)) ==
        "tensor([[[0, 1],\n"
        "         [2, 3]],\n"
        "\n"
        "        [[4, 5],\n"
        "         [6, 7]]], dtype=i32)");
  CHECK(fmt::format("{}", Tensor::arange({2, 3}, DType::kF32).transpose(0, 1)) ==
        "tensor([[0., 3.],\n        [1., 4.],\n        [2., 5.]], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::empty({0}, DType::kF32)) == "tensor([], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::empty({0, 3}, DType::kU8)) == "tensor([], size=[0,3], dtype=u8)");
  CHECK(fmt::format("{}", Tensor()) == "tensor(undefined)");
  Tensor freed = Tensor::zeros({2}, DType::kF32);
  freed.storage()->free();
  CHECK(fmt::format("{}", freed) == "tensor(<freed storage>, size=[2], dtype=f32)");
}

TEST_CASE("format wraps long rows and the suffix", "[kernels][format]") {
  CHECK(fmt::format("{}", Tensor::arange({30}, DType::kF32)) ==
        "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n"
        "        14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n"
        "        28., 29.], dtype=f32)");
  CHECK(fmt::format("{}", Tensor::arange({14}, DType::kF64)) ==
        "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.],\n"
        "       dtype=f64)");
}

TEST_CASE("format summarises more than 1000 elements", "[kernels][format]") {
  CHECK(fmt::format("{}", Tensor::arange({1000}, DType::kI32)).find("...") == std::string::npos);
  CHECK(fmt::format("{}", Tensor::arange({2000}, DType::kI32)) ==
        "tensor([   0,    1,    2,  ..., 1997, 1998, 1999], dtype=i32)");
  CHECK(fmt::format("{}", Tensor::arange({40, 40}, DType::kI64)) ==
        "tensor([[   0,    1,    2,  ...,   37,   38,   39],\n"
        "        [  40,   41,   42,  ...,   77,   78,   79],\n"
        "        [  80,   81,   82,  ...,  117,  118,  119],\n"
        "        ...,\n"
        "        [1480, 1481, 1482,  ..., 1517, 1518, 1519],\n"
        "        [1520, 1521, 1522,  ..., 1557, 1558, 1559],\n"
        "        [1560, 1561, 1562,  ..., 1597, 1598, 1599]], dtype=i64)");
  // Only the printed elements decide the style: the hidden 0.5 does not force decimals.
  Tensor t = Tensor::arange({2000}, DType::kF32);
  t.set_item({1000}, 0.5);
  CHECK(fmt::format("{}", t) ==
        "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n"
        "        1.9990e+03], dtype=f32)");
  // Small dims are kept whole.
  const std::string s = fmt::format("{}", Tensor::arange({2, 600}, DType::kI32));
  CHECK(s.rfind("tensor([[   0,    1,    2,  ...,  597,  598,  599],\n", 0) == 0);
  CHECK(s.find("[ 600,  601,  602,  ..., 1197, 1198, 1199]]") != std::string::npos);
}
