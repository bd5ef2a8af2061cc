#include "kernels/ops/chunk_cat.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "kernels/cpu/copy.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/detail/copy_batch.h"
#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/ops/common.h"

namespace kernels {

using detail::CopyItem;

ChunkCatLayout::ChunkCatLayout(std::vector<Dims> shapes, int64_t chunks)
    : ChunkCatLayout(shapes, std::vector<int>(shapes.size(), 0), chunks) {}

ChunkCatLayout::ChunkCatLayout(std::vector<Dims> shapes, std::vector<int> dims, int64_t chunks)
    : chunks_(chunks), shapes_(std::move(shapes)), dims_(std::move(dims)) {
  if (chunks_ < 1) throw InvalidArgument(fmt::format("ChunkCatLayout: {} chunks, expected >= 1", chunks_));
  if (dims_.size() != shapes_.size())
    throw InvalidArgument(
        fmt::format("ChunkCatLayout: {} shapes but {} dims, expected one dim per shape", shapes_.size(), dims_.size()));
  for (size_t i = 0; i < shapes_.size(); ++i) {
    const int nd = shapes_[i].size();
    if (nd == 0) throw InvalidArgument(fmt::format("ChunkCatLayout: tensor {} is 0-d, expected a dim to split", i));
    for (int64_t s : shapes_[i])
      if (s < 0) throw InvalidArgument(fmt::format("ChunkCatLayout: tensor {} has shape {}", i, shapes_[i]));
    int d = dims_[i] < 0 ? dims_[i] + nd : dims_[i];
    if (d < 0 || d >= nd)
      throw InvalidArgument(fmt::format("ChunkCatLayout: dim {} for tensor {} of shape {}: expected -{}..{}",
                                        dims_[i], i, shapes_[i], nd, nd - 1));
    dims_[i] = d;
    Dims p = shapes_[i];
    p[d] = (p[d] + chunks_ - 1) / chunks_;
    padded_.push_back(p);
    offsets_.push_back(chunk_numel_);
    chunk_numel_ = checked_add(chunk_numel_, p.product(), "ChunkCatLayout element count");
  }
  (void)checked_mul(chunk_numel_, chunks_, "ChunkCatLayout element count");
}

// The rule of dtensor::chunk (torch.chunk with trailing empty pieces).
int64_t ChunkCatLayout::piece_offset(size_t i, int64_t c) const {
  const int64_t n = shapes_[i][dims_[i]];
  return std::min(n, c * padded_[i][dims_[i]]);
}
int64_t ChunkCatLayout::piece_size(size_t i, int64_t c) const {
  const int64_t n = shapes_[i][dims_[i]];
  return std::min(n - piece_offset(i, c), padded_[i][dims_[i]]);
}

namespace {

void check_flat(const char* op, const Tensor& flat, const char* name, const ChunkCatLayout& layout) {
  detail::check_defined(op, flat, name);
  if (flat.ndim() != 1 || flat.numel() != layout.numel() || !flat.is_contiguous())
    throw InvalidArgument(fmt::format("{}: {} has shape {} (contiguous: {}), expected a contiguous [{}] ({} chunks of {})",
                                      op, name, flat.shape(), flat.is_contiguous(), layout.numel(), layout.chunks(),
                                      layout.chunk_numel()));
}

void check_member(const char* op, const Tensor& t, size_t i, const char* what, const Tensor& flat,
                  const ChunkCatLayout& layout) {
  if (!(t.shape() == layout.shape(i)))
    throw InvalidArgument(fmt::format("{}: {} {} has shape {}, expected the layout's {}", op, what, i, t.shape(),
                                      layout.shape(i)));
  if (t.device() != flat.device())
    throw InvalidArgument(fmt::format("{}: {} {} is on {}, expected the flat buffer's device {}", op, what, i,
                                      to_string(t.device()), to_string(flat.device())));
  if (detail::may_overlap(t, flat))
    throw InvalidArgument(fmt::format("{}: {} {} overlaps the flat buffer", op, what, i));
}

char* at(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.data_ptr()) + elements * static_cast<int64_t>(itemsize(t.dtype()));
}

Dims with(Dims d, int i, int64_t v) {
  d[i] = v;
  return d;
}

void run(const std::vector<CopyItem>& items, Device device, int threads) {
  if (device.is_cuda()) {
    detail::cuda_copy_batch(items, device.index);
    return;
  }
  if (threads <= 0) {
    int64_t bytes = 0;
    for (const CopyItem& it : items)
      bytes += it.shape.product() *
               static_cast<int64_t>(itemsize(it.dst_dtype) + (it.src ? itemsize(it.src_dtype) : 0));
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    threads = bytes < kParallelCopyBytes ? 1 : std::min(kMaxCopyThreads, hw);
  }
  detail::cpu_copy_batch(items, threads);
}

}  // namespace

