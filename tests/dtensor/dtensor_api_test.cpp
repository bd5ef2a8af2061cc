// The DTensor API (docs/pytorch-semantics.md 5) on the local backend: distribute_tensor over
// meshes (4), (2,2), (3,2), (2,2,2) with every placement kind and src_data_rank 0/1/nullopt,
// from_local (inference, explicit uneven shape, run_check), redistribute round trips with both
// planners, batched redistribute, factories, ownership text, to_string and the error cases.
//
// Catch2 assertions are not thread-safe, so rank threads record failures in a Checks object and
// the test thread reports them.
#include <catch2/catch.hpp>

#include "support/placement_lists.h"
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <mutex>
#include <set>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/error.h"
#include "support/checks.h"
#include "support/dtensor_data.h"

using namespace dtensor;
using collectives::Communicator;
using kernels::DType;
using testing_support::check_local;
using testing_support::Checks;
using testing_support::make_local;

namespace {

constexpr collectives::Milliseconds kTimeout{20'000};


using CommsPtr = std::shared_ptr<const MeshComms>;
using Body = std::function<void(Communicator& world, const CommsPtr& comms)>;

Placements P(const char* text) { return parse_placements(text); }
std::shared_ptr<const DeviceMesh> mesh_of(const CommsPtr& comms) {
  return std::make_shared<const DeviceMesh>(comms->mesh());
}

// Runs body on every rank of a world of `world_size` ranks (default: the mesh size) with its
// communicators on `mesh`.
void on_mesh(const DeviceMesh& mesh, const Body& body, int world_size = 0) {
  collectives::run_ranks(world_size ? world_size : static_cast<int>(mesh.size()), [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(mesh, world);
    body(world, comms);
  }, kTimeout);
}

Tensor global_tensor(const Dims& shape, DType dtype = DType::kF32) {
  Tensor t = Tensor::empty(shape, dtype);
  t.fill_index_([&](std::span<const int64_t> index) { return testing_support::global_value(shape, index); });
  return t;
}


// Mixed Partial ops are rejected by make_spec, except sum with avg.
bool valid_partials(const Placements& ps) {
  std::optional<ReduceOp> op;
  for (const Placement& p : ps)
    if (const auto* q = std::get_if<Partial>(&p)) {
      auto linear = [](ReduceOp o) { return o == ReduceOp::kSum || o == ReduceOp::kAvg; };
      if (op && *op != q->op && !(linear(*op) && linear(q->op))) return false;
      op = q->op;
    }
  return true;
}

bool has_partial(const Placements& ps) { return std::any_of(ps.begin(), ps.end(), is_partial); }

// A P(sum) partition over a group whose size is not a power of two rounds (x / 3).
bool exact_partition(const Placements& ps, const Dims& mesh_shape) {
  for (size_t m = 0; m < ps.size(); ++m)
    if (const auto* q = std::get_if<Partial>(&ps[m]); q && q->op == ReduceOp::kSum) {
      const int64_t k = mesh_shape[m];
      if ((k & (k - 1)) != 0) return false;
    }
  return true;
}

std::string src_text(std::optional<int> src) { return src ? std::to_string(*src) : "nullopt"; }

int64_t distribute_cases(const Dims& mesh_shape, const std::vector<Dims>& shapes,
                         const std::vector<Placement>& options, Checks& checks) {
  const DeviceMesh mesh = DeviceMesh::from_shape(mesh_shape);
  const std::vector<std::optional<int>> srcs = {0, 1, std::nullopt};
  int64_t cases = 0;
  on_mesh(mesh, [&](Communicator& world, const CommsPtr& comms) {
    const int rank = world.rank();
    for (const Dims& shape : shapes) {
      const Tensor truth = global_tensor(shape);
      const Tensor garbage = Tensor::full(shape, -100.0 - rank, DType::kF32);
      for (const Placements& ps : testing_support::placement_lists(mesh.ndim(), options)) {
        if (!valid_partials(ps)) continue;
        for (std::optional<int> src : srcs) {
          const std::string what = fmt::format("mesh {} shape [{}] [{}] src {} rank {}", to_string(mesh),
                                               fmt::join(shape, ","), to_string(ps), src_text(src), rank);
          // Only the rank at coordinate (src, ..., src) holds the data; the others pass garbage.
          const bool source = !src || mesh.rank_at(Dims::filled(mesh.ndim(), *src)) == rank;
          const Tensor& input = source ? truth : garbage;
          DTensor x = distribute_tensor(input, comms, ps, src);
          checks.check(x.spec() == make_spec(x.spec().mesh, ps, shape, DType::kF32), what + ": spec");
          checks.check(!x.to_local().shares_storage_with(input), what + ": local aliases the input");
          if (!has_partial(ps)) {
            const std::string err = check_local(x.spec(), rank, x.to_local());
            checks.check(err.empty(), what + ": " + err);
          }
          // For Partial, the reduction over the group (redistribute to R) gives the input back.
          const Tensor whole = x.full_tensor();
          const bool ok = exact_partition(ps, mesh_shape) ? kernels::equal(whole, truth)
                                                          : kernels::allclose(whole, truth, 1e-6, 1e-5);
          checks.check(ok, what + ": full_tensor differs from the input");
          if (rank == 0) ++cases;
        }
      }
      checks.check(kernels::equal(truth, global_tensor(shape)), "distribute_tensor wrote into its input");
      checks.check(kernels::equal(garbage, Tensor::full(shape, -100.0 - rank, DType::kF32)),
                   "distribute_tensor wrote into a non-source input");
    }
  });
  return cases;
}

}  // namespace

TEST_CASE("distribute_tensor: every placement kind, uneven shapes, src_data_rank 0/1/nullopt",
          "[dtensor][api]") {
  Checks checks;
  int64_t cases = 0;
  const std::vector<Placement> one_d = {Replicate{}, Shard{0}, Shard{1}, Shard{-1}, StridedShard{0, 2},
                                        StridedShard{1, 3}, Partial{ReduceOp::kSum}, Partial{ReduceOp::kAvg},
                                        Partial{ReduceOp::kMax}, Partial{ReduceOp::kMin}};
  cases += distribute_cases({4}, {{5, 7}, {9, 3}, {1, 4}, {0, 3}}, one_d, checks);
  const std::vector<Placement> two_d = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2},
                                        Partial{ReduceOp::kSum}, Partial{ReduceOp::kMax}};
  cases += distribute_cases({2, 2}, {{5, 7}, {8, 3}, {1, 2}}, two_d, checks);
  cases += distribute_cases({3, 2}, {{7, 5}, {4, 3}}, two_d, checks);
  // 8 rank threads are slow on the local backend: 5 options (P(avg) is covered above).
  const std::vector<Placement> three_d = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 3},
                                          Partial{ReduceOp::kSum}};
  cases += distribute_cases({2, 2, 2}, {{9, 5}}, three_d, checks);
  INFO(cases << " cases");
  CHECK(cases > 900);
  checks.report();
}

