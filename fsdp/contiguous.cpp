#include "fsdp/contiguous.h"

#include <fmt/format.h>

#include <algorithm>

#include "dtensor/layout.h"
#include "fsdp/group.h"
#include "kernels/checked.h"
#include "kernels/format.h"

namespace fsdp::detail {

int64_t ContiguousLayout::grad_begin(int64_t rank) const { return std::min(bounds[rank], grad_numel); }
int64_t ContiguousLayout::grad_size(int64_t rank) const {
  return std::min(bounds[rank + 1], grad_numel) - grad_begin(rank);
}
int64_t ContiguousLayout::overlap_start(size_t i, int64_t rank) const {
  return std::clamp(offsets[i], bounds[rank], bounds[rank + 1]);
}
int64_t ContiguousLayout::overlap_size(size_t i, int64_t rank) const {
  const int64_t end = std::clamp(offsets[i] + numels[i], bounds[rank], bounds[rank + 1]);
  return end - overlap_start(i, rank);
}

dtensor::Placement ContiguousLayout::flat_placement() const {
  return dtensor::RaggedShard{0, std::vector<int64_t>(static_cast<size_t>(dp()), 1), align};
}
dtensor::Placement ContiguousLayout::grad_flat_placement() const {
  std::vector<int64_t> units;
  for (int64_t r = 0; r < dp(); ++r) units.push_back(grad_size(r));
  return dtensor::RaggedShard{0, std::move(units), 1};
}
dtensor::Placement ContiguousLayout::param_placement(size_t i) const {
  std::vector<int64_t> units;
  for (int64_t r = 0; r < dp(); ++r) units.push_back(overlap_size(i, r));
  return dtensor::RaggedShard{0, std::move(units), 1};
}

int64_t contiguous_align(kernels::DType orig, kernels::DType param, kernels::DType reduce) {
  const int64_t narrowest = static_cast<int64_t>(
      std::min({kernels::itemsize(orig), kernels::itemsize(param), kernels::itemsize(reduce)}));
  return std::max<int64_t>(1, 16 / narrowest);
}

ContiguousLayout lay_out_contiguous(const std::vector<int64_t>& numels, size_t trainable, int64_t dp, int64_t align) {
  ContiguousLayout l;
  l.align = align;
  l.numels = numels;
  int64_t end = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t off = kernels::checked_mul(kernels::checked_ceil_div(end, align, "FSDP flat offset"), align,
                                             "FSDP flat offset");
    l.offsets.push_back(off);
    end = kernels::checked_add(off, numels[i], "FSDP flat buffer elements");
    if (i + 1 == trainable) l.grad_numel = end;
  }
  // N rounded up to whole dp x align blocks: every rank's range has N / dp elements, so the
  // all-gather and reduce-scatter take their equal-count forms (an uneven reduce-scatter stages
  // each peer's piece in a temporary before it sums them). The tail is zero, like the gaps.
  const int64_t block = kernels::checked_mul(dp, align, "FSDP flat block");
  l.numel = kernels::checked_mul(kernels::checked_ceil_div(end, block, "FSDP flat buffer elements"), block,
                                 "FSDP flat buffer elements");
  if (trainable == numels.size()) l.grad_numel = l.numel;  // all trainable: the same equal ranges
  l.bounds = dtensor::ragged_boundaries(l.numel, std::vector<int64_t>(static_cast<size_t>(dp), 1), align);
  return l;
}

}  // namespace fsdp::detail

