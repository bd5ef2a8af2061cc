// RaggedShard at the DTensor level (NOTE [ragged plans] in dtensor/plan/transition.h, NOTE
// [ragged ops] in dtensor/ops/rules.h): a redistribute's result carries the caller's placements;
// redistribute_async writes Rg -> R and P -> Rg into a caller's buffer with reduce_dtype,
// divide_factor and wire_dtype (FSDP's unshard and gradient reduce); redistribute_batch moves
// ragged tensors of several shapes; element-wise ops keep a RaggedShard, other ops refuse it
// naming it.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <mutex>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "dtensor/ops/ops.h"
#include "kernels/error.h"
#include "kernels/ops.h"
#include "support/checks.h"
#include "support/dtensor_data.h"

using namespace dtensor;
using collectives::Communicator;
using testing_support::check_local;
using testing_support::make_local;

namespace {

std::shared_ptr<const DeviceMesh> mesh_of(const Dims& shape) {
  return std::make_shared<const DeviceMesh>(DeviceMesh::from_shape(shape));
}

// The spec whose layouts name the tensor's global indices: a ragged list's flattened view.
DTensorSpec data_spec(const std::shared_ptr<const DeviceMesh>& mesh, const Placements& ps, const Dims& shape,
                      DType dtype) {
  return make_spec(mesh, ps, ragged_mesh_dim(ps) >= 0 ? ragged_view(shape, ps) : shape, dtype);
}

DTensor make_dtensor(const std::shared_ptr<const MeshComms>& comms, const std::shared_ptr<const DeviceMesh>& mesh,
                     const std::string& placements, const Dims& shape, DType dtype, int rank,
                     int64_t modulus = testing_support::kDefaultModulus, const std::string& built_as = "") {
  const Placements ps = parse_placements(placements);
  // built_as: the values' placements (P(avg) contributions for a P(sum) input divided later).
  const Placements values = built_as.empty() ? ps : parse_placements(built_as);
  return DTensor(comms, make_spec(mesh, ps, shape, dtype), make_local(data_spec(mesh, values, shape, dtype), rank, modulus));
}

}  // namespace

TEST_CASE("ragged DTensor: a redistribute's result carries the caller's placements", "[dtensor][ragged][redistribute]") {
  // Rg -> S(0) runs on the view as Rg -> Rg(torch.chunk rows); the result must say S(0). The
  // second source is S(0)'s own ranges as a RaggedShard: the view's placements do not change.
  const Dims shape{9, 4};
  auto mesh = mesh_of({4});
  testing_support::Checks checks;
  int64_t ran = 0;
  std::mutex mu;
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = MeshComms::create(*mesh, world);
    for (const std::string src : {"Rg(0,[1,2,0,1],4)", "Rg(0,[3,3,3,0],4)"}) {
      const DTensor x = make_dtensor(comms, mesh, src, shape, DType::kF32, world.rank());
      const Placements s0 = parse_placements("S(0)");
      const DTensor y = x.redistribute(s0);
      const DTensor z = redistribute_async(x, s0).wait();
      for (const DTensor* r : {&y, &z}) {
        checks.check(r->placements() == s0, fmt::format("[{}] -> [S(0)] says [{}]", src, to_string(r->placements())));
        const std::string e = check_local(make_spec(mesh, s0, shape, DType::kF32), world.rank(), r->to_local());
        checks.check(e.empty(), fmt::format("[{}] -> [S(0)] rank {}: {}", src, world.rank(), e));
      }
      // rand draws the same global tensor under a RaggedShard as under R.
      const DTensor drawn = dtensor::rand(shape, 7, DType::kF32, comms, x.placements());
      const DTensor whole = dtensor::rand(shape, 7, DType::kF32, comms, parse_placements("R"));
      checks.check(kernels::equal(drawn.full_tensor(), whole.to_local()), fmt::format("rand under [{}]", src));
      // And back: the result is the RaggedShard again.
      const DTensor back = y.redistribute(x.placements());
      checks.check(back.placements() == x.placements(), "S(0) -> Rg placements");
      const std::string e = check_local(data_spec(mesh, x.placements(), shape, DType::kF32), world.rank(), back.to_local());
      checks.check(e.empty(), fmt::format("S(0) -> [{}] rank {}: {}", src, world.rank(), e));
      std::lock_guard lk(mu);
      if (world.rank() == 0) ++ran;
    }
  });
  checks.report();
  CHECK(ran == 2);
}