TEST_CASE("distribute_tensor: argument checks", "[dtensor][api]") {
  Checks checks;
  on_mesh(DeviceMesh::from_shape({2, 2}), [&](Communicator&, const CommsPtr& comms) {
    const Tensor t = global_tensor({4, 4});
    checks.throws<kernels::InvalidArgument>([&] { distribute_tensor(t, comms, P("S(0)")); },
                                            "1 placements", "placements count");
    checks.throws<kernels::InvalidArgument>([&] { distribute_tensor(t, comms, P("S(2),R")); },
                                            "shard dim 2", "shard dim out of range");
    checks.throws<kernels::InvalidArgument>([&] { distribute_tensor(t, comms, P("R,R"), 2); },
                                            "src_data_rank 2 is out of range", "src_data_rank");
    checks.throws<kernels::Unsupported>([&] { distribute_tensor(t, comms, P("P(prod),R")); },
                                        "P(prod)", "P(prod) partition");
    checks.throws<kernels::Unsupported>(
        [&] { distribute_tensor(global_tensor({4, 4}, DType::kI32), comms, P("R,P")); },
        "would truncate", "integer P(sum) partition");
    checks.check(kernels::equal(distribute_tensor(global_tensor({4, 4}, DType::kI32), comms, P("P(max),S(0)"))
                                    .full_tensor(),
                                global_tensor({4, 4}, DType::kI32)),
                 "integer P(max) distribute");
    checks.throws<kernels::InvalidArgument>([&] { distribute_tensor(Tensor(), comms, P("R,R")); },
                                            "undefined", "undefined tensor");
    checks.throws<kernels::InvalidArgument>([&] { distribute_tensor(t, comms, P("P(max),P(sum)")); },
                                            "mix Partial ops", "mixed partial ops");
  });
  checks.report();
}

