// Tensor factories, metadata and views: shapes, strides, offsets, shared storage, write-through,
// and the messages of invalid arguments.
#include <catch2/catch.hpp>
#include <vector>

#include "kernels/tensor.h"

using namespace kernels;
using Catch::Contains;

namespace {

std::vector<double> iota(int64_t n, double start = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + static_cast<double>(i);
  return v;
}

}  // namespace

TEST_CASE("factories produce contiguous tensors", "[kernels][tensor]") {
  Tensor t = Tensor::empty({4, 6}, DType::kF32);
  CHECK(t.defined());
  CHECK(t.shape() == Dims{4, 6});
  CHECK(t.strides() == Dims{6, 1});
  CHECK(t.storage_offset() == 0);
  CHECK(t.numel() == 24);
  CHECK(t.nbytes() == 96);
  CHECK(t.ndim() == 2);
  CHECK(t.is_contiguous());
  CHECK(t.device() == Device::cpu());
  CHECK(t.size(-1) == 6);
  CHECK(t.stride(0) == 6);
  CHECK(t.storage()->nbytes() == 96);

  CHECK(Tensor::zeros({2, 3}, DType::kI32).to_vector() == std::vector<double>(6, 0.0));
  CHECK(Tensor::full({3}, 2.5, DType::kBF16).to_vector() == std::vector<double>(3, 2.5));
  CHECK(Tensor::arange({2, 3}, DType::kU8).to_vector() == iota(6));
  CHECK(Tensor::arange({5}, DType::kI64).to_vector() == iota(5));
  CHECK(Tensor::from_vector({1, 2, 3, 4}, {2, 2}, DType::kF64).item({1, 0}) == 3.0);
  CHECK(Tensor::from_vector({1.5, -2}, {2}).dtype() == DType::kF32);

  Tensor scalar = Tensor::full({}, 7, DType::kI64);
  CHECK(scalar.ndim() == 0);
  CHECK(scalar.numel() == 1);
  CHECK(scalar.item({}) == 7.0);

  Tensor none = Tensor::empty({0, 3}, DType::kF32);
  CHECK(none.numel() == 0);
  CHECK(none.strides() == Dims{3, 1});
  CHECK(none.is_contiguous());
  CHECK(none.to_vector().empty());

  CHECK(Tensor::contiguous_strides({2, 3, 4}) == Dims{12, 4, 1});
  CHECK(Tensor::contiguous_strides({2, 0, 4}) == Dims{4, 4, 1});
  CHECK(Tensor::contiguous_strides({}) == Dims{});

  Tensor undefined;
  CHECK_FALSE(undefined.defined());
  REQUIRE_THROWS_WITH(undefined.clone(), "clone: tensor is undefined");
}

TEST_CASE("factories reject bad arguments", "[kernels][tensor]") {
  REQUIRE_THROWS_AS(Tensor::empty({2, -1}, DType::kF32), InvalidArgument);
  REQUIRE_THROWS_WITH(Tensor::empty({2, -1}, DType::kF32),
                      "empty: negative size -1 in shape [2,-1]");
  REQUIRE_THROWS_WITH(Tensor::from_vector({1, 2, 3}, {2, 2}),
                      "from_vector: 3 values for shape [2,2] (4 elements)");
  REQUIRE_THROWS_WITH(Tensor::empty(Dims(std::vector<int64_t>(9, 1)), DType::kF32),
                      Contains("at most 8"));
  REQUIRE_THROWS_AS(Tensor::empty(Dims(std::vector<int64_t>(9, 1)), DType::kF32), InvalidArgument);
  auto storage = Storage::allocate(40, Device::cpu());
  REQUIRE_THROWS_WITH(Tensor::from_storage(storage, DType::kF32, {3, 4}, {4, 1}),
                      Contains("needs 48 bytes but the storage has 40"));
  REQUIRE_THROWS_WITH(Tensor::from_storage(storage, DType::kF32, {2}, {1}, -1),
                      Contains("negative storage offset -1"));
  REQUIRE_THROWS_WITH(Tensor::from_storage(storage, DType::kF32, {2}, {-1}),
                      Contains("negative stride -1"));
  REQUIRE_THROWS_WITH(Tensor::from_storage(storage, DType::kF32, {2, 2}, {1}),
                      Contains("shape [2,2] has 2 dims but strides [1] has 1"));
  REQUIRE_THROWS_WITH(Tensor::from_storage(nullptr, DType::kF32, {2}, {1}), Contains("null"));
  Tensor ok = Tensor::from_storage(storage, DType::kF32, {3, 3}, {3, 1}, 1);
  CHECK(ok.storage_offset() == 1);
  CHECK(ok.shares_storage_with(Tensor::from_storage(storage, DType::kU8, {40}, {1})));
  Tensor t = Tensor::arange({2, 3}, DType::kF32);
  REQUIRE_THROWS_WITH(t.data<double>(), "data<T>: tensor has dtype f32, requested f64");
  CHECK(t.data<float>()[4] == 4.0f);
  REQUIRE_THROWS_WITH(t.size(2), "size: dim 2 out of range for a 2-d tensor (expected -2..1)");
  REQUIRE_THROWS_WITH(t.stride(-3),
                      "stride: dim -3 out of range for a 2-d tensor (expected -2..1)");
}

