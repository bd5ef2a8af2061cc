// Redistribute into caller buffers (DTensor::redistribute(placements, out)): S(0) -> R
// all-gathers straight into out and P -> S(0) reduce-scatters straight from the local tensor into
// out, shown by the data pointers the collectives receive and by the allocator (no tensor
// allocation once warm), also when out's Storage was freed and re-allocated in place between
// calls (how FSDP frees unsharded parameters); FSDP's flat buffers (1-D, S(0) over dp, one
// collective per group); every transition into contiguous, strided and other-dtype outs equals
// the plain redistribute; the batched form; bad outs are refused.
//
// Rank threads record failures in testing_support::Checks; Catch2 runs on the test thread only.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "dtensor/dtensor.h"
#include "kernels/allocator.h"
#include "kernels/error.h"
#include "kernels/reduce.h"
#include "kernels/storage.h"
#include "support/checks.h"
#include "support/dtensor_data.h"
#include "support/no_views_communicator.h"
#include "support/placement_lists.h"
#include "support/redistribute_check.h"

using namespace dtensor;
using collectives::CollectiveKind;
using collectives::Communicator;
using kernels::DType;
using testing_support::Checks;
using testing_support::check_local;
using testing_support::make_local;
using testing_support::NoViewsCommunicator;

namespace {

// Counts the tensor allocations of a MeshComms (everything the executor allocates goes through it).
class CountingAllocator final : public kernels::Allocator {
 public:
  void* allocate(size_t nbytes, kernels::Device device) override {
    ++count;
    bytes += static_cast<int64_t>(nbytes);
    return inner.allocate(nbytes, device);
  }
  void deallocate(void* p, size_t nbytes, kernels::Device device) noexcept override {
    inner.deallocate(p, nbytes, device);
  }
  std::atomic<int64_t> count{0}, bytes{0};
  kernels::CachingAllocator inner;
};

// What the collectives of one rank were handed: (kind, input data, output data).
struct Seen {
  CollectiveKind kind;
  const void* in;
  const void* out;
};

// A tensor of `shape` and `dtype` viewing its own Storage (so the test can free and re-allocate it).
Tensor on_storage(const Dims& shape, DType dtype) {
  auto storage = kernels::Storage::allocate(static_cast<size_t>(shape.product()) * kernels::itemsize(dtype), kernels::Device{});
  return Tensor::from_storage(storage, dtype, shape, Tensor::contiguous_strides(shape));
}

const void* ptr(const Tensor& t) { return t.numel() ? t.data_ptr() : nullptr; }

}  // namespace