TEST_CASE("distribute_tensor and redistribute on a rank outside the mesh", "[dtensor][api]") {
  Checks checks;
  const DeviceMesh mesh({2}, {1, 2});  // rank 0 of a 3-rank world is outside
  on_mesh(mesh, [&](Communicator& world, const CommsPtr& comms) {
    const Tensor t = global_tensor({5, 2});
    DTensor x = distribute_tensor(t, comms, P("S(0)"));
    DTensor y = x.redistribute(P("R"));
    if (world.rank() == 0) {
      checks.check(x.to_local().shape() == Dims{0} && y.full_tensor().shape() == Dims{0},
                   "outside: empty local");
      checks.check(x.shape() == Dims{5, 2}, "outside: global shape");
    } else {
      checks.check(kernels::equal(y.to_local(), t), "inside: replicated");
    }
  }, 3);
  checks.report();
}

TEST_CASE("from_local: even inference, explicit uneven shape and stride, a view", "[dtensor][api]") {
  Checks checks;
  on_mesh(DeviceMesh::from_shape({2, 2}), [&](Communicator& world, const CommsPtr& comms) {
    const int rank = world.rank();
    // Even: [S(0),S(1)] local (3,2) -> global (6,4).
    const DTensorSpec even = make_spec(mesh_of(comms),
                                       P("S(0),S(1)"), {6, 4}, DType::kF32);
    Tensor local = make_local(even, rank);
    DTensor x = from_local(local, comms, P("S(0),S(-1)"), std::nullopt, std::nullopt, true);
    checks.check(x.shape() == Dims{6, 4} && x.stride() == Dims{4, 1}, "even inference");
    checks.check(x.placements() == P("S(0),S(1)"), "negative dim normalised");
    checks.check(x.to_local().shares_storage_with(local), "from_local keeps the local as is");
    checks.check(kernels::equal(x.full_tensor(), global_tensor({6, 4})), "even full_tensor");
    // StridedShard infers like Shard.
    DTensor s = from_local(Tensor::zeros({2, 3}, DType::kF32), comms, P("_S(0,2),R"));
    checks.check(s.shape() == Dims{4, 3}, "strided inference");
    // PyTorch's stride example: local (4,8,2) stride (16,1,8), Shard(2) over 2 -> (4,8,4), (32,1,8).
    Tensor perm = Tensor::zeros({4, 2, 8}, DType::kF32).permute({0, 2, 1});
    DTensor p = from_local(perm, comms, P("S(2),R"));
    checks.check(
        p.shape() == Dims{4, 8, 4} && p.stride() == Dims{32, 1, 8},
        fmt::format("stride inference: [{}] [{}]", fmt::join(p.shape(), ","), fmt::join(p.stride(), ",")));
    // Partial sources are the user's claim; full_tensor reduces them.
    const DTensorSpec partial = make_spec(x.spec().mesh, P("P,S(1)"), {5, 3}, DType::kF32);
    DTensor q =
        from_local(make_local(partial, rank), comms, partial.placements, Dims{5, 3}, Dims{3, 1}, true);
    checks.check(kernels::equal(q.full_tensor(), global_tensor({5, 3})), "partial full_tensor");
    checks.throws<kernels::InvalidArgument>(
        [&] { from_local(local, comms, P("S(0),S(1)"), std::nullopt, Dims{4, 1}); },
        "without a shape", "stride without shape");
  });
  // Uneven shards need the shape: 9 rows over 4 are 3,3,3,0 (torch.chunk).
  on_mesh(DeviceMesh::from_shape({4}), [&](Communicator& world, const CommsPtr& comms) {
    const DTensorSpec spec = make_spec(mesh_of(comms), P("S(0)"),
                                       {9, 2}, DType::kF32);
    Tensor local = make_local(spec, world.rank());
    DTensor x = from_local(local, comms, spec.placements, Dims{9, 2}, Dims{2, 1}, true);
    checks.check(kernels::equal(x.full_tensor(), global_tensor({9, 2})), "uneven full_tensor");
    DTensor y = from_local(local, comms, spec.placements, Dims{9, 2});
    checks.check(y.stride() == Dims{2, 1}, "shape alone: row-major stride");
  });
  checks.report();
}

