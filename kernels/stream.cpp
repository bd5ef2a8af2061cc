#include "kernels/stream.h"

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/error.h"

namespace kernels {

Stream Stream::create(Device device) {
  Stream s;
  s.device_ = device;
  if (device.is_cpu()) return s;
  void* h = detail::cuda_stream_create(device.index);
  const int index = device.index;
  s.handle_ = std::shared_ptr<void>(h, [index](void* p) { detail::cuda_stream_destroy(p, index); });
  return s;
}

Stream Stream::compute(Device device) {
  Stream s;
  s.device_ = device;
  if (device.is_cuda())  // not owned: the kernels layer keeps it
    s.handle_ = std::shared_ptr<void>(detail::cuda_compute_stream(device.index), [](void*) {});
  return s;
}

Stream Stream::copy(Device device) {
  Stream s;
  s.device_ = device;
  if (device.is_cuda())  // not owned: the kernels layer keeps it
    s.handle_ = std::shared_ptr<void>(detail::cuda_copy_stream(device.index), [](void*) {});
  return s;
}

void Stream::wait(const Event& event) const {
  if (event.device_.is_cpu()) return;  // complete
  if (device_.is_cpu()) return event.synchronize();  // the host is this stream
  if (!(event.device_ == device_))
    throw InvalidArgument("Stream::wait: an event on " + to_string(event.device_) + " for a stream on " +
                          to_string(device_) + ": expected the same device");
  detail::cuda_stream_wait_event(handle_.get(), event.handle_.get(), device_.index);
}

void Stream::synchronize() const {
  if (device_.is_cuda()) detail::cuda_stream_synchronize(handle_.get(), device_.index);
}

Event Event::record(const Stream& stream) {
  Event e;
  e.device_ = stream.device_;
  if (stream.device_.is_cpu()) return e;
  const int index = stream.device_.index;
  void* h = detail::cuda_event_create(index);
  e.handle_ = std::shared_ptr<void>(h, [index](void* p) { detail::cuda_event_destroy(p, index); });
  detail::cuda_event_record(h, stream.handle_.get(), index);
  return e;
}

bool Event::query() const { return handle_ == nullptr || detail::cuda_event_query(handle_.get(), device_.index); }

void Event::synchronize() const {
  if (handle_ != nullptr) detail::cuda_event_synchronize(handle_.get(), device_.index);
}

}  // namespace kernels