TEST_CASE("narrow and select", "[kernels][tensor][view]") {
  Tensor t = Tensor::arange({4, 6}, DType::kF32);
  Tensor n = t.narrow(1, 2, 3);
  CHECK(n.shape() == Dims{4, 3});
  CHECK(n.strides() == Dims{6, 1});
  CHECK(n.storage_offset() == 2);
  CHECK(n.shares_storage_with(t));
  CHECK_FALSE(n.is_contiguous());
  CHECK(n.to_vector() == std::vector<double>{2, 3, 4, 8, 9, 10, 14, 15, 16, 20, 21, 22});
  CHECK(t.narrow(0, -2, 2).storage_offset() == 12);
  CHECK(t.narrow(-1, 6, 0).numel() == 0);
  CHECK(t.narrow(0, 1, 2).is_contiguous());

  Tensor s = t.select(0, 2);
  CHECK(s.shape() == Dims{6});
  CHECK(s.storage_offset() == 12);
  Tensor c = t.select(-1, -1);
  CHECK(c.shape() == Dims{4});
  CHECK(c.strides() == Dims{6});
  CHECK(c.storage_offset() == 5);
  CHECK(c.to_vector() == std::vector<double>{5, 11, 17, 23});
  Tensor e = t.select(0, 1).select(0, 3);
  CHECK(e.ndim() == 0);
  CHECK(e.item({}) == 9.0);

  // Writes through.
  n.fill_(-1);
  CHECK(t.item({3, 4}) == -1.0);
  CHECK(t.item({3, 5}) == 23.0);
  c.set_item({0}, 42);
  CHECK(t.item({0, 5}) == 42.0);

  REQUIRE_THROWS_AS(t.narrow(2, 0, 1), InvalidArgument);
  REQUIRE_THROWS_WITH(t.narrow(2, 0, 1),
                      "narrow: dim 2 out of range for a 2-d tensor (expected -2..1)");
  REQUIRE_THROWS_WITH(t.narrow(-3, 0, 1), Contains("dim -3 out of range"));
  REQUIRE_THROWS_WITH(Tensor::arange({5}, DType::kF32).narrow(0, 3, 4),
                      "narrow: start 3 + length 4 exceeds size 5 of dim 0");
  REQUIRE_THROWS_WITH(t.narrow(0, 5, 0), Contains("start 5 out of range for dim 0 of size 4"));
  REQUIRE_THROWS_WITH(t.narrow(0, 0, -1), Contains("negative length -1"));
  REQUIRE_THROWS_WITH(t.select(1, 6),
                      "select: index 6 out of range for dim 1 of size 6 (expected -6..5)");
  REQUIRE_THROWS_WITH(t.select(0, -5), Contains("index -5 out of range"));
  REQUIRE_THROWS_WITH(e.select(0, 0),
                      "select: dim 0 out of range for a 0-d tensor (it has no dims)");
}

