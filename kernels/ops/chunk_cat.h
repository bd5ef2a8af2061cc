// Fused packing of many tensors into one rank-major flat buffer and back (FSDP2's
// torch._chunk_cat for the reduce-scatter input and split_with_sizes_copy after the all-gather):
// one call (CPU: one pass over a few threads when large; CUDA: one kernel launch) instead of a
// strided copy per tensor and rank, with the dtype cast and the zero padding fused into it.
//
// Layout: tensor i is split into `chunks` pieces along dims[i] as torch.chunk / DTensor Shard
// do (piece c = rows [c * ceil(n / chunks), ...), the trailing pieces shorter or empty). Each
// piece sits in a slot of padded_shapes[i] = shapes[i] with dims[i] -> ceil(n / chunks),
// contiguous, the piece in the leading rows of that dim and zeros after it. Chunk c of the flat
// buffer is the slots of tensors 0, 1, ... in order (chunk_numel elements); chunks follow each
// other (c-major), so chunk c is what rank c of a reduce-scatter receives.
//
//   ChunkCatLayout l({{5, 3}, {4}}, {0, 0}, 2);   // slots [3,3] and [2]: chunk_numel 11
//   Tensor flat = Tensor::empty(Dims{l.numel()}, DType::kBF16);
//   chunk_cat(flat, {w, b}, l);   // flat = [w rows 0-2 | b 0-1 | w rows 3-4, 3 zeros | b 2-3]
//   split_copy({w2, b2}, flat, l);   // w2 == bf16(w), b2 == bf16(b) (cast back on the way out)
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/tensor.h"

namespace kernels {

class ChunkCatLayout {
 public:
  ChunkCatLayout() = default;
  // Throws InvalidArgument for chunks < 1, sizes of shapes and dims that differ, a 0-d shape
  // or a dim outside its shape (negative dims wrap).
  ChunkCatLayout(std::vector<Dims> shapes, std::vector<int> dims, int64_t chunks);
  // Every tensor split along dim 0.
  ChunkCatLayout(std::vector<Dims> shapes, int64_t chunks);

  int64_t chunks() const { return chunks_; }
  size_t size() const { return shapes_.size(); }
  const Dims& shape(size_t i) const { return shapes_[i]; }
  int dim(size_t i) const { return dims_[i]; }
  const Dims& padded_shape(size_t i) const { return padded_[i]; }
  // Element offset of tensor i's slot inside one chunk.
  int64_t offset(size_t i) const { return offsets_[i]; }
  // Elements of one chunk (every slot, padding included) and of the whole buffer.
  int64_t chunk_numel() const { return chunk_numel_; }
  int64_t numel() const { return chunks_ * chunk_numel_; }
  // Piece c of tensor i along dim(i): its first row and its number of rows.
  int64_t piece_offset(size_t i, int64_t c) const;
  int64_t piece_size(size_t i, int64_t c) const;

 private:
  int64_t chunks_ = 1;
  std::vector<Dims> shapes_, padded_;
  std::vector<int> dims_;
  std::vector<int64_t> offsets_;
  int64_t chunk_numel_ = 0;
};

// Up to how many threads a CPU chunk_cat / split_copy uses (the caller's and threads - 1 new
// ones): 0 picks by size (one thread below kParallelCopyBytes moved, else up to kMaxCopyThreads
// and the hardware's threads). The default is 1: on the shared 2-core machine more threads did
// not help (the copies are memory-bound; bench/RESULTS.md "Kernels"), and FSDP's ranks are
// already one thread or process each.
inline constexpr int64_t kParallelCopyBytes = int64_t{4} << 20;
inline constexpr int kMaxCopyThreads = 4;

// out = the layout's flat buffer of `inputs`, cast to out's dtype, padding zero. An undefined
// input contributes zeros (a missing gradient). REQUIRES / throws InvalidArgument unless: out
// is a contiguous 1-D tensor of layout.numel() elements; inputs.size() == layout.size(); every
// defined input has its layout shape (any strides, any dtype each), lives on out's device and
// does not overlap out.
void chunk_cat(const Tensor& out, const std::vector<Tensor>& inputs, const ChunkCatLayout& layout,
               int threads = 1);
// The inverse: every defined outputs[i] = its pieces of `flat`, cast to its dtype (padding
// dropped); undefined outputs are skipped. Same checks, with outputs writable and not
// overlapping flat. REQUIRES: the outputs do not overlap one another.
void split_copy(const std::vector<Tensor>& outputs, const Tensor& flat, const ChunkCatLayout& layout,
                int threads = 1);

}  // namespace kernels