TEST_CASE("from_local run_check names the first disagreeing rank", "[dtensor][api]") {
  Checks checks;
  on_mesh(DeviceMesh::from_shape({4}), [&](Communicator& world, const CommsPtr& comms) {
    const int rank = world.rank();
    const Placements s0 = P("S(0)");
    // tensor_split-style 3,2,2,2 rows of 9: rank 1 holds 2 rows where torch.chunk gives 3.
    const int64_t rows = rank == 0 ? 3 : 2;
    checks.throws<kernels::InvalidArgument>(
        [&] { from_local(Tensor::zeros({rows, 2}, DType::kF32), comms, s0, Dims{9, 2}, Dims{2, 1}, true); },
        "rank 1 has local shape [2,2] but its torch.chunk shard of global shape [9,2] under [S(0)] is [3,2]",
        "wrong shard shape");
    // Uneven locals without a shape: the inferred global shapes disagree.
    const int64_t chunk_rows = rank == 3 ? 0 : 3;
    checks.throws<kernels::InvalidArgument>(
        [&] {
          from_local(Tensor::zeros({chunk_rows, 2}, DType::kF32), comms, s0, std::nullopt, std::nullopt,
                     true);
        },
        "rank 3 disagrees with rank 0 on the global shape: [0,2] vs [12,2]", "inferred shapes");
    // A dtype disagreement.
    const DType dtype = rank == 2 ? DType::kF64 : DType::kF32;
    checks.throws<kernels::InvalidArgument>(
        [&] { from_local(Tensor::zeros({2, 2}, dtype), comms, s0, std::nullopt, std::nullopt, true); },
        "rank 2 disagrees with rank 0 on the dtype: f64 vs f32", "dtype");
    // Placements disagreeing.
    const Placements mine = rank == 1 ? P("R") : s0;
    checks.throws<kernels::InvalidArgument>(
        [&] { from_local(Tensor::zeros({2, 2}, DType::kF32), comms, mine, Dims{8, 2}, Dims{2, 1}, true); },
        "rank 1 disagrees with rank 0 on the", "placements");
    // Without run_check a wrong local shape is still caught locally by the constructor.
    if (rank == 1)
      checks.throws<kernels::InvalidArgument>(
          [&] { from_local(Tensor::zeros({2, 2}, DType::kF32), comms, s0, Dims{9, 2}, Dims{2, 1}); },
          "holds a local tensor of shape [2,2]", "constructor check");
  });
  checks.report();
}