TEST_CASE("S(0)->R gathers into out and P->S(0) reduce-scatters from the input, nothing allocated once warm",
          "[dtensor][out]") {
  Checks checks;
  int64_t rounds = 0;
  collectives::run_ranks(4, [&](Communicator& world) {
    std::vector<Seen> seen;  // this rank's thread only
    NoViewsCommunicator observed(world, [&](CollectiveKind kind, std::span<const Tensor> b) {
      seen.push_back({kind, b.size() > 0 ? ptr(b[0]) : nullptr, b.size() > 1 ? ptr(b[1]) : nullptr});
    });
    auto alloc = std::make_shared<CountingAllocator>();
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({4}), observed,
                                                   std::vector<std::vector<int>>{}, alloc);
    auto mesh = std::make_shared<const DeviceMesh>(comms->mesh());
    const int r = world.rank();
    // FSDP's flat buffer: one padded 1-D tensor per group, S(0) over dp.
    const Dims flat{4 * 1000};
    const DTensorSpec sharded = make_spec(mesh, parse_placements("S(0)"), flat, DType::kF32);
    const DTensorSpec full = make_spec(mesh, parse_placements("R"), flat, DType::kF32);
    const DTensorSpec grads = make_spec(mesh, parse_placements("P"), flat, DType::kF32);
    const DTensor params(comms, sharded, make_local(sharded, r));
    const DTensor grad(comms, grads, make_local(grads, r));
    Tensor unsharded = on_storage(flat, DType::kF32);  // the group's unsharded parameters
    Tensor grad_shard = on_storage({1000}, DType::kF32);
    for (int round = 0; round < 4; ++round) {
      const std::string what = fmt::format("rank {} round {}", r, round);
      if (round >= 2) {
        // Freed after backward, re-allocated before the next forward: same Storage, maybe new memory.
        unsharded.storage()->free();
        unsharded.storage()->reallocate();
      }
      const int64_t before = alloc->count.load();
      seen.clear();
      const DTensor u = params.redistribute(parse_placements("R"), unsharded);
      const DTensor g = grad.redistribute(parse_placements("S(0)"), grad_shard);
      const int64_t allocated = alloc->count.load() - before;
      checks.check(u.to_local().data_ptr() == unsharded.data_ptr() && g.to_local().data_ptr() == grad_shard.data_ptr(),
                   what + ": the results are not the out tensors");
      checks.check(seen.size() == 2, fmt::format("{}: {} collectives, expected 2", what, seen.size()));
      if (seen.size() == 2) {
        checks.check(seen[0].kind == CollectiveKind::kAllGather && seen[0].in == params.to_local().data_ptr() &&
                         seen[0].out == unsharded.data_ptr(),
                     what + ": the all_gather did not run from the local shard straight into out");
        checks.check(seen[1].kind == CollectiveKind::kReduceScatter && seen[1].in == grad.to_local().data_ptr() &&
                         seen[1].out == grad_shard.data_ptr(),
                     what + ": the reduce_scatter did not run from the local tensor straight into out");
      }
      if (round > 0) checks.check(allocated == 0, fmt::format("{}: {} tensor allocations once warm", what, allocated));
      for (const auto& [spec, t] : {std::pair{full, u.to_local()}, std::pair{sharded, g.to_local()}}) {
        const std::string err = check_local(spec, r, t);
        checks.check(err.empty(), what + ": " + err);
      }
      if (r == 0) ++rounds;
    }
  });
  checks.report();
  CHECK(rounds == 4);
}

