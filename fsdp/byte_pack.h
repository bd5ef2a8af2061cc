// Internal to fsdp/: the per-rank byte buffer of a group with all-gather extensions. Each
// parameter contributes pieces (an extension's gathered tensors, or the plain padded shard in
// param_dtype), each at an offset aligned to kPieceAlign bytes; every rank's buffer has the same
// layout, so one S(0) -> R of the u8 buffer gathers them all.
//
//   slots: w [10,4] fp8-extended (12 codes per rank), b [4] plain bf16 (padded 1 per rank)
//   layout: w.q at bytes [0, 12), b at [16, 18); rank_bytes 32 (aligned)
#pragma once

#include <any>
#include <memory>
#include <vector>

#include "fsdp/all_gather_extension.h"
#include "kernels/allocator.h"
#include "kernels/tensor.h"

namespace fsdp::detail {

inline constexpr int64_t kPieceAlign = 16;

struct BytePiece {
  kernels::DType dtype = kernels::DType::kU8;
  kernels::Dims shape;
  int64_t offset = 0;  // in the rank's buffer, bytes
  int64_t bytes = 0;
};

struct ByteSlot {
  std::shared_ptr<AllGatherExtension> ext;  // null: the plain padded shard in param_dtype
  AllGatherContext ctx;
  std::vector<BytePiece> pieces;
  std::any metadata;  // of the unshard in flight
};

// Lays the pieces out (plain: {param_dtype, padded_shape}; extended: ext->gather_inputs) and
// returns the bytes of one rank's buffer. Throws InvalidArgument naming the parameter for an
// extension declaring no input or a non-positive shape entry.
int64_t lay_out(std::vector<ByteSlot>& slots, kernels::DType param_dtype);

// A typed view of `bytes` (u8, contiguous, offset 0 in its storage) at byte offset `offset`.
// REQUIRES: offset a multiple of itemsize(dtype), the view inside the storage.
kernels::Tensor view_bytes(const kernels::Tensor& bytes, int64_t offset, kernels::DType dtype, const kernels::Dims& shape);

// Copy-in: rank_buf (u8 [rank_bytes], zeroed by the caller) gets every slot's pieces from its
// padded shard (padded[i]: ctx.padded_shape, orig dtype). Runs the extensions' pre_all_gather in
// slot order (their collectives in the same order on every rank) and checks what they return
// against their declared inputs (InvalidArgument naming the parameter). Returns the bytes the
// extensions' collectives sent.
int64_t pack(std::vector<ByteSlot>& slots, const std::vector<kernels::Tensor>& padded, kernels::Tensor& rank_buf);

// Copy-out: from the gathered buffer (u8 [dp * rank_bytes], rank-major) into each slot's
// unsharded local tensor outs[i] (ctx.local_shape, param_dtype): plain slots by rows, extended
// ones through post_all_gather on their gathered inputs (rank pieces concatenated; storage from
// `alloc`).
void unpack(std::vector<ByteSlot>& slots, const kernels::Tensor& gathered, int64_t rank_bytes, int64_t dp,
            kernels::DType param_dtype, std::vector<kernels::Tensor>& outs,
            const std::shared_ptr<kernels::Allocator>& alloc);

}  // namespace fsdp::detail