TEST_CASE("redistribute round trips x -> y -> x with both planners", "[dtensor][api]") {
  Checks checks;
  int64_t cases = 0;
  const std::vector<Placement> options = {Replicate{}, Shard{0}, Shard{1}, StridedShard{0, 2}};
  for (const Dims& mesh_shape : std::vector<Dims>{{2, 2}, {3, 2}}) {
    const DeviceMesh mesh = DeviceMesh::from_shape(mesh_shape);
    on_mesh(mesh, [&](Communicator& world, const CommsPtr& comms) {
      const Dims shape{7, 5};
      const Tensor truth = global_tensor(shape);
      for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch})
        for (const Placements& a : testing_support::placement_lists(2, options)) {
          const DTensor x = distribute_tensor(truth, comms, a);
          for (const Placements& b : testing_support::placement_lists(2, options)) {
            const std::string what =
                fmt::format("mesh {} [{}] -> [{}] ({}) rank {}", to_string(mesh), to_string(a), to_string(b),
                            to_string(planner), world.rank());
            const DTensor y = x.redistribute(b, {planner});
            const std::string err = check_local(y.spec(), world.rank(), y.to_local());
            checks.check(err.empty(), what + ": " + err);
            const DTensor z = y.redistribute(a, {planner});
            checks.check(kernels::equal(z.to_local(), x.to_local()), what + ": round trip");
            if (world.rank() == 0) ++cases;
          }
        }
      // Partial sources: P -> S / R, and back to the same Partial is not possible (new Partial).
      const DTensorSpec p = make_spec(std::make_shared<const DeviceMesh>(mesh), P("P,S(1)"), shape,
                                      DType::kF32);
      const DTensor px = from_local(make_local(p, world.rank()), comms, p.placements, shape, p.stride);
      for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch}) {
        const DTensor py = px.redistribute(P("S(0),S(1)"), {planner});
        checks.check(check_local(py.spec(), world.rank(), py.to_local()).empty(), "P -> S");
        checks.check(kernels::equal(py.full_tensor(), truth), "P -> S full_tensor");
      }
    });
  }
  INFO(cases << " round trips");
  CHECK(cases == 2 * 2 * 16 * 16);
  checks.report();
}

TEST_CASE("redistribute: equal placements share the local; plans are cached", "[dtensor][api]") {
  Checks checks;
  on_mesh(DeviceMesh::from_shape({2, 2}), [&](Communicator&, const CommsPtr& comms) {
    const DTensor x = distribute_tensor(global_tensor({6, 4}), comms, P("S(0),S(1)"));
    const DTensor y = x.redistribute(P("S(-2),S(-1)"));
    checks.check(y.to_local().shares_storage_with(x.to_local()), "equal placements share the local");
    checks.check(y.spec() == x.spec(), "same spec");
    const Plan& a = x.plan_to(P("R,S(0)"));
    const Plan& b = x.plan_to(P("R,S(0)"));
    checks.check(&a == &b, "plan cached");
    checks.check(to_string(a) == to_string(plan_redistribute(x.spec(), P("R,S(0)"),
                                                              PlannerKind::kSearch)),
                 "plan_to uses the search planner by default: " + to_string(a));
    const Plan& g = x.plan_to(P("R,S(0)"), {PlannerKind::kGreedy});
    checks.check(g.planner == PlannerKind::kGreedy, "greedy plan on request");
    checks.check(kernels::equal(x.redistribute(P("R,S(0)")).full_tensor(), global_tensor({6, 4})),
                 "full_tensor after redistribute");
  });
  checks.report();
}