TEST_CASE("ragged flat buffers: equal ranges take all_gather / reduce_scatter into out, uneven ones no copy after",
          "[dtensor][out][ragged]") {
  // FSDP's contiguous layout: one 1-D buffer Rg over dp. With equal ranges Rg -> R is the plain
  // all_gather from the local shard into out and P -> Rg the plain reduce_scatter from the input
  // into out: nothing allocated once warm. With uneven ranges (8 x 500 elements cut 1,2,0,1:
  // 1000, 2000, 0, 1000) the reduce-scatter receives the 3 peers' pieces of this rank's range
  // into buffers of its size and sums them straight into out: exactly 3 such buffers allocated.
  Checks checks;
  int64_t rounds = 0;
  collectives::run_ranks(4, [&](Communicator& world) {
    std::vector<Seen> seen;  // this rank's thread only
    NoViewsCommunicator observed(world, [&](CollectiveKind kind, std::span<const Tensor> b) {
      seen.push_back({kind, b.size() > 0 ? ptr(b[0]) : nullptr, b.size() > 1 ? ptr(b[1]) : nullptr});
    });
    auto alloc = std::make_shared<CountingAllocator>();
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({4}), observed,
                                                   std::vector<std::vector<int>>{}, alloc);
    auto mesh = std::make_shared<const DeviceMesh>(comms->mesh());
    const int r = world.rank();
    const Dims flat{4000};
    for (const char* rg : {"Rg(0,[1,1,1,1],4)", "Rg(0,[1,2,0,1],4)"}) {
      const bool equal = std::string(rg) == "Rg(0,[1,1,1,1],4)";
      const DTensorSpec sharded = make_spec(mesh, parse_placements(rg), flat, DType::kF32);
      const DTensorSpec full = make_spec(mesh, parse_placements("R"), flat, DType::kF32);
      const DTensorSpec grads = make_spec(mesh, parse_placements("P"), flat, DType::kF32);
      const int64_t mine = sharded.layout(r)->local_shape.product();
      const DTensor params(comms, sharded, make_local(sharded, r));
      const DTensor grad(comms, grads, make_local(grads, r));
      Tensor unsharded = on_storage(flat, DType::kF32);
      Tensor grad_shard = on_storage({mine}, DType::kF32);
      for (int round = 0; round < 3; ++round) {
        const std::string what = fmt::format("{} rank {} round {}", rg, r, round);
        const int64_t count0 = alloc->count.load(), bytes0 = alloc->bytes.load();
        seen.clear();
        const DTensor u = params.redistribute(parse_placements("R"), unsharded);
        const int64_t gather_count = alloc->count.load() - count0;
        const int64_t bytes1 = alloc->bytes.load();
        const DTensor g = grad.redistribute(parse_placements(rg), grad_shard);
        const int64_t reduce_bytes = alloc->bytes.load() - bytes1;
        checks.check(u.to_local().data_ptr() == unsharded.data_ptr() &&
                         (mine == 0 || g.to_local().data_ptr() == grad_shard.data_ptr()),
                     what + ": the results are not the out tensors");
        if (equal) {
          checks.check(seen.size() == 2, fmt::format("{}: {} collectives, expected 2", what, seen.size()));
          if (seen.size() == 2) {
            checks.check(seen[0].kind == CollectiveKind::kAllGather && seen[0].in == params.to_local().data_ptr() &&
                             seen[0].out == unsharded.data_ptr(),
                         what + ": the all_gather did not run from the local shard straight into out");
            checks.check(seen[1].kind == CollectiveKind::kReduceScatter && seen[1].in == grad.to_local().data_ptr() &&
                             seen[1].out == grad_shard.data_ptr(),
                         what + ": the reduce_scatter did not run from the local tensor straight into out");
          }
          if (round > 0)
            checks.check(alloc->bytes.load() == bytes0,
                         fmt::format("{}: {} bytes allocated once warm", what, alloc->bytes.load() - bytes0));
        } else if (round > 0) {
          checks.check(gather_count == 0, fmt::format("{}: the all-gather allocated {} tensors", what, gather_count));
          checks.check(reduce_bytes == 3 * mine * 4,
                       fmt::format("{}: the reduce-scatter allocated {} bytes, expected 3 x {} x 4 (the peers' pieces)",
                                   what, reduce_bytes, mine));
        }
        for (const auto& [spec, t] : {std::pair{full, u.to_local()}, std::pair{sharded, g.to_local()}}) {
          const std::string err = check_local(spec, r, t);
          checks.check(err.empty(), what + ": " + err);
        }
        if (r == 0) ++rounds;
      }
    }
  });
  checks.report();
  CHECK(rounds == 2 * 3);
}

TEST_CASE("bf16 gradients reduce-scatter in f32 straight into an f32 out", "[dtensor][out][precision]") {
  Checks checks;
  collectives::run_ranks(4, [&](Communicator& world) {
    std::vector<Seen> seen;
    NoViewsCommunicator observed(world, [&](CollectiveKind kind, std::span<const Tensor> b) {
      seen.push_back({kind, ptr(b[0]), b.size() > 1 ? ptr(b[1]) : nullptr});
    });
    auto alloc = std::make_shared<CountingAllocator>();
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({4}), observed,
                                                   std::vector<std::vector<int>>{}, alloc);
    auto mesh = std::make_shared<const DeviceMesh>(comms->mesh());
    const DTensorSpec grads = make_spec(mesh, parse_placements("P"), {4 * 4096}, DType::kBF16);
    const DTensor grad(comms, grads, make_local(grads, world.rank(), 32));
    Tensor shard = Tensor::empty({4096}, DType::kF32);
    RedistributeOptions opt;
    opt.reduce_dtype = DType::kF32;
    opt.divide_factor = 4;  // the mean, exact here
    kernels::CachingAllocator::Stats warm{};
    for (int round = 0; round < 3; ++round) {
      if (round == 1) warm = alloc->inner.stats();
      seen.clear();
      const DTensor g = grad.redistribute(parse_placements("S(0)"), shard, opt);
      checks.check(g.dtype() == DType::kF32 && g.to_local().data_ptr() == shard.data_ptr(), "not the f32 out");
      checks.check(seen.size() == 1 && seen[0].kind == CollectiveKind::kReduceScatter && seen[0].out == shard.data_ptr(),
                   "the f32 reduce_scatter does not write the out tensor");
      // The contributions of the group sum to the value (make_local): the mean is value / 4, exact.
      const DTensorSpec want = make_spec(mesh, parse_placements("S(0)"), {4 * 4096}, DType::kF32);
      const Tensor values = make_local(want, world.rank(), 32);
      kernels::scale_(values, 0.25);
      checks.check(kernels::equal(shard, values), fmt::format("rank {} round {}: not the mean", world.rank(), round));
    }
    // The f32 copy of the input is the only buffer, served by the cache once warm.
    checks.check(alloc->inner.stats().misses == warm.misses, "cache misses once warm");
  });
  checks.report();
}

