// Internal to checkpoint/ (save.cpp, load.cpp, metadata.cpp, coverage.cpp): block checksums, the
// runs of a box inside a row-major buffer, and the coverage check. Not for users.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"

namespace checkpoint::detail {

// ---- contiguous runs ----

// Calls fn(first_element, elements) for each contiguous run, in row-major order, of the box
// `sub_sizes` at `sub_off` inside a contiguous row-major buffer of sizes `outer`. Runs merge
// across the inner dims the box spans whole.
//   for_each_run({4, 6}, {1, 2}, {2, 3}, fn)   calls fn(8, 3), fn(14, 3)
//   for_each_run({4, 6}, {1, 0}, {2, 6}, fn)   calls fn(6, 12)
// REQUIRES: the box lies inside `outer`. Nothing is called for an empty box.
template <class F>
void for_each_run(const Dims& outer, const Dims& sub_off, const Dims& sub_sizes, F&& fn) {
  const int nd = outer.size();
  for (int d = 0; d < nd; ++d)
    if (sub_sizes[d] == 0) return;
  int inner = nd;  // dims [inner, nd) are spanned whole
  while (inner > 0 && sub_sizes[inner - 1] == outer[inner - 1]) --inner;
  Dims stride = Dims::filled(nd, 1);
  for (int d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * outer[d + 1];
  // A run: dims [inner, nd) whole, times the box's extent in dim inner - 1 (when there is one).
  int64_t run = 1;
  for (int d = inner; d < nd; ++d) run *= outer[d];
  const int loop_dims = inner > 0 ? inner - 1 : 0;  // dims iterated one index at a time
  int64_t base = 0;
  if (inner > 0) {
    run *= sub_sizes[inner - 1];
    base = sub_off[inner - 1] * stride[inner - 1];
  }
  Dims idx = Dims::filled(loop_dims, 0);
  while (true) {
    int64_t elem = base;
    for (int d = 0; d < loop_dims; ++d) elem += (sub_off[d] + idx[d]) * stride[d];
    fn(elem, run);
    int d = loop_dims - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < sub_sizes[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

// ---- block checksums ----

// The blocks of a chunk: the chunk cut by the grid of `block_shape` anchored at the tensor's
// origin (global index 0), so two chunks' blocks line up and a cut at a multiple of the block
// extent costs no extra read. In dim d the chunk [o, o + s) meets blocks o / b .. (o + s - 1) / b.
struct BlockRange {
  Dims first;  // the first block index, per dim
  Dims count;  // blocks, per dim
  int64_t total() const;
};
// REQUIRES: every size > 0, every block extent > 0.
BlockRange block_range(const Dims& offsets, const Dims& sizes, const Dims& block_shape);

// The block shape a writer records for a chunk: power-of-two extents, starting from the chunk's
// sizes rounded up, halving the largest extent (the first of equal ones) until a block holds at
// most `target` bytes, where target = chunk bytes / kMinBlocksPerChunk clamped to
// [min(kMinBlockBytes, block_bytes), block_bytes]: big chunks get blocks of block_bytes, smaller
// ones at least about kMinBlocksPerChunk blocks (about 16 per dim of a matrix) down to 4 KiB, so
// a cut costs a small fraction of the part read either way. Empty (no block checksums: the chunk
// checksum serves) when the chunk holds at most `target`, has no dims, or block_bytes is 0.
//   choose_block_shape({4096, 4096}, 4, 65536)  == {128, 128}   (64 MiB: 64 KiB blocks)
//   choose_block_shape({1366, 4096}, 4, 65536)  == {128, 128}
//   choose_block_shape({512, 512}, 4, 65536)    == {32, 32}     (1 MiB: 4 KiB blocks, 256 of them)
//   choose_block_shape({100000}, 4, 65536)      == {1024}       (400 KB: 4 KiB blocks)
//   choose_block_shape({1024}, 4, 65536)        == {}           (4 KiB: the chunk checksum only)
inline constexpr uint64_t kMinBlockBytes = 4096;
inline constexpr uint64_t kMinBlocksPerChunk = 256;
Dims choose_block_shape(const Dims& sizes, uint64_t itemsize, uint64_t block_bytes);

// xxh64 of each block of `range` that lies inside a buffer box: the buffer holds the global box
// [buf_off, buf_off + buf_sizes) row-major, contiguous; each block's elements are hashed in
// row-major order (as if copied out contiguous). `chunk_off`/`chunk_sizes` clip the blocks at
// the chunk's edges. Calls fn(block index tuple, hash) in row-major order of `range`.
// REQUIRES: every block of `range`, clipped to the chunk, lies inside the buffer box.
void hash_blocks(const void* buf, const Dims& buf_off, const Dims& buf_sizes, uint64_t itemsize,
                 const Dims& chunk_off, const Dims& chunk_sizes, const Dims& block_shape, const BlockRange& range,
                 const std::function<void(const Dims& block, uint64_t hash)>& fn);

// The global box of block `block` (an index tuple) of a chunk, clipped to the chunk.
void block_box(const Dims& block, const Dims& chunk_off, const Dims& chunk_sizes, const Dims& block_shape, Dims& off,
               Dims& sizes);

// ---- coverage ----

// Checks that a tensor's chunks tile its global shape: each inside it (no overflow), pairwise
// disjoint, and together covering every element. Throws InvalidArgument naming the directory,
// the key and the offending chunks (or region). O(n log n) in the number of chunks for chunks
// a straight cut (guillotine) separates, which every DTensor layout gives (coverage.cpp).
void check_coverage(const std::string& dir, const std::string& key, const TensorInfo& ti);

}  // namespace checkpoint::detail