TEST_CASE("view of contiguous tensors, with -1", "[kernels][tensor][view]") {
  Tensor t = Tensor::arange({2, 3, 4}, DType::kI32);
  Tensor v = t.view({6, 4});
  CHECK(v.shape() == Dims{6, 4});
  CHECK(v.strides() == Dims{4, 1});
  CHECK(v.shares_storage_with(t));
  CHECK(t.view({-1}).shape() == Dims{24});
  CHECK(t.view({4, -1}).shape() == Dims{4, 6});
  CHECK(t.view({2, 1, 3, 1, 4}).strides() == Dims{12, 12, 4, 4, 1});
  CHECK(Tensor::full({}, 1, DType::kF32).view({1, 1}).shape() == Dims{1, 1});
  CHECK(Tensor::arange({1}, DType::kF32).view({}).ndim() == 0);
  CHECK(Tensor::empty({0, 4}, DType::kF32).view({2, 0, 4}).strides() == Dims{4, 4, 1});
  v.set_item({5, 3}, -7);
  CHECK(t.item({1, 2, 3}) == -7.0);

  REQUIRE_THROWS_AS(t.view({3, 5}), InvalidArgument);
  REQUIRE_THROWS_WITH(Tensor::arange({3, 4}, DType::kF32).view({3, 5}),
                      "view: shape [3,5] has 15 elements, tensor has 12");
  REQUIRE_THROWS_WITH(t.view({-1, -1}), Contains("shape [-1,-1] has more than one -1"));
  REQUIRE_THROWS_WITH(t.view({5, -1}), "view: shape [5,-1] is invalid for a tensor of 24 elements");
  REQUIRE_THROWS_WITH(t.view({-2, 12}), Contains("invalid size -2 in shape [-2,12]"));
  REQUIRE_THROWS_WITH(Tensor::empty({0, 4}, DType::kF32).view({0, -1}),
                      Contains("shape [0,-1] is invalid for a tensor of 0 elements"));
}

TEST_CASE("view of non-contiguous tensors follows PyTorch's rule", "[kernels][tensor][view]") {
  Tensor t = Tensor::arange({4, 6}, DType::kF32);

  // A transpose cannot be flattened without a copy...
  Tensor tt = t.transpose(0, 1);  // [6,4] strides [1,6]
  REQUIRE_THROWS_AS(tt.view({24}), InvalidArgument);
  REQUIRE_THROWS_WITH(tt.view({24}),
                      "view: size [24] is not compatible with the tensor's size [6,4] and strides "
                      "[1,6]; use reshape");
  // ...but its dims can be split, and size-1 dims inserted anywhere.
  Tensor split = tt.view({2, 3, 4});
  CHECK(split.strides() == Dims{3, 1, 6});
  CHECK(split.shares_storage_with(t));
  CHECK(split.item({1, 2, 3}) == t.item({3, 5}));
  CHECK(tt.view({6, 1, 4}).strides() == Dims{1, 24, 6});

  // Narrowing the inner dim breaks merging the two dims, narrowing the outer one does not.
  Tensor inner = t.narrow(1, 0, 3);  // [4,3] strides [6,1]
  REQUIRE_THROWS_WITH(inner.view({12}), Contains("not compatible"));
  CHECK(inner.view({4, 3, 1}).strides() == Dims{6, 1, 1});
  Tensor outer = t.narrow(0, 1, 2);  // [2,6] offset 6: still one contiguous chunk
  Tensor flat = outer.view({12});
  CHECK(flat.strides() == Dims{1});
  CHECK(flat.storage_offset() == 6);
  CHECK(flat.to_vector() == iota(12, 6));

  // Every other row of a [4,6] tensor: rows stay contiguous, so [2,6] -> [2,2,3] works.
  Tensor rows = t.as_strided({2, 6}, {12, 1}, 0);
  CHECK(rows.view({2, 2, 3}).strides() == Dims{12, 3, 1});
  CHECK(rows.view({2, 3, 2}).strides() == Dims{12, 2, 1});
  CHECK(rows.view({2, 3, 2}).item({1, 2, 1}) == 17.0);
  REQUIRE_THROWS_WITH(rows.view({4, 3}), Contains("use reshape"));
  REQUIRE_THROWS_WITH(rows.view({12}), Contains("use reshape"));

  // A broadcast (stride 0) dim can be split but not merged with a real one.
  Tensor bcast = Tensor::arange({3}, DType::kF32).as_strided({4, 3}, {0, 1}, 0);
  CHECK(bcast.view({2, 2, 3}).strides() == Dims{0, 0, 1});
  REQUIRE_THROWS_WITH(bcast.view({12}), Contains("not compatible"));
}

