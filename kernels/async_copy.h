// Page-locked ("pinned") host memory and host <-> device copies that return before they run, so
// a copy stream moves bytes while the compute stream computes (FSDP offload: fsdp/offload.h).
//
//   auto pinned = std::make_shared<PinnedHostAllocator>();
//   Tensor h = Tensor::empty({n}, DType::kF32, Device::cpu(), pinned);   // cudaHostAlloc'd
//   Tensor d = Tensor::empty({n}, DType::kF32, Device::cuda(0));
//   const Stream cs = Stream::copy(Device::cuda(0));
//   cs.wait(Event::record(Stream::compute(Device::cuda(0))));  // only if compute work wrote h/d
//   Event e = copy_async(d, h, cs);            // queued on cs; returns at once
//   Stream::compute(Device::cuda(0)).wait(e);  // kernels queued after this see d
//   e.synchronize();                           // before the host writes h again, or frees d
//
// On the CPU (both tensors host memory, the CPU stream) copy_async is a plain copy, done on
// return, and its event has completed. Host memory that is not pinned still works, but CUDA
// then stages it, and the call returns only once the host side has been read.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kernels/allocator.h"
#include "kernels/stream.h"
#include "kernels/tensor.h"

namespace kernels {

// Host blocks from cudaHostAlloc (portable: every GPU may copy from them without staging),
// returned with cudaFreeHost. REQUIRES: device is the CPU (InvalidArgument names it otherwise).
// Without CUDA in the build, allocate throws Unsupported. Allocating pinned memory is slow (it
// maps and locks pages): allocate long-lived state with it (FSDP's sharded parameters and
// gradients), not per-step buffers.
class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Device device) override;
  void deallocate(void* p, size_t nbytes, Device device) noexcept override;
  int64_t allocated_bytes() const;  // handed out and not yet given back

 private:
  std::atomic<int64_t> in_use_{0};
};

// Queues dst <- src on `stream` and returns an event that completes when the copy has run.
// REQUIRES: same shape and dtype, both contiguous; either both on the CPU (a plain copy, on the
// CPU stream), or one on the CPU and the other on stream's CUDA device. Nothing is ordered before
// the copy but the work already queued on `stream`: when the compute stream wrote the source (or
// last used the destination), make `stream` wait for it first (the example above). Both tensors
// must stay alive until the event has completed. Zero elements: nothing is queued but the event.
Event copy_async(const Tensor& dst, const Tensor& src, const Stream& stream);

}  // namespace kernels