void chunk_cat(const Tensor& out, const std::vector<Tensor>& inputs, const ChunkCatLayout& layout, int threads) {
  constexpr const char* kOp = "chunk_cat";
  check_flat(kOp, out, "out", layout);
  if (inputs.size() != layout.size())
    throw InvalidArgument(fmt::format("{}: {} inputs, expected the layout's {}", kOp, inputs.size(), layout.size()));
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].defined()) check_member(kOp, inputs[i], i, "input", out, layout);
  if (out.numel() == 0) return;
  std::vector<CopyItem> items;
  items.reserve(static_cast<size_t>(layout.chunks()) * layout.size() * 2);
  const DType odt = out.dtype();
  for (int64_t c = 0; c < layout.chunks(); ++c) {
    for (size_t i = 0; i < layout.size(); ++i) {
      const Dims& padded = layout.padded_shape(i);
      if (padded.product() == 0) continue;
      const int d = layout.dim(i);
      const Dims pstrides = Tensor::contiguous_strides(padded);
      char* slot = at(out, c * layout.chunk_numel() + layout.offset(i));
      const Tensor& in = inputs[i];
      const int64_t rows = in.defined() ? layout.piece_size(i, c) : 0;
      if (rows > 0) {
        CopyItem it;
        it.dst = slot;
        it.dst_dtype = odt;
        it.dst_strides = pstrides;
        it.src = at(in, layout.piece_offset(i, c) * in.strides()[d]);
        it.src_dtype = in.dtype();
        it.src_strides = in.strides();
        it.shape = with(layout.shape(i), d, rows);
        items.push_back(it);
      }
      if (rows < padded[d]) {
        CopyItem z;
        z.dst = slot + rows * pstrides[d] * static_cast<int64_t>(itemsize(odt));
        z.dst_dtype = odt;
        z.dst_strides = pstrides;
        z.shape = with(padded, d, padded[d] - rows);
        items.push_back(z);
      }
    }
  }
  run(items, out.device(), threads);
}

void split_copy(const std::vector<Tensor>& outputs, const Tensor& flat, const ChunkCatLayout& layout, int threads) {
  constexpr const char* kOp = "split_copy";
  check_flat(kOp, flat, "flat", layout);
  if (outputs.size() != layout.size())
    throw InvalidArgument(fmt::format("{}: {} outputs, expected the layout's {}", kOp, outputs.size(), layout.size()));
  for (size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].defined()) {
      check_member(kOp, outputs[i], i, "output", flat, layout);
      detail::check_writable(kOp, outputs[i], "an output");
    }
  if (flat.numel() == 0) return;
  std::vector<CopyItem> items;
  items.reserve(static_cast<size_t>(layout.chunks()) * layout.size());
  for (int64_t c = 0; c < layout.chunks(); ++c) {
    for (size_t i = 0; i < layout.size(); ++i) {
      const Tensor& o = outputs[i];
      const int64_t rows = layout.piece_size(i, c);
      if (!o.defined() || rows == 0 || layout.padded_shape(i).product() == 0) continue;
      const int d = layout.dim(i);
      CopyItem it;
      it.dst = at(o, layout.piece_offset(i, c) * o.strides()[d]);
      it.dst_dtype = o.dtype();
      it.dst_strides = o.strides();
      it.src = at(flat, c * layout.chunk_numel() + layout.offset(i));
      it.src_dtype = flat.dtype();
      it.src_strides = Tensor::contiguous_strides(layout.padded_shape(i));
      it.shape = with(layout.shape(i), d, rows);
      items.push_back(it);
    }
  }
  run(items, flat.device(), threads);
}

}  // namespace kernels