TEST_CASE("reshape copies only when it must", "[kernels][tensor][view]") {
  Tensor t = Tensor::arange({4, 6}, DType::kF32);
  Tensor r = t.reshape({3, -1});
  CHECK(r.shape() == Dims{3, 8});
  CHECK(r.shares_storage_with(t));

  Tensor tt = t.transpose(0, 1);
  Tensor copied = tt.reshape({24});
  CHECK_FALSE(copied.shares_storage_with(t));
  CHECK(copied.is_contiguous());
  std::vector<double> expected;
  for (int j = 0; j < 6; ++j)
    for (int i = 0; i < 4; ++i) expected.push_back(i * 6 + j);
  CHECK(copied.to_vector() == expected);
  CHECK(tt.reshape({2, 3, 4}).shares_storage_with(t));
  REQUIRE_THROWS_WITH(t.reshape({5, 5}), "reshape: shape [5,5] has 25 elements, tensor has 24");
}

TEST_CASE("permute and transpose", "[kernels][tensor][view]") {
  Tensor t = Tensor::arange({2, 3, 4}, DType::kF64);
  Tensor p = t.permute({2, 0, 1});
  CHECK(p.shape() == Dims{4, 2, 3});
  CHECK(p.strides() == Dims{1, 12, 4});
  CHECK(p.shares_storage_with(t));
  CHECK(p.item({3, 1, 2}) == t.item({1, 2, 3}));
  CHECK(t.permute({-1, 0, 1}).shape() == Dims{4, 2, 3});
  CHECK(t.permute({0, 1, 2}).is_contiguous());
  CHECK(Tensor::full({}, 1, DType::kF32).permute({}).ndim() == 0);

  Tensor tr = t.transpose(0, -1);
  CHECK(tr.shape() == Dims{4, 3, 2});
  CHECK(tr.strides() == Dims{1, 4, 12});
  tr.set_item({3, 2, 1}, -1);
  CHECK(t.item({1, 2, 3}) == -1.0);

  Tensor m = Tensor::arange({2, 2}, DType::kF32);
  REQUIRE_THROWS_AS(m.permute({0, 0}), InvalidArgument);
  REQUIRE_THROWS_WITH(m.permute({0, 0}), "permute: order [0,0] is not a permutation of 0..1");
  REQUIRE_THROWS_WITH(m.permute({0, 2}), "permute: order [0,2] is not a permutation of 0..1");
  REQUIRE_THROWS_WITH(m.permute({0}), "permute: order [0] has 1 entries, tensor has 2 dims");
  REQUIRE_THROWS_WITH(m.transpose(0, 2),
                      "transpose: dim 2 out of range for a 2-d tensor (expected -2..1)");
}