namespace fsdp {

// Layout::kContiguous: the slots re-laid out parameter-major (fsdp/contiguous.h), each sharded
// parameter Rg(0,[its overlaps],1) of its global shape. The padded slot fields computed before
// are replaced.
void lay_out_contiguous(Group& g) {
  std::vector<int64_t> numels;
  for (const Slot& s : g.slots) {
    if (s.local_shape.product() == 0)
      throw Unsupported(fmt::format("fully_shard({}): parameter '{}' has no elements (shape {}): layout contiguous "
                                    "shards elements; ignore it (ignored_params) or use Layout::kPadded",
                                    g.name, s.name, kernels::to_string(s.local_shape)));
    numels.push_back(s.local_shape.product());
  }
  g.clayout = detail::lay_out_contiguous(numels, g.grad_slots, g.dp,
                                         detail::contiguous_align(g.orig_dtype, g.param_dtype, g.reduce_dtype));
  const detail::ContiguousLayout& l = *g.clayout;
  const int64_t me = g.my_coord;
  for (size_t i = 0; i < g.slots.size(); ++i) {
    Slot& s = g.slots[i];
    s.offset = s.unsharded_offset = l.offsets[i];
    s.padded_numel = l.numels[i];
    s.local_begin = l.overlap_start(i, me) - l.begin(me);
    s.local_numel = l.overlap_size(i, me);
    Placements p = s.unsharded_spec.placements;
    p[g.shard_mesh_dim] = l.param_placement(i);
    s.sharded_spec = dtensor::make_spec(mesh_ptr(g.comms), p, s.unsharded_spec.shape, s.unsharded_spec.dtype);
    Placements gp = s.unsharded_spec.placements;
    for (int m : g.dp_dims) gp[m] = dtensor::Partial{};
    s.grad_spec = dtensor::make_spec(mesh_ptr(g.comms), gp, s.unsharded_spec.shape, g.reduce_dtype);
  }
  g.slot_numel = l.size(me);
  g.flat_numel = g.unsharded_numel = l.numel;
  g.grad_numel = l.grad_size(me);
  g.grad_flat_numel = l.grad_numel;
}

// The flat reduce-scatter input, allocated at the group's first gradient write (or at its
// post-backward when backward wrote none here): the previous group's reduction is finished
// first, so its input is freed before this one exists (the padded layout holds the previous
// input only beside the gradients backward has produced so far; two whole flat inputs beside
// a block's activation gradients would be a higher peak). The gaps between parameters are zeroed
// (they are reduced too). Its dtype: the parameter dtype where that is narrower than the reduce
// dtype on a synchronising backward (one cast pass before the reduce-scatter, the size of
// padded's copy-in, instead of a reduce-dtype buffer alive through backward), else the reduce
// dtype (no-sync microbatches accumulate in it).
void Group::ensure_grad_in() {
  if (grad_in.defined()) return;
  if (rt && !is_follower) finish_pending_reductions();
  const DType dtype = requires_gradient_sync && kernels::itemsize(param_dtype) < kernels::itemsize(reduce_dtype)
                          ? param_dtype
                          : reduce_dtype;
  grad_in = Tensor::empty(Dims{clayout->grad_numel}, dtype, compute_device, buffer_alloc);
  for (size_t i = 0; i < grad_slots; ++i) {
    const int64_t end = i + 1 < grad_slots ? slots[i + 1].offset : clayout->grad_numel;
    const int64_t from = slots[i].offset + slots[i].padded_numel;
    if (end > from) grad_in.narrow(0, from, end - from).fill_(0.0);
  }
  grad_in_accumulating = false;
}

DTensor Group::grad_in_view(size_t i) const {
  const Slot& s = slots[i];
  const Tensor view = grad_in.narrow(0, s.offset, s.padded_numel).view(s.local_shape);
  if (grad_in.dtype() == s.grad_spec.dtype) return DTensor(comms, s.grad_spec, view);
  DTensorSpec spec = s.grad_spec;  // the bf16 buffer of a synchronising backward
  spec.dtype = grad_in.dtype();
  return DTensor(comms, spec, view);
}

// Before backward: every trainable parameter's gradient buffer is its view of the flat
// reduce-scatter input (Partial over dp), so backward writes the gradient there: over it for the
// first write of this sync window, added for tied weights and later no-sync microbatches. The
// input is allocated lazily (ensure_grad_in) unless earlier microbatches' sums are in it.
void Group::set_grad_buffers() {
  if (clayout->grad_numel == 0) return;  // (the global prefix: a rank with an empty range reduces too)
  for (size_t i = 0; i < grad_slots; ++i) {
    Slot& s = slots[i];
    if (!s.param->requires_grad) continue;
    if (grad_in.defined()) {
      s.param->set_grad_buffer(grad_in_view(i), grad_in_accumulating);
    } else {
      s.param->set_grad_buffer_lazy([this, i] {
        ensure_grad_in();
        return grad_in_view(i);
      });
    }
  }
}

// After backward: the gradients are already in grad_in. A parameter that got no gradient in
// this window contributes zeros.
void Group::post_backward_contiguous() {
  bool any = false;
  for (size_t i = 0; i < slots.size(); ++i) {
    check_frozen(i);
    any = any || slots[i].param->requires_grad;
  }
  // A synchronising backward reduces on every rank, even where backward wrote no gradient here.
  if (requires_gradient_sync && any && clayout->grad_numel > 0) ensure_grad_in();
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
    if (grad_in.defined() && i < grad_slots && s.param->requires_grad && !grad_in_accumulating &&
        s.param->grad_unwritten())
      grad_in.narrow(0, s.offset, s.padded_numel).fill_(0.0);
    s.param->zero_grad(/*set_to_none=*/true);  // (also drops a lazy buffer nobody wrote)
  }
  if (!requires_gradient_sync) {
    grad_in_accumulating = grad_in.defined();
    if (has_sharded_grad) install_grads();
    if (reshard_after_backward) reshard();
    return;
  }
  if (!any || !grad_in.defined()) {
    if (has_sharded_grad) install_grads();
    reshard();
    return;
  }
  if (rt && !is_follower)
    finish_pending_reductions();
  reshard();  // the reduction needs no unsharded parameter: freed before the cast allocates
  Tensor in = grad_in;
  grad_in = Tensor();
  grad_in_accumulating = false;
  if (in.dtype() != reduce_dtype) {  // the one cast pass (bf16 gradients, f32 reduction)
    Tensor cast = Tensor::empty(in.shape(), reduce_dtype, compute_device, buffer_alloc);
    {
      const kernels::TraceSpan span(tracer(), trace_pid(), "copies", "FSDP gradient cast");
      cast.copy_(in);
    }
    stats.copy_bytes += static_cast<int64_t>(cast.nbytes());
    in = cast;
  }
  DTensor flat_in(dp_comms, grad_flat_spec(filled(dp_ndim(), dtensor::Partial{}), reduce_dtype), in);
  issue_reduce(flat_in, in);
}

}  // namespace fsdp