TEST_CASE("redistribute: unsupported and invalid targets", "[dtensor][api]") {
  Checks checks;
  on_mesh(DeviceMesh::from_shape({2, 2}), [&](Communicator& world, const CommsPtr& comms) {
    const DTensor x = distribute_tensor(global_tensor({4, 4}), comms, P("S(0),R"));
    checks.throws<kernels::Unsupported>([&] { x.redistribute(P("S(0),P")); },
                                        "would create a new Partial", "R -> P");
    checks.throws<kernels::Unsupported>([&] { x.redistribute(P("P(avg),R")); },
                                        "only a Shard becomes Partial, and only P(sum)", "S -> P(avg)");
    // PyTorch 2.15: S(d) -> P(sum) is a local zero-fill whose sum over the group is the tensor.
    const DTensor z = x.redistribute(P("P,R"));
    checks.check(z.to_local().shape() == Dims{4, 4}, "S -> P(sum) holds the group's extent");
    checks.check(kernels::equal(z.full_tensor(), global_tensor({4, 4})), "S -> P(sum) reduces to the tensor");
    checks.throws<kernels::InvalidArgument>([&] { x.redistribute(P("R")); }, "1 placements",
                                            "placements count");
    checks.throws<kernels::InvalidArgument>([&] { x.redistribute(P("S(2),R")); }, "shard dim 2",
                                            "shard dim");
    const DTensorSpec avg = make_spec(x.spec().mesh, P("P(avg),R"), {4, 4}, DType::kF32);
    const DTensor p = from_local(make_local(avg, world.rank()), comms, avg.placements);
    checks.throws<kernels::Unsupported>([&] { p.redistribute(P("P(sum),R")); },
                                        "changes the reduce op", "P(avg) -> P(sum)");
    checks.check(kernels::equal(p.full_tensor(), global_tensor({4, 4})), "P(avg) full_tensor");
  });
  checks.report();
}

TEST_CASE("DTensor constructor validates the local shard and the mesh", "[dtensor][api]") {
  Checks checks;
  on_mesh(DeviceMesh::from_shape({2, 2}), [&](Communicator& world, const CommsPtr& comms) {
    auto mesh = mesh_of(comms);
    const DTensorSpec spec = make_spec(mesh, P("S(0),S(1)"), {5, 3}, DType::kF32);
    const Tensor good = make_local(spec, world.rank());
    DTensor ok(comms, spec, good);
    checks.check(ok.to_local().shares_storage_with(good), "constructor keeps the local");
    checks.throws<kernels::InvalidArgument>([&] { DTensor(comms, spec, Tensor::zeros({5, 3}, DType::kF32)); },
                                            "holds a local tensor of shape [5,3]", "wrong local shape");
    checks.throws<kernels::InvalidArgument>([&] { DTensor(comms, spec, good.to(DType::kF64)); },
                                            "local dtype f64", "wrong dtype");
    const DTensorSpec other = make_spec(std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({4})),
                                        P("S(0)"), {5, 3}, DType::kF32);
    checks.throws<kernels::InvalidArgument>([&] { DTensor(comms, other, good); },
                                            "is not the communicators' mesh", "wrong mesh");
  });
  checks.report();
}

