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

// A box of a rank's shard: global offsets and sizes, and where it starts in the local tensor.
struct Box {
  Dims offsets, sizes, local;
};

// The boxes of one rank's layout: the product over tensor dims of the runs of held indices
// (each run is contiguous in global coordinates and in local order).
std::vector<Box> boxes_of(const dtensor::ShardLayout& layout, const Dims& shape);

kernels::Tensor narrow_box(const kernels::Tensor& t, const Dims& start, const Dims& sizes);

// shard-{rank+1:05}-model-{slot+1:05}-of-{slots:05}.safetensors
std::string file_name(int rank, int slot, int slots);

}  // namespace checkpoint::detail
