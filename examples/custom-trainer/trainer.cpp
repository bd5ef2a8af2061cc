// A trainer of your own, built outside this repository against an installed dtensor-runtime
// (meson.build: pkg-config; CMakeLists.txt: find_package). A small GPT built on meta, tensor
// parallel over `tp` and FSDP over `dp` of a 2-D mesh, materialised shard by shard, trained with
// AdamW and gradient clipping; a checkpoint at the midpoint; then a fresh model resumes from it
// and must reproduce the uninterrupted run's losses exactly (exit 1 otherwise).
//   custom-trainer [local|mpi] [DIR]        # mpirun -np 4 custom-trainer mpi DIR
#include <cstdio>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "collectives/local.h"
#include "collectives/mpi.h"
#include "fsdp/fully_shard.h"
#include "nn/optim.h"
#include "nn/tensor_parallel.h"
#include "nn/transformer.h"
#include "program/main.h"

using dtensor::DTensor;
using kernels::DType;
using kernels::Tensor;

constexpr int kDp = 2, kTp = 2, kSteps = 6, kSeed = 7;
constexpr int64_t kBatch = 4, kSeq = 16;

// Next-token prediction on t[i+1] = (5 t[i] + 3) % V: a function of (step, row) only.
std::pair<Tensor, Tensor> batch(int step, int64_t vocab) {
  Tensor ids = Tensor::empty({kBatch, kSeq}, DType::kI64), targets = Tensor::empty({kBatch, kSeq}, DType::kI64);
  for (int64_t r = 0; r < kBatch; ++r) {
    int64_t t = (step * 131 + r * 17) % vocab;
    for (int64_t i = 0; i < kSeq; ++i) {
      ids.data<int64_t>()[r * kSeq + i] = t;
      t = (5 * t + 3) % vocab;
      targets.data<int64_t>()[r * kSeq + i] = t;
    }
  }
  return {ids, targets};
}

// Trains steps [first, last) and returns their losses; resumes from `load` when given and saves
// to `save` after the last step when given.
std::vector<double> train(collectives::Communicator& world, int first, int last, const std::string& load,
                          const std::string& save) {
  auto comms = std::make_shared<dtensor::MeshComms>(dtensor::DeviceMesh::from_shape({kDp, kTp}, {"dp_shard", "tp"}), world);
  nn::GPTConfig cfg;
  cfg.vocab = 64, cfg.dim = 32, cfg.heads = 4, cfg.layers = 2, cfg.max_seq = kSeq;
  nn::GPT model(nn::ModuleOptions{comms}, cfg);                           // meta: shapes only
  nn::parallelize_module(model, /*tp dim*/ 1, nn::gpt_tensor_parallel_plan(cfg));
  for (const auto& [name, block] : model.blocks().children()) fsdp::fully_shard(*block, comms);
  fsdp::fully_shard(model, comms);                                         // the root, last
  nn::materialize(model, kSeed);                                           // each rank: its shards
  nn::AdamW opt(model.named_parameters(), {.lr = 3e-3});
  auto state = [&] {
    nn::StateDict sd = model.state_dict();
    sd.merge(opt.state_dict(), "optim.");
    return sd;
  };
  if (!load.empty()) {
    opt.init_state();
    nn::StateDict sd = state();                                            // the shards to fill
    checkpoint::load(load, sd, world);                                     // resharding, verified
    opt.load_state_dict(sd.sub("optim."));
  }
  const dtensor::Placements data = dtensor::parse_placements("S(0),R");   // batch over dp
  auto split = [&](const Tensor& t) { return dtensor::distribute_tensor(t, comms, data, std::nullopt); };
  nn::CrossEntropyLoss loss_fn;
  std::vector<double> losses;
  for (int step = first; step < last; ++step) {
    auto [ids, targets] = batch(step, cfg.vocab);
    nn::Ctx ctx, lctx;
    DTensor loss = loss_fn.forward(lctx, model.forward(ctx, split(ids)), split(targets));
    losses.push_back(loss.full_tensor().item({}));
    model.backward(ctx, loss_fn.backward(lctx));                           // gradients arrive sharded
    nn::reduce_gradients(model.named_parameters());
    nn::clip_grad_norm_(model.named_parameters(), 1.0, 2.0, /*error_if_nonfinite=*/true);
    opt.step();
    opt.zero_grad();
  }
  if (!save.empty()) checkpoint::save(save, state(), world);
  return losses;
}

int run_rank(collectives::Communicator& world, const std::string& dir) {
  return program::run_as_rank("custom-trainer", world.rank(), [&] {
    const std::vector<double> whole = train(world, 0, kSteps, "", "");
    std::vector<double> resumed = train(world, 0, kSteps / 2, "", dir);
    const std::vector<double> rest = train(world, kSteps / 2, kSteps, dir, "");
    resumed.insert(resumed.end(), rest.begin(), rest.end());
    const bool same = resumed == whole && whole.back() < whole.front();
    if (world.rank() == 0)
      for (int s = 0; s < kSteps; ++s) std::printf("step %d loss %.8f resumed %.8f\n", s, whole[s], resumed[s]);
    if (world.rank() == 0) std::printf("custom-trainer: %s\n", same ? "ok" : "MISMATCH");
    return same ? program::kOk : program::kMismatch;
  });
}

int main(int argc, char** argv) {
  return program::run("custom-trainer", [&] {
    const std::string backend = argc > 1 ? argv[1] : "local", dir = argc > 2 ? argv[2] : "custom-trainer-ckpt";
    if (backend == "mpi") {
      collectives::MpiWorld mpi(&argc, &argv);
      return run_rank(*mpi.communicator(), dir + "/step-3");
    }
    if (backend != "local") throw kernels::InvalidArgument("backend '" + backend + "': expected local or mpi");
    std::vector<int> status(kDp * kTp);
    collectives::run_ranks(kDp * kTp, [&](collectives::Communicator& world) {
      status[world.rank()] = run_rank(world, dir + "/step-3");
    });
    return status[0];
  });
}