TEST_CASE("ragged redistribute_async into a caller's buffer: Rg -> R and P -> Rg with reduce options",
          "[dtensor][ragged][redistribute]") {
  // FSDP's contiguous layout: the unshard all-gathers into the unsharded buffer, the gradient
  // reduce writes each rank's range into its sharded gradient buffer, in the reduce dtype,
  // divided by the data-parallel size, optionally through a narrower wire.
  struct Case {
    Dims mesh, shape;
    std::string src, dst, built_as;  // built_as: the input's values (P(avg) for a divide by the group)
    DType dtype;
    RedistributeOptions options;
    DType out_dtype;
  };
  RedistributeOptions reduce_f32;
  reduce_f32.reduce_dtype = DType::kF32;
  RedistributeOptions divide4;
  divide4.divide_factor = 4;
  RedistributeOptions wire;
  wire.wire_dtype = DType::kBF16;
  RedistributeOptions all;  // bf16 parameters: reduce in f32, divide by 4, bf16 on the wire
  all.reduce_dtype = DType::kF32;
  all.divide_factor = 4;
  all.wire_dtype = DType::kBF16;
  const std::vector<Case> cases = {
      {{4}, {9, 4}, "Rg(0,[1,2,0,1],4)", "R", "", DType::kF32, {}, DType::kF32},
      {{4}, {9, 4}, "Rg(0,[1,2,0,1],4)", "R", "", DType::kBF16, {}, DType::kBF16},
      {{2, 2}, {7, 3}, "R,Rg(0,[0,3],1)", "R,R", "", DType::kF32, {}, DType::kF32},
      {{4}, {9, 4}, "P", "Rg(0,[1,2,0,1],2)", "", DType::kBF16, reduce_f32, DType::kF32},
      {{4}, {9, 4}, "P", "Rg(0,[1,2,0,1],2)", "P(avg)", DType::kF32, divide4, DType::kF32},
      {{4}, {9, 4}, "P", "Rg(0,[1,2,0,1],2)", "", DType::kF32, wire, DType::kF32},
      {{4}, {9, 4}, "P", "Rg(0,[3,0,1,1],1)", "P(avg)", DType::kBF16, all, DType::kF32},
      // HSDP: reduce-scatter over dp_shard + all-reduce over dp_replicate, divided by all 4.
      {{2, 2}, {9, 4}, "P,P", "R,Rg(0,[1,2],2)", "P(avg),P(avg)", DType::kF32, divide4, DType::kF32},
      {{2, 2}, {9, 4}, "P,P", "R,Rg(0,[2,1],1)", "P(avg),P(avg)", DType::kBF16, all, DType::kF32},
  };
  testing_support::Checks checks;
  int64_t ran = 0;
  std::mutex mu;
  for (const Case& c : cases) {
    auto mesh = mesh_of(c.mesh);
    // Values exact in the narrowest dtype a piece travels or lives in.
    const int64_t modulus = testing_support::exact_modulus(DType::kBF16, mesh->size());
    collectives::run_ranks(static_cast<int>(mesh->size()), [&](Communicator& world) {
      const std::string what = fmt::format("[{}] -> [{}] {} rank {}", c.src, c.dst, kernels::to_string(c.dtype),
                                           world.rank());
      try {
        auto comms = MeshComms::create(*mesh, world);
        const DTensor x = make_dtensor(comms, mesh, c.src, c.shape, c.dtype, world.rank(), modulus, c.built_as);
        const Placements dst = parse_placements(c.dst);
        const DTensorSpec want = make_spec(mesh, dst, c.shape, c.out_dtype);
        Tensor out = Tensor::zeros(want.layout(world.rank())->local_shape, c.out_dtype);
        RedistributeHandle h = redistribute_async(x, dst, c.options, out);
        const DTensor y = h.wait();
        checks.check(y.placements() == dst, what + ": placements " + to_string(y.placements()));
        checks.check(y.dtype() == c.out_dtype, what + ": dtype");
        checks.check(out.numel() == 0 || y.to_local().shares_storage_with(out), what + ": not in the caller's buffer");
        const std::string e = check_local(data_spec(mesh, dst, c.shape, c.out_dtype), world.rank(), out, modulus);
        checks.check(e.empty(), what + ": " + e);
      } catch (const std::exception& e) {
        checks.add(what + ": " + e.what());
      }
      std::lock_guard lk(mu);
      if (world.rank() == 0) ++ran;
    });
  }
  checks.report();
  CHECK(ran == static_cast<int64_t>(cases.size()));
}

