// Internal to checkpoint/ (save.cpp, load.cpp, save_plan.cpp): failures carried through an
// agreement, the gathers every rank takes part in, and the boxes of a rank's shard. Not for users.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "dtensor/layout.h"

namespace checkpoint::detail {

inline constexpr const char* kTmpSuffix = ".tmp";
inline constexpr const char* kWriterKey = "dtensor_runtime";  // our files' __metadata__ marker

double seconds_since(std::chrono::steady_clock::time_point t0);

// ---- failures carried through an agreement ----

// The exit class of a failure (program/main.h's table), carried to every rank so that each
// rethrows the class the failing rank met: a full disk on rank 3 is a ResourceError everywhere.
enum Kind : int64_t { kOk = 0, kOther = 1, kInvalid = 2, kResource = 3, kComm = 4 };

struct Failure {
  int64_t kind = kOk;
  std::string message;
};

Failure capture(const std::exception_ptr& e);
[[noreturn]] void raise(int64_t kind, const std::string& message);

// Agreement after a phase that may fail on some ranks: every rank learns whether any failed,
// the class of the first failure and its message (so every rank's exception names the key and
// the cause). Returns kind kOk when all succeeded. Collective over world.
Failure agree(collectives::Communicator& world, const Failure& mine, kernels::Device device);

// Gathers one int64 row per rank (all the same length) over world.
std::vector<int64_t> all_gather_rows(collectives::Communicator& world, const std::vector<int64_t>& row,
                                     kernels::Device device);

// The world communicator's device (nccl moves device memory only).
kernels::Device comm_device(const nn::StateDict& sd);

void sync_dir(const std::string& dir);

// ---- boxes ----

// A box of a rank's shard: global offsets and sizes (the tensor's dims), and where it starts in
// the local tensor (the local tensor's dims: with a RaggedShard(d) over dims d..n-1 of an n-d
// tensor, d + 1 of them, the last the box's first position in the rank's flat range).
struct Box {
  Dims offsets, sizes, local;
};

// The boxes of one rank's layout of a tensor of `shape`: the product over tensor dims of the
// runs of held indices (each run is contiguous in global coordinates and in local order). A
// layout of a RaggedShard's view (fewer dims than `shape`, NOTE [ragged view]) has its flat
// runs cut by dtensor::flat_range_boxes: per run of the dims before d, a partial first row,
// full rows and a partial last row, at most 2 (n - d) - 1 boxes.
//   shape (3,4) under Rg(0,[1,1],1) on 2 ranks, rank 0 holds flat [0, 6):
//     offsets (0,0) sizes (1,4) local (0); offsets (1,0) sizes (1,2) local (4)
// REQUIRES: layout is compute_layout's for `shape` (and the placements it was computed for).
std::vector<Box> boxes_of(const dtensor::ShardLayout& layout, const Dims& shape);

kernels::Tensor narrow_box(const kernels::Tensor& t, const Dims& start, const Dims& sizes);
// The view of `local` (a rank's local tensor) that holds box b, shaped as b.sizes: narrow_box
// for a box of the tensor's own dims; for a ragged box the narrowed flat dim viewed as the
// box's trailing dims (one contiguous range of the flattening, so always a view).
kernels::Tensor box_view(const kernels::Tensor& local, const Box& b);

// shard-{rank+1:05}-model-{slot+1:05}-of-{slots:05}.safetensors
std::string file_name(int rank, int slot, int slots);

}  // namespace checkpoint::detail