TEST_CASE("flatten and unsqueeze", "[kernels][tensor][view]") {
  Tensor t = Tensor::arange({2, 3, 4}, DType::kF32);
  CHECK(t.flatten().shape() == Dims{24});
  CHECK(t.flatten().shares_storage_with(t));
  CHECK(t.flatten(1).shape() == Dims{2, 12});
  CHECK(t.flatten(0, 1).shape() == Dims{6, 4});
  CHECK(t.flatten(-2, -1).strides() == Dims{12, 1});
  CHECK(t.flatten(1, 1).shape() == Dims{2, 3, 4});
  CHECK(Tensor::full({}, 3, DType::kF32).flatten().shape() == Dims{1});
  Tensor tf = t.transpose(0, 2).flatten();  // needs a copy
  CHECK_FALSE(tf.shares_storage_with(t));
  CHECK(tf.item({1}) == 12.0);
  REQUIRE_THROWS_WITH(t.flatten(2, 1), Contains("start_dim 2 comes after end_dim 1"));
  REQUIRE_THROWS_WITH(t.flatten(0, 3),
                      "flatten: dim 3 out of range for a 3-d tensor (expected -3..2)");

  Tensor u = t.unsqueeze(0);
  CHECK(u.shape() == Dims{1, 2, 3, 4});
  CHECK(u.strides() == Dims{24, 12, 4, 1});
  CHECK(t.unsqueeze(3).strides() == Dims{12, 4, 1, 1});
  CHECK(t.unsqueeze(-1).shape() == Dims{2, 3, 4, 1});
  CHECK(t.unsqueeze(1).strides() == Dims{12, 12, 4, 1});
  CHECK(t.narrow(2, 1, 2).unsqueeze(2).strides() == Dims{12, 4, 2, 1});
  CHECK(Tensor::full({}, 1, DType::kF32).unsqueeze(0).shape() == Dims{1});
  CHECK(u.shares_storage_with(t));
  REQUIRE_THROWS_WITH(t.unsqueeze(4),
                      "unsqueeze: dim 4 out of range for a 3-d tensor (expected -4..3)");
  Tensor eight = Tensor::empty(Dims::filled(8, 1), DType::kF32);
  REQUIRE_THROWS_AS(eight.unsqueeze(0), InvalidArgument);
  REQUIRE_THROWS_WITH(eight.unsqueeze(0), Contains("at most 8"));
}

TEST_CASE("as_strided", "[kernels][tensor][view]") {
  Tensor t = Tensor::arange({12}, DType::kF32);
  Tensor w = t.narrow(0, 2, 4).as_strided({3, 3}, {3, 1}, 1);  // offset is absolute
  CHECK(w.storage_offset() == 1);
  CHECK(w.to_vector() == iota(9, 1));
  Tensor sliding = t.as_strided({5, 4}, {2, 1}, 0);  // overlapping windows
  CHECK(sliding.item({4, 3}) == 11.0);
  CHECK(sliding.shares_storage_with(t));
  sliding.set_item({1, 0}, -2);
  CHECK(t.item({2}) == -2.0);
  CHECK(sliding.item({0, 2}) == -2.0);
  REQUIRE_THROWS_WITH(t.as_strided({5, 4}, {3, 1}, 0),
                      Contains("as_strided: shape [5,4] with strides [3,1] and offset 0 (f32) "
                               "needs 64 bytes but the storage has 48"));
  REQUIRE_THROWS_WITH(t.as_strided({2}, {1}, 11), Contains("needs 52 bytes"));
  REQUIRE_THROWS_WITH(t.as_strided({2}, {1, 1}, 0), Contains("has 1 dims but strides [1,1] has 2"));
  REQUIRE_THROWS_WITH(t.as_strided({-2}, {1}, 0), Contains("negative size -2"));
  CHECK(t.as_strided({0}, {1}, 12).numel() == 0);
}

TEST_CASE("element access checks its index", "[kernels][tensor]") {
  Tensor t = Tensor::arange({2, 3}, DType::kI64);
  CHECK(t.item({-1, -1}) == 5.0);
  const std::vector<int64_t> idx{1, 2};
  CHECK(t.item(std::span<const int64_t>(idx)) == 5.0);
  REQUIRE_THROWS_WITH(t.item({0}), "item: index has 1 entries, tensor has 2 dims (shape [2,3])");
  REQUIRE_THROWS_WITH(t.item({0, 3}),
                      "item: index 3 out of range for dim 1 of size 3 (expected -3..2)");
  REQUIRE_THROWS_WITH(t.set_item({2, 0}, 1), Contains("set_item: index 2 out of range for dim 0"));
}
