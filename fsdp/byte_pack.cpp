#include "fsdp/byte_pack.h"

#include <fmt/format.h>

#include "kernels/checked.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/storage.h"

namespace fsdp::detail {

using kernels::Dims;
using kernels::DType;
using kernels::InvalidArgument;
using kernels::Tensor;

int64_t lay_out(std::vector<ByteSlot>& slots, DType param_dtype) {
  int64_t offset = 0;
  for (ByteSlot& s : slots) {
    std::vector<GatherInput> inputs;
    if (s.ext) {
      inputs = s.ext->gather_inputs(s.ctx);
      if (inputs.empty())
        throw InvalidArgument(fmt::format("all-gather extension '{}' of parameter '{}' declares no input to gather",
                                          s.ext->name(), s.ctx.name));
    } else {
      inputs = {GatherInput{param_dtype, s.ctx.padded_shape}};
    }
    s.pieces.clear();
    for (const GatherInput& in : inputs) {
      if (in.shape.size() == 0 || in.shape[0] <= 0)
        throw InvalidArgument(fmt::format(
            "all-gather extension '{}' of parameter '{}': input shape {}: expected at least one dim, the first >= 1",
            s.ext ? s.ext->name() : "", s.ctx.name, kernels::to_string(in.shape)));
      BytePiece p;
      p.dtype = in.dtype;
      p.shape = in.shape;
      p.offset = offset;
      p.bytes = kernels::checked_bytes(kernels::checked_product(in.shape, "gathered elements"),
                                       kernels::itemsize(in.dtype), "gathered bytes");
      const int64_t end = kernels::checked_add(offset, p.bytes, "gathered bytes");
      offset = kernels::checked_mul(kernels::checked_ceil_div(end, kPieceAlign, "gathered bytes"), kPieceAlign,
                                    "gathered bytes");
      s.pieces.push_back(std::move(p));
    }
  }
  return offset;
}

Tensor view_bytes(const Tensor& bytes, int64_t offset, DType dtype, const Dims& shape) {
  const auto item = static_cast<int64_t>(kernels::itemsize(dtype));
  if (offset % item != 0 || bytes.storage_offset() != 0)
    throw kernels::InternalError(fmt::format("view_bytes: offset {} not aligned to {}", offset, item));
  return Tensor::from_storage(bytes.storage(), dtype, shape, Tensor::contiguous_strides(shape), offset / item);
}

int64_t pack(std::vector<ByteSlot>& slots, const std::vector<Tensor>& padded, Tensor& rank_buf) {
  int64_t sent = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    ByteSlot& s = slots[i];
    if (!s.ext) {
      Tensor dst = view_bytes(rank_buf, s.pieces[0].offset, s.pieces[0].dtype, s.pieces[0].shape);
      dst.copy_(padded[i]);  // the cast to param_dtype (and offload's device move)
      continue;
    }
    PreAllGatherResult r = s.ext->pre_all_gather(padded[i], s.ctx);
    if (r.inputs.size() != s.pieces.size())
      throw InvalidArgument(fmt::format("all-gather extension '{}' of parameter '{}' returned {} inputs, declared {}",
                                        s.ext->name(), s.ctx.name, r.inputs.size(), s.pieces.size()));
    for (size_t j = 0; j < r.inputs.size(); ++j) {
      const BytePiece& p = s.pieces[j];
      if (r.inputs[j].dtype() != p.dtype || !(r.inputs[j].shape() == p.shape))
        throw InvalidArgument(fmt::format(
            "all-gather extension '{}' of parameter '{}': input {} is {} {}, declared {} {}", s.ext->name(),
            s.ctx.name, j, kernels::to_string(r.inputs[j].dtype()), kernels::to_string(r.inputs[j].shape()),
            kernels::to_string(p.dtype), kernels::to_string(p.shape)));
      Tensor dst = view_bytes(rank_buf, p.offset, p.dtype, p.shape);
      dst.copy_(r.inputs[j]);
    }
    s.metadata = std::move(r.metadata);
    sent += r.communicated_bytes;
  }
  return sent;
}

void unpack(std::vector<ByteSlot>& slots, const Tensor& gathered, int64_t rank_bytes, int64_t dp, DType param_dtype,
            std::vector<Tensor>& outs, const std::shared_ptr<kernels::Allocator>& alloc) {
  for (size_t i = 0; i < slots.size(); ++i) {
    ByteSlot& s = slots[i];
    const AllGatherContext& c = s.ctx;
    if (!s.ext) {
      const BytePiece& p = s.pieces[0];
      for (int64_t d = 0; d < dp; ++d) {
        const dtensor::Chunk& ch = c.chunks[static_cast<size_t>(d)];
        if (ch.size == 0) continue;
        Tensor src = view_bytes(gathered, d * rank_bytes + p.offset, param_dtype, p.shape).narrow(c.shard_dim, 0, ch.size);
        outs[i].narrow(c.shard_dim, ch.offset, ch.size).copy_(src);
      }
      continue;
    }
    std::vector<Tensor> inputs;
    for (const BytePiece& p : s.pieces) {
      Tensor all = Tensor::empty(Dims{dp * p.bytes}, DType::kU8, gathered.device(), alloc);
      for (int64_t d = 0; d < dp; ++d)
        all.narrow(0, d * p.bytes, p.bytes).copy_(gathered.narrow(0, d * rank_bytes + p.offset, p.bytes));
      Dims shape = p.shape;
      shape[0] = dp * p.shape[0];
      inputs.push_back(view_bytes(all, 0, p.dtype, shape));
    }
    s.ext->post_all_gather(inputs, s.metadata, param_dtype, outs[i], c);
    s.metadata.reset();
  }
}

}  // namespace fsdp::detail