TEST_CASE("every transition into contiguous, strided and other-dtype outs equals the plain redistribute",
          "[dtensor][out]") {
  const std::vector<Placement> src_options = {Replicate{}, Shard{0}, Shard{1}, Partial{}};
  const std::vector<Placement> dst_options = {Replicate{}, Shard{0}, Shard{1}};
  const std::vector<Dims> shapes = {{5, 7}, {8, 4}};
  Checks checks;
  int64_t cases = 0;
  for (const Dims& mesh_shape : std::vector<Dims>{{4}, {2, 2}}) {
    const DeviceMesh mesh = DeviceMesh::from_shape(mesh_shape);
    const auto srcs = testing_support::placement_lists(mesh_shape.size(), src_options);
    const auto dsts = testing_support::placement_lists(mesh_shape.size(), dst_options);
    collectives::run_ranks(4, [&](Communicator& world) {
      auto comms = std::make_shared<const MeshComms>(mesh, world);
      auto m = std::make_shared<const DeviceMesh>(mesh);
      const int r = world.rank();
      int64_t mine = 0;
      for (const Dims& shape : shapes)
        for (const Placements& src : srcs)
          for (const Placements& dst : dsts) {
            const DTensorSpec spec = make_spec(m, src, shape, DType::kF32);
            const DTensor x(comms, spec, make_local(spec, r));
            const Tensor plain = x.redistribute(dst).to_local();
            const Dims local_shape = plain.shape();
            Tensor wide = Tensor::full({local_shape[0], local_shape[1] + 2}, -1, DType::kF32);
            const std::vector<Tensor> outs = {Tensor::empty(local_shape, DType::kF32),
                                              wide.narrow(1, 1, local_shape[1]),  // strided
                                              Tensor::empty(local_shape, DType::kF64)};
            for (const Tensor& out : outs) {
              const DTensor y = x.redistribute(dst, out);
              const std::string what = fmt::format("mesh {} shape [{}] [{}] -> [{}] rank {} out {} {}", to_string(mesh),
                                                   fmt::join(shape, ","), to_string(src), to_string(dst), r,
                                                   kernels::to_string(out.dtype()), out.is_contiguous() ? "contiguous" : "strided");
              checks.check(y.to_local().shares_storage_with(out) && y.to_local().data_ptr() == (out.numel() ? out.data_ptr() : y.to_local().data_ptr()),
                           what + ": the result is not the out tensor");
              checks.check(y.dtype() == out.dtype() && y.placements() == normalize_placements(dst, mesh.ndim(), 2),
                           what + ": the result's spec");
              checks.check(kernels::equal(y.to_local(), plain, /*allow_dtype_mismatch=*/true), what + ": values differ");
            }
            // The columns around the strided out are untouched.
            if (local_shape.product() > 0)
              checks.check(wide.narrow(1, 0, 1).to_vector() == std::vector<double>(local_shape[0], -1.0),
                           "the strided out wrote outside its view");
            ++mine;
          }
      if (r == 0) cases += mine;
    });
  }
  checks.report();
  CHECK(cases == 2 * (4 * 3 + 16 * 9));  // shapes x (pairs on {4} + pairs on {2,2})
}

