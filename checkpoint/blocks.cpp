// Checksums: xxh64 (libxxhash) of chunks and of the blocks of a chunk (internal.h).
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <memory>

#include "checkpoint/internal.h"
#include "kernels/error.h"

namespace checkpoint {

uint64_t xxh64(const void* data, size_t n, uint64_t seed) {
  return XXH64(n > 0 ? data : nullptr, n, seed);
}

namespace detail {

int64_t BlockRange::total() const { return count.product(); }

BlockRange block_range(const Dims& offsets, const Dims& sizes, const Dims& block_shape) {
  BlockRange r;
  for (int d = 0; d < offsets.size(); ++d) {
    const int64_t first = offsets[d] / block_shape[d];
    const int64_t last = (offsets[d] + sizes[d] - 1) / block_shape[d];
    r.first.push_back(first);
    r.count.push_back(last - first + 1);
  }
  return r;
}

Dims choose_block_shape(const Dims& sizes, uint64_t itemsize, uint64_t block_bytes) {
  const int nd = sizes.size();
  if (block_bytes == 0 || nd == 0) return {};
  uint64_t elems = 1;
  for (int d = 0; d < nd; ++d) {
    if (sizes[d] == 0) return {};
    if (__builtin_mul_overflow(elems, static_cast<uint64_t>(sizes[d]), &elems)) elems = UINT64_MAX;
  }
  uint64_t chunk_bytes = 0;
  if (__builtin_mul_overflow(elems, itemsize, &chunk_bytes)) chunk_bytes = UINT64_MAX;
  const uint64_t floor = std::min(kMinBlockBytes, block_bytes);
  const uint64_t target = std::clamp(chunk_bytes / kMinBlocksPerChunk, floor, block_bytes);
  if (chunk_bytes <= target) return {};
  Dims b;
  for (int d = 0; d < nd; ++d) b.push_back(static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(sizes[d]))));
  auto block_elems = [&] {  // saturating: the rounded-up extents may not fit a product
    uint64_t p = 1;
    for (int d = 0; d < nd; ++d)
      if (__builtin_mul_overflow(p, static_cast<uint64_t>(b[d]), &p)) return UINT64_MAX;
    return p;
  };
  while (block_elems() > std::max<uint64_t>(target / itemsize, 1)) {
    int widest = 0;
    for (int d = 1; d < nd; ++d)
      if (b[d] > b[widest]) widest = d;
    if (b[widest] == 1) break;
    b[widest] /= 2;
  }
  return b;
}

void block_box(const Dims& block, const Dims& chunk_off, const Dims& chunk_sizes, const Dims& block_shape, Dims& off,
               Dims& sizes) {
  const int nd = block.size();
  off = Dims::filled(nd, 0);
  sizes = Dims::filled(nd, 0);
  for (int d = 0; d < nd; ++d) {
    // [block * b, block * b + b) clipped to the chunk; block * b <= the chunk's end (no overflow).
    const int64_t start = block[d] * block_shape[d];
    const int64_t end = chunk_off[d] + chunk_sizes[d];
    off[d] = std::max(start, chunk_off[d]);
    sizes[d] = (end - start > block_shape[d] ? start + block_shape[d] : end) - off[d];
  }
}

void hash_blocks(const void* buf, const Dims& buf_off, const Dims& buf_sizes, uint64_t itemsize,
                 const Dims& chunk_off, const Dims& chunk_sizes, const Dims& block_shape, const BlockRange& range,
                 const std::function<void(const Dims& block, uint64_t hash)>& fn) {
  const int nd = buf_off.size();
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(), &XXH64_freeState);
  if (!state) throw kernels::ResourceError("checkpoint: cannot allocate an xxh64 state");
  const char* base = static_cast<const char*>(buf);
  Dims idx = Dims::filled(nd, 0), block(range.first), off, sizes, rel;
  if (range.total() == 0) return;
  while (true) {
    for (int d = 0; d < nd; ++d) block[d] = range.first[d] + idx[d];
    block_box(block, chunk_off, chunk_sizes, block_shape, off, sizes);
    rel = off;
    for (int d = 0; d < nd; ++d) rel[d] = off[d] - buf_off[d];
    XXH64_reset(state.get(), 0);
    for_each_run(buf_sizes, rel, sizes, [&](int64_t elem, int64_t n) {
      XXH64_update(state.get(), base + static_cast<uint64_t>(elem) * itemsize, static_cast<uint64_t>(n) * itemsize);
    });
    fn(block, XXH64_digest(state.get()));
    int d = nd - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < range.count[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace detail
}  // namespace checkpoint