TEST_CASE("ragged redistribute_batch: tensors of several shapes, with and without outs",
          "[dtensor][ragged][redistribute]") {
  // nn::reduce_gradients batches P gradients onto their parameters' placements: with FSDP's flat
  // shards, Rg of several shapes.
  auto mesh = mesh_of({4});
  const std::vector<Dims> shapes = {{9, 4}, {9, 4}, {5}, {0, 3}};
  const Placements rg = parse_placements("Rg(0,[1,2,0,1],1)"), p = parse_placements("P"), r = parse_placements("R");
  testing_support::Checks checks;
  int64_t ran = 0;
  std::mutex mu;
  collectives::run_ranks(4, [&](Communicator& world) {
    try {
      auto comms = MeshComms::create(*mesh, world);
      std::vector<DTensor> grads, shards;
      std::vector<Tensor> outs;
      for (const Dims& s : shapes) {
        grads.push_back(make_dtensor(comms, mesh, "P", s, DType::kF32, world.rank()));
        shards.push_back(make_dtensor(comms, mesh, "Rg(0,[1,2,0,1],1)", s, DType::kF32, world.rank()));
        outs.push_back(Tensor::zeros(s, DType::kF32));
      }
      const std::vector<DTensor> reduced = redistribute_batch(grads, rg);
      const std::vector<DTensor> gathered = redistribute_batch(shards, r, {}, outs);
      for (size_t i = 0; i < shapes.size(); ++i) {
        const std::string what = fmt::format("tensor {} rank {}", i, world.rank());
        checks.check(reduced[i].placements() == rg && gathered[i].placements() == r, what + ": placements");
        std::string e = check_local(data_spec(mesh, rg, shapes[i], DType::kF32), world.rank(), reduced[i].to_local());
        checks.check(e.empty(), what + " P -> Rg: " + e);
        e = check_local(make_spec(mesh, r, shapes[i], DType::kF32), world.rank(), outs[i]);
        checks.check(e.empty(), what + " Rg -> R into outs: " + e);
      }
    } catch (const std::exception& e) {
      checks.add(fmt::format("rank {}: {}", world.rank(), e.what()));
    }
    std::lock_guard lk(mu);
    if (world.rank() == 0) ++ran;
  });
  checks.report();
  CHECK(ran == 1);
  (void)p;
}

TEST_CASE("ragged ops: element-wise ops keep a RaggedShard; others refuse it naming it", "[dtensor][ragged][ops]") {
  using namespace dtensor::ops;
  const Dims shape{9, 4};
  auto mesh = mesh_of({2, 2});
  const std::string rg_text = "R,Rg(0,[3,1],1)";
  testing_support::Checks checks;
  int64_t ran = 0, refused = 0;
  std::mutex mu;
  auto full_values = [&](int salt) {
    std::vector<double> v(static_cast<size_t>(shape.product()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((static_cast<int64_t>(i) * 37 + salt * 11) % 23) / 11.5 - 1.0;
    return Tensor::from_vector(v, shape, DType::kF64);
  };
  const Tensor fx = full_values(1), fy = full_values(2), fdy = full_values(3);
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = MeshComms::create(*mesh, world);
    const Placements rg = parse_placements(rg_text);
    const DTensor x = distribute_tensor(fx, comms, rg, std::nullopt);
    const DTensor y = distribute_tensor(fy, comms, rg, std::nullopt);
    const DTensor dy = distribute_tensor(fdy, comms, rg, std::nullopt);
    const DTensor yr = distribute_tensor(fy, comms, parse_placements("R,R"), std::nullopt);
    auto same = [&](const std::string& what, const DTensor& got, const Tensor& want) {
      checks.check(got.placements() == rg, what + ": placements [" + to_string(got.placements()) + "]");
      checks.check(kernels::allclose(got.full_tensor(), want, 1e-12, 1e-12), what + ": values");
    };
    int64_t mine = 0;
    try {
      Saved s;
      OpOptions forbid;
      forbid.forbid_implicit = true;
      same("gelu", gelu(x, GeluApproximation::kTanh, forbid, &s), kernels::gelu(fx, GeluApproximation::kTanh));
      Tensor dgelu = Tensor::empty(shape, DType::kF64);
      kernels::gelu_backward_out(dgelu, fdy, fx, GeluApproximation::kTanh);
      same("gelu backward", unary_backward(s, dy, forbid), dgelu);
      same("silu", silu(x, forbid, &s), kernels::silu(fx));
      same("silu backward", unary_backward(s, dy, forbid), kernels::silu_backward(fdy, fx));
      same("scale", scale(x, -3.0, forbid, &s), kernels::scale(fx, -3.0));
      same("add", add(x, y, 0.5, forbid, &s), kernels::add(fx, fy, 0.5));
      GradSink sinks[] = {GradSink{}, GradSink{}};
      Grads g = add_backward(s, dy, sinks, forbid);
      same("add backward a", *g[0], fdy);
      same("add backward b", *g[1], kernels::scale(fdy, 0.5));
      same("mul", mul(x, y, forbid, &s), kernels::mul(fx, fy));
      g = mul_backward(s, dy, sinks, forbid);
      same("mul backward a", *g[0], kernels::mul(fdy, fy));
      same("mul backward b", *g[1], kernels::mul(fdy, fx));
      // A replicated operand is cut to the ragged ranges (a local chunk).
      same("add with R", add(x, yr), kernels::add(fx, fy));
      mine = 1;
    } catch (const std::exception& e) {
      checks.add(fmt::format("rank {}: {}", world.rank(), e.what()));
    }
    // Everything else refuses, naming the op and the RaggedShard.
    const DTensor w = distribute_tensor(full_values(4).reshape({4, 9}), comms, parse_placements("R,R"), std::nullopt);
    const DTensor bias = distribute_tensor(Tensor::full({4}, 1.0, DType::kF64), comms, parse_placements("R,R"), std::nullopt);
    const std::vector<std::pair<std::string, std::function<void()>>> refusals = {
        {"sum", [&] { (void)sum(x, {0}); }},
        {"softmax", [&] { (void)softmax(x); }},
        {"einsum", [&] { (void)einsum("mk,kn->mn", x, w); }},
        {"transpose", [&] { (void)transpose(x, 0, 1); }},
        {"view", [&] { (void)view(x, {36}); }},
        {"add", [&] { (void)add(x, bias); }},  // a broadcast: the pieces would not line up
        {"rms_norm", [&] { (void)rms_norm(x, nullptr, 1e-6); }},
    };
    int64_t n = 0;
    for (const auto& [op, f] : refusals) {
      checks.throws<kernels::Unsupported>(f, "takes the RaggedShard Rg(0,[3,1],1)", op + " on " + rg_text);
      ++n;
    }
    std::lock_guard lk(mu);
    if (world.rank() == 0) {
      ran += mine;
      refused += n;
    }
  });
  checks.report();
  CHECK(ran == 1);
  CHECK(refused == 7);
}