TEST_CASE("redistribute_batch equals one-by-one and validates the batch", "[dtensor][api]") {
  Checks checks;
  const DeviceMesh mesh = DeviceMesh::from_shape({2, 2});
  on_mesh(mesh, [&](Communicator& world, const CommsPtr& comms) {
    for (const char* pair : {"S(0),R|R,S(1)", "S(0),S(1)|S(1),S(0)", "R,R|_S(0,2),S(0)", "P,S(0)|R,R"}) {
      const std::string text(pair);
      const Placements src = parse_placements(text.substr(0, text.find('|')));
      const Placements dst = parse_placements(text.substr(text.find('|') + 1));
      std::vector<DTensor> batch;
      for (const Dims& shape : std::vector<Dims>{{8, 4}, {5, 3}, {1, 6}, {0, 2}}) {
        const DTensorSpec s = make_spec(std::make_shared<const DeviceMesh>(mesh), src, shape, DType::kF32);
        batch.push_back(from_local(make_local(s, world.rank()), comms, src, shape, s.stride));
      }
      for (PlannerKind planner : {PlannerKind::kGreedy, PlannerKind::kSearch}) {
        const std::vector<DTensor> out = redistribute_batch(batch, dst, {planner});
        checks.check(out.size() == batch.size(), "batch size");
        for (size_t i = 0; i < batch.size(); ++i) {
          const DTensor one = batch[i].redistribute(dst, {planner});
          checks.check(out[i].spec() == one.spec() && kernels::equal(out[i].to_local(), one.to_local()),
                       fmt::format("{} tensor {} differs from one-by-one", text, i));
        }
      }
    }
    // Validation, naming the offending index.
    auto shard = [&](const Dims& shape, const char* ps, DType dtype) {
      return distribute_tensor(global_tensor(shape, dtype), comms, P(ps));
    };
    std::vector<DTensor> mixed = {shard({4, 4}, "S(0),R", DType::kF32), shard({4, 2}, "R,R", DType::kF32)};
    checks.throws<kernels::InvalidArgument>([&] { redistribute_batch(mixed, P("R,R")); },
                                            "tensor 1 has placements [R,R] but tensor 0 has [S(0),R]",
                                            "placements");
    mixed[1] = shard({4, 2}, "S(0),R", DType::kF64);
    checks.throws<kernels::InvalidArgument>([&] { redistribute_batch(mixed, P("R,R")); },
                                            "tensor 1 has dtype f64", "dtype");
    checks.check(redistribute_batch(std::span<const DTensor>(), P("R,R")).empty(), "empty batch");
  });
  // Another mesh in the batch.
  on_mesh(mesh, [&](Communicator& world, const CommsPtr& comms) {
    auto flat = std::make_shared<const MeshComms>(DeviceMesh::from_shape({4}), world);
    std::vector<DTensor> two = {distribute_tensor(global_tensor({4, 4}), comms, P("S(0),R")),
                                distribute_tensor(global_tensor({4, 4}), flat, P("S(0)"))};
    checks.throws<kernels::Unsupported>([&] { redistribute_batch(two, P("R,R")); },
                                        "cross-mesh redistribute is not supported", "cross mesh");
  });
  checks.report();
}

TEST_CASE("factories: rand is a function of (seed, global index); zeros, ones, full", "[dtensor][api]") {
  Checks checks;
  on_mesh(DeviceMesh::from_shape({2, 2}), [&](Communicator& world, const CommsPtr& comms) {
    const Dims shape{7, 5};
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF64}) {
      const Tensor ref = rand(shape, 42, dtype, comms, P("R,R")).to_local();
      for (const char* ps : {"S(0),R", "R,S(1)", "_S(0,2),S(0)", "S(1),S(0)"}) {
        const DTensor r = rand(shape, 42, dtype, comms, P(ps));
        checks.check(r.to_local().shape() == r.spec().layout(world.rank())->local_shape, "rand local shape");
        checks.check(kernels::equal(r.full_tensor(), ref),
                     fmt::format("rand [{}] {}", ps, kernels::to_string(dtype)));
      }
      const std::vector<double> v = ref.to_vector();
      checks.check(std::all_of(v.begin(), v.end(), [](double x) { return x >= 0 && x < 1; }),
                   "rand in [0,1)");
      checks.check(std::set<double>(v.begin(), v.end()).size() > v.size() / 2, "rand values vary");
      checks.check(!kernels::equal(rand(shape, 43, dtype, comms, P("R,R")).to_local(), ref),
                   "another seed, other values");
    }
    checks.throws<kernels::InvalidArgument>([&] { rand(shape, 1, DType::kI32, comms, P("R,R")); },
                                            "not a floating-point type", "rand of ints");
    const Placements ps = P("S(0),S(1)");
    const Dims local = make_spec(mesh_of(comms), ps, shape, DType::kF32)
                           .layout(world.rank())
                           ->local_shape;
    const DTensor z = zeros(shape, DType::kI32, comms, ps);
    checks.check(
        z.to_local().shape() == local && kernels::equal(z.to_local(), Tensor::zeros(local, DType::kI32)),
        "zeros");
    const DTensor o = ones(shape, DType::kF32, comms, ps);
    checks.check(kernels::equal(o.full_tensor(), Tensor::full(shape, 1.0, DType::kF32)), "ones");
    const DTensor f = full(shape, 2.5, DType::kF64, comms, ps);
    checks.check(kernels::equal(f.full_tensor(), Tensor::full(shape, 2.5, DType::kF64)), "full");
    const DTensor e = empty(shape, DType::kF16, comms, ps);
    checks.check(e.to_local().shape() == local && e.dtype() == DType::kF16, "empty");
    for (const char* bad : {"P,R", "R,P(max)"})
      checks.throws<kernels::InvalidArgument>([&] { zeros(shape, DType::kF32, comms, P(bad)); },
                                              "factories take Shard, StridedShard and Replicate", bad);
    checks.throws<kernels::InvalidArgument>([&] { ones(shape, DType::kF32, comms, P("S(0)")); },
                                            "1 placements", "factory placements count");
  });
  checks.report();
}

