#include "kernels/async_copy.h"

#include <fmt/format.h>

#include "kernels/cuda/cuda_stream.h"
#include "kernels/error.h"
#include "kernels/format.h"

namespace kernels {

void* PinnedHostAllocator::allocate(size_t nbytes, Device device) {
  if (!device.is_cpu())
    throw InvalidArgument(fmt::format("PinnedHostAllocator: a block on {}: expected the CPU (pinned memory is host memory)",
                                      to_string(device)));
  void* p = detail::cuda_host_alloc(nbytes);
  in_use_ += static_cast<int64_t>(nbytes);
  return p;
}

void PinnedHostAllocator::deallocate(void* p, size_t nbytes, Device) noexcept {
  detail::cuda_host_free(p);
  in_use_ -= static_cast<int64_t>(nbytes);
}

int64_t PinnedHostAllocator::allocated_bytes() const { return in_use_.load(); }

Event copy_async(const Tensor& dst, const Tensor& src, const Stream& stream) {
  if (!dst.defined() || !src.defined()) throw InvalidArgument("copy_async: an undefined tensor");
  if (!(dst.shape() == src.shape()) || dst.dtype() != src.dtype())
    throw InvalidArgument(fmt::format("copy_async: source {} {} for destination {} {}: expected the same shape and dtype",
                                      to_string(src.dtype()), to_string(src.shape()), to_string(dst.dtype()),
                                      to_string(dst.shape())));
  if (!dst.is_contiguous() || !src.is_contiguous())
    throw InvalidArgument("copy_async: a strided operand: expected both contiguous");
  const Device dd = dst.device(), sd = src.device();
  if (dd.is_cpu() && sd.is_cpu()) {
    if (!stream.device().is_cpu())
      throw InvalidArgument(fmt::format("copy_async: a host-to-host copy on a stream of {}: expected the CPU stream",
                                        to_string(stream.device())));
    Tensor d = dst;  // a view of the same storage
    d.copy_(src);
    return Event::record(stream);
  }
  const Device gpu = dd.is_cuda() ? dd : sd;
  if ((dd.is_cuda() && sd.is_cuda()) || !(stream.device() == gpu))
    throw InvalidArgument(fmt::format("copy_async: {} -> {} on a stream of {}: expected one side on the CPU and the other "
                                      "on the stream's device",
                                      to_string(sd), to_string(dd), to_string(stream.device())));
  if (dst.nbytes() > 0)  // an empty tensor (FSDP's contiguous layout: a rank's empty range) has no pointer
    detail::cuda_memcpy_async_host(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                                   reinterpret_cast<void*>(stream.id()), gpu.index);
  return Event::record(stream);
}

}  // namespace kernels