TEST_CASE("ragged redistributes keep their recipe in the plan cache and reuse it", "[dtensor][ragged][redistribute]") {
  // NOTE [ragged plans]: the recipe is of the view; the second and third calls find it (the same
  // object) and still move every rank's data, into a caller's buffer too.
  struct Case {
    Dims mesh, shape;
    std::string src, dst;
  };
  const std::vector<Case> cases = {
      {{4}, {9, 4}, "S(0)", "Rg(0,[1,2,0,1],1)"},
      {{4}, {9, 4}, "Rg(0,[1,2,0,1],4)", "S(0)"},
      {{2, 2}, {9, 4}, "P,P", "R,Rg(0,[1,2],2)"},
      {{2, 2}, {7, 3}, "R,Rg(0,[0,3],1)", "R,R"},
  };
  testing_support::Checks checks;
  int64_t ran = 0;
  std::mutex mu;
  for (const Case& c : cases) {
    auto mesh = mesh_of(c.mesh);
    collectives::run_ranks(static_cast<int>(mesh->size()), [&](Communicator& world) {
      const std::string what = fmt::format("[{}] -> [{}] rank {}", c.src, c.dst, world.rank());
      try {
        auto comms = MeshComms::create(*mesh, world);
        const DTensor x = make_dtensor(comms, mesh, c.src, c.shape, DType::kF32, world.rank());
        const Placements dst = parse_placements(c.dst);
        const Transition t = make_transition(x.spec(), dst);
        const DTensorSpec want = data_spec(mesh, dst, c.shape, DType::kF32);
        std::shared_ptr<const Recipe> first;
        for (int call = 0; call < 3; ++call) {
          Tensor out;
          if (call == 2) out = Tensor::zeros(make_spec(mesh, dst, c.shape, DType::kF32).layout(world.rank())->local_shape, DType::kF32);
          const DTensor y = call < 2 ? x.redistribute(dst) : x.redistribute(dst, out);
          const std::shared_ptr<const Recipe> recipe = comms->plans().find(t).recipe;
          checks.check(recipe != nullptr, what + ": no recipe cached");
          if (call == 0) first = recipe;
          checks.check(recipe == first, fmt::format("{}: call {} made a new recipe", what, call));
          checks.check(y.placements() == dst, what + ": placements");
          const std::string e = check_local(want, world.rank(), call < 2 ? y.to_local() : out);
          checks.check(e.empty(), fmt::format("{} call {}: {}", what, call, e));
        }
      } catch (const std::exception& e) {
        checks.add(what + ": " + e.what());
      }
      std::lock_guard lk(mu);
      if (world.rank() == 0) ++ran;
    });
  }
  checks.report();
  CHECK(ran == static_cast<int64_t>(cases.size()));
}