TEST_CASE("ownership text and to_string", "[dtensor][api]") {
  auto mesh = std::make_shared<const DeviceMesh>(DeviceMesh::from_shape({2, 2}));
  const DTensorSpec spec = make_spec(mesh, P("S(0),S(1)"), {3, 4}, DType::kF32);
  CHECK(ownership_text(spec) ==
        "rank  coord     local       offset        held indices per tensor dim\n"
        "   0  (0,0)     [2,2]       [0,0]         0-1 x 0-1\n"
        "   1  (0,1)     [2,2]       [0,2]         0-1 x 2-3\n"
        "   2  (1,0)     [1,2]       [2,0]         2 x 0-1\n"
        "   3  (1,1)     [1,2]       [2,2]         2 x 2-3\n"
        "owners of each element:\n"
        " 0 0 1 1\n"
        " 0 0 1 1\n"
        " 2 2 3 3\n");
  // Strided, uneven, 1-D; an explicit rank array lists ranks in rank order.
  auto line = std::make_shared<const DeviceMesh>(DeviceMesh::parse("[[0,2],[1,3]]"));
  const DTensorSpec strided = make_spec(line, P("_S(0,2),R"), {9}, DType::kF32);
  CHECK(ownership_text(strided) ==
        "rank  coord     local       offset        held indices per tensor dim\n"
        "   0  (0,0)     [5]         [0]           0-2,5-6\n"
        "   1  (1,0)     [4]         [3]           3-4,7-8\n"
        "   2  (0,1)     [5]         [0]           0-2,5-6\n"
        "   3  (1,1)     [4]         [3]           3-4,7-8\n"
        "owners of each element:\n"
        " 0/2 0/2 0/2 1/3 1/3 0/2 0/2 1/3 1/3\n");
  Checks checks;
  on_mesh(DeviceMesh::from_shape({2}), [&](Communicator& world, const CommsPtr& comms) {
    const DTensor x = distribute_tensor(global_tensor({2, 2}), comms, P("S(0)"));
    const std::string want = world.rank() == 0 ? "DTensor(shape=[2,2], dtype=f32, mesh=[0,1], "
                                                 "placements=[S(0)], local=tensor([[1., 2.]], dtype=f32))"
                                               : "DTensor(shape=[2,2], dtype=f32, mesh=[0,1], "
                                                 "placements=[S(0)], local=tensor([[3., 4.]], dtype=f32))";
    checks.check(to_string(x) == want, to_string(x));
    checks.check(x.ownership() == ownership_text(x.spec()), "ownership() == ownership_text(spec)");
  });
  checks.report();
}
