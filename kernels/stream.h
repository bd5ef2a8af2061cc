// Streams and events: the order of work on a device, without CUDA headers. A Stream is a queue
// of work on one device; an Event marks a point in a stream. The CPU has one stream, the calling
// thread, whose work is done when each call returns: on the CPU (and in a build without CUDA,
// for CPU devices) every operation here is a no-op and every event has completed.
//
//   Stream s = Stream::create(Device::cuda(0));  // a new stream, non-blocking (no implicit
//                                                 // sync with the legacy default stream)
//   Event e = Event::record(s);                   // completes after the work queued on s so far
//   Stream::compute(Device::cuda(0)).wait(e);     // device-side: later kernels run after e
//   e.query();  e.synchronize();  s.synchronize();  // host-side poll / waits
//
// The kernels layer queues every kernel and copy of a device on that device's compute stream
// (NOTE [cuda ordering] in kernels/cuda/cuda_ops.h), never on the legacy default stream; a
// stream of one's own is ordered against it with events. Errors: Unsupported for a CUDA device
// in a build without CUDA or without that GPU; Error naming the CUDA call otherwise.
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/device.h"

namespace kernels {

class Event;

class Stream {
 public:
  Stream() = default;  // the CPU stream
  // A new stream on `device` (the CPU: the CPU stream); destroyed with its last copy.
  static Stream create(Device device);
  // The stream the kernels layer runs on for `device` (the CPU stream for the CPU).
  static Stream compute(Device device);
  // The device's copy stream, for host <-> device copies that overlap the compute stream's
  // kernels (kernels/async_copy.h): one per device, created on first use and kept, like the
  // compute stream. The CPU stream for the CPU.
  static Stream copy(Device device);

  Device device() const { return device_; }
  // An opaque handle (the cudaStream_t), equal for copies of one stream; 0 for the CPU.
  uint64_t id() const { return reinterpret_cast<uint64_t>(handle_.get()); }
  // Work queued on this stream after this call runs after `event` (device-side; no host wait).
  // REQUIRES: the event is on this stream's device (or the CPU).
  void wait(const Event& event) const;
  // Blocks the host until the work queued on this stream has run.
  void synchronize() const;

  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.handle_ == b.handle_;
  }

 private:
  friend class Event;
  Device device_;
  std::shared_ptr<void> handle_;  // cudaStream_t; null on the CPU
};

class Event {
 public:
  Event() = default;  // a completed CPU event
  // An event that completes once the work queued on `stream` so far has run.
  static Event record(const Stream& stream);

  Device device() const { return device_; }
  // Non-blocking: has it completed?
  bool query() const;
  // Blocks the host until it has completed.
  void synchronize() const;

 private:
  friend class Stream;
  Device device_;
  std::shared_ptr<void> handle_;  // cudaEvent_t; null on the CPU
};

}  // namespace kernels
