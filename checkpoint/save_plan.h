// Internal to checkpoint/: which rank writes which chunk, and the files it writes them to.
//
// Each rank plans only its own part (make_local_save_plan): the boxes of its own layout. A box
// replicated over r ranks (those that differ from this one only along mesh dims that replicate
// the tensor) goes to one replica index by a greedy within its replica group: keys on one mesh
// replicated along the same mesh dims form a group, and every box of the group, in key order, goes
// to the index with the fewest bytes so far (lowest on ties). Every replica holds the same boxes of
// every key of the group, so all compute the same choice: each chunk is written exactly once,
// without listing any other rank's layout, in work of this rank's boxes times log of their number.
// Rank 0 assembles checkpoint.json from what the ranks report (save.cpp).
//
//   HSDP [R, S(0)] on a (2, 4) mesh, keys of equal size: rank (0, j) writes row block j of keys
//   0, 2, 4, ...; rank (1, j) those of keys 1, 3, 5, ... (one box per key per rank, two replicas).
//
// make_save_plan_by_rank is the former whole-world plan (every rank's layout, each replicated
// chunk to the least-loaded holder over all keys so far): the tests' reference on small meshes.
// The two choose the same writers when all replicated keys of a mesh form one group (FSDP, HSDP,
// fully replicated); where groups mix they may differ (tests/checkpoint/save_plan_test.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/shared.h"
#include "dtensor/spec.h"

namespace checkpoint::detail {

using SpecList = std::vector<std::pair<std::string, dtensor::DTensorSpec>>;
SpecList specs_of(const nn::StateDict& sd);

struct PlannedChunk {
  size_t key = 0;
  Box box;           // box.local: in the owner's local tensor
  int owner = 0;     // world rank
  int slot = 0;      // file index of the owner
  uint64_t nbytes = 0;
  Dims block_shape;  // empty: no block checksums (detail::choose_block_shape)
  int64_t blocks = 0;
};

struct FilePlan {
  std::string name;
  int owner = 0;
  int slot = 0;
  std::vector<size_t> chunks;     // indices into SavePlan::chunks, in file order
  std::vector<uint64_t> offsets;  // absolute byte offset of each chunk
  std::string header;             // the 8-byte length is written before it
  uint64_t size = 0;
};

struct SavePlan {
  std::vector<PlannedChunk> chunks;  // in key order, then box order
  std::vector<FilePlan> files;       // per owner (ascending), per slot
  uint64_t hash = 0;                 // of the keys, shapes, dtypes, placements and meshes
};

// This rank's chunks and files. Throws InvalidArgument for a repeated key, a Partial tensor, a
// dtype safetensors cannot hold, or a mesh naming a rank >= world_size. Work: the keys and this
// rank's boxes, never the other ranks' layouts.
SavePlan make_local_save_plan(const SpecList& specs, int rank, int world_size, uint64_t block_bytes);

// Every rank's chunks and files from every rank's layout (the reference; O(world) layouts per key).
SavePlan make_save_plan_by_rank(const SpecList& specs, int world_size, uint64_t block_bytes);

}  // namespace checkpoint::detail