TEST_CASE("batched redistribute into outs", "[dtensor][out][batch]") {
  Checks checks;
  collectives::run_ranks(4, [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({2, 2}), world);
    auto m = std::make_shared<const DeviceMesh>(comms->mesh());
    for (const char* pair : {"S(0),S(0)|R,R", "P,S(0)|S(0),R", "S(0),S(1)|S(1),S(0)"}) {
      const std::string text(pair);
      const Placements src = parse_placements(text.substr(0, text.find('|')));
      const Placements dst = parse_placements(text.substr(text.find('|') + 1));
      std::vector<DTensor> xs;
      std::vector<Tensor> outs;
      for (const Dims& shape : std::vector<Dims>{{8, 4}, {5, 3}, {12, 6}}) {
        const DTensorSpec spec = make_spec(m, src, shape, DType::kF32);
        xs.emplace_back(comms, spec, make_local(spec, world.rank()));
        outs.push_back(Tensor::empty(xs.back().redistribute(dst).to_local().shape(), DType::kF64));
      }
      const std::vector<DTensor> ys = redistribute_batch(xs, dst, {}, outs);
      for (size_t i = 0; i < ys.size(); ++i) {
        checks.check(ys[i].to_local().data_ptr() == outs[i].data_ptr() || outs[i].numel() == 0, text + ": not the out");
        const std::string err = check_local(make_spec(m, dst, xs[i].shape(), DType::kF64), world.rank(), ys[i].to_local());
        checks.check(err.empty(), text + ": " + err);
      }
    }
  });
  checks.report();
}

TEST_CASE("bad outs are refused before anything is issued", "[dtensor][out]") {
  Checks checks;
  collectives::run_ranks(2, [&](Communicator& world) {
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({2}), world);
    auto m = std::make_shared<const DeviceMesh>(comms->mesh());
    const DTensorSpec spec = make_spec(m, parse_placements("S(0)"), {8, 3}, DType::kF32);
    const DTensor x(comms, spec, make_local(spec, world.rank()));
    checks.throws<kernels::InvalidArgument>([&] { x.redistribute(parse_placements("R"), Tensor::empty({4, 3}, DType::kF32)); },
                                            "out tensor has shape [4,3] but rank", "wrong shape");
    Tensor freed = on_storage({8, 3}, DType::kF32);
    freed.storage()->free();
    checks.throws<kernels::InvalidArgument>([&] { x.redistribute(parse_placements("R"), freed); }, "storage is freed",
                                            "freed storage");
    const Tensor alias = x.to_local();
    checks.throws<kernels::InvalidArgument>([&] { x.redistribute(parse_placements("S(0)"), alias); },
                                            "shares storage with the input", "out aliasing the input");
    // Nothing was issued: the ranks are still in step.
    const DTensor y = x.redistribute(parse_placements("R"));
    checks.check(check_local(make_spec(m, parse_placements("R"), {8, 3}, DType::kF32), world.rank(), y.to_local()).empty(),
                 "after the refusals");
  });
  checks.report();
}

TEST_CASE("HSDP [P,P] -> [R,S(0)] / [R,Rg]: the all-reduce runs in place on the reduce-scatter's result, never on the input",
          "[dtensor][out][hsdp]") {
  // FSDP2's gradient sync under HSDP: the reduce-scatter over dp_shard (mesh dim 1) writes into
  // out, the all-reduce over dp_replicate (mesh dim 0) reduces out in place: once warm nothing is
  // allocated. Without an out, the all-reduce runs in place on the reduce-scatter's result (one
  // shard allocated). A single all-reduce of the caller's input ([P,P] -> [R,P]) leaves the
  // input alone.
  Checks checks;
  int64_t cases = 0;
  collectives::run_ranks(4, [&](Communicator& world) {
    std::vector<Seen> seen;  // this rank's thread only
    NoViewsCommunicator observed(world, [&](CollectiveKind kind, std::span<const Tensor> b) {
      seen.push_back({kind, b.size() > 0 ? ptr(b[0]) : nullptr, b.size() > 1 ? ptr(b[1]) : nullptr});
    });
    auto alloc = std::make_shared<CountingAllocator>();
    auto comms = std::make_shared<const MeshComms>(DeviceMesh::from_shape({2, 2}), observed,
                                                   std::vector<std::vector<int>>{}, alloc);
    auto mesh = std::make_shared<const DeviceMesh>(comms->mesh());
    const int r = world.rank();
    const Dims flat{4000};
    const DTensorSpec grads = make_spec(mesh, parse_placements("P,P"), flat, DType::kF32);
    const Tensor input = make_local(grads, r);
    const Tensor input_copy = input.clone();
    const DTensor grad(comms, grads, input);
    for (const char* dst : {"R,S(0)", "R,Rg(0,[1,1],4)"}) {
      const DTensorSpec sharded = make_spec(mesh, parse_placements(dst), flat, DType::kF32);
      const int64_t shard_bytes = 2000 * 4;
      Tensor out = on_storage({2000}, DType::kF32);
      for (int round = 0; round < 3; ++round) {
        const bool into_out = round < 2;  // rounds 0, 1 into out (1: warm); round 2 without
        const std::string what = fmt::format("rank {} {} round {}", r, dst, round);
        seen.clear();
        const int64_t before = alloc->bytes.load();
        const DTensor g = into_out ? grad.redistribute(parse_placements(dst), out) : grad.redistribute(parse_placements(dst));
        const int64_t allocated = alloc->bytes.load() - before;
        const void* result = g.to_local().data_ptr();
        checks.check(seen.size() == 2, fmt::format("{}: {} collectives, expected 2", what, seen.size()));
        if (seen.size() == 2) {
          checks.check(seen[0].kind == CollectiveKind::kReduceScatter && seen[0].in == input.data_ptr() &&
                           seen[0].out == result,
                       what + ": the reduce_scatter did not run from the input into the result");
          checks.check(seen[1].kind == CollectiveKind::kAllReduce && seen[1].in == result && seen[1].out == result,
                       what + ": the all_reduce did not run in place on the reduce_scatter's result");
        }
        if (into_out) {
          checks.check(result == out.data_ptr(), what + ": the result is not out");
          if (round == 1) checks.check(allocated == 0, fmt::format("{}: {} bytes allocated once warm", what, allocated));
        } else {
          checks.check(allocated == shard_bytes,
                       fmt::format("{}: {} bytes allocated, expected one shard ({})", what, allocated, shard_bytes));
        }
        const std::string err = check_local(sharded, r, g.to_local());
        checks.check(err.empty(), what + ": " + err);
        checks.check(kernels::equal(input, input_copy), what + ": the input changed");
        if (r == 0) ++cases;
      }
    }
    // One all-reduce, of the caller's input: into a new buffer.
    seen.clear();
    const DTensor g = grad.redistribute(parse_placements("R,P"));
    checks.check(seen.size() == 1 && seen[0].kind == CollectiveKind::kAllReduce && seen[0].in == input.data_ptr() &&
                     seen[0].out != input.data_ptr(),
                 fmt::format("rank {} [P,P] -> [R,P]: not one all_reduce from the input into a new buffer", r));
    checks.check(kernels::equal(input, input_copy), fmt::format("rank {} [P,P] -> [R,P]: the input changed", r));
    const DTensor full = g.redistribute(parse_placements("R,R"));  // the partial sums, summed
    const std::string err = check_local(make_spec(mesh, parse_placements("R,R"), flat, DType::kF32), r, full.to_local());
    checks.check(err.empty(), fmt::format("rank {} [P,P] -> [R,P]: {}", r, err));
  });
  checks.report();
  CHECK(cases == 6);
}
