#include "fsdp/offload.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/error.h"
#include "kernels/format.h"

namespace fsdp {

using kernels::Event;
using kernels::Stream;
using kernels::Tensor;

StreamCopyEngine::StreamCopyEngine(kernels::Device device) : device_(device) {
  if (!device.is_cuda())
    throw kernels::InvalidArgument(
        fmt::format("StreamCopyEngine on {}: expected a CUDA device (on the CPU there is nothing to overlap)",
                    kernels::to_string(device)));
  copy_ = Stream::copy(device);
  compute_ = Stream::compute(device);
  pinned_ = std::make_shared<kernels::PinnedHostAllocator>();
  stats_.copy_stream = copy_.id();
  stats_.compute_stream = compute_.id();
}

CopyEngine::Ticket StreamCopyEngine::copy(const Tensor& dst, const Tensor& src) {
  std::lock_guard lk(mu_);
  copy_.wait(Event::record(compute_));  // NOTE [offload ordering] 1
  Event e = kernels::copy_async(dst, src, copy_);
  ++(dst.device().is_cuda() ? stats_.host_to_device : stats_.device_to_host);
  ++stats_.copy_stream_events;
  events_.emplace(next_, std::move(e));
  return next_++;
}

Event StreamCopyEngine::event(Ticket t) const {
  const auto it = events_.find(t);
  if (it == events_.end()) throw kernels::InternalError(fmt::format("StreamCopyEngine: unknown ticket {}", t));
  return it->second;
}

void StreamCopyEngine::compute_wait(Ticket t) {
  std::lock_guard lk(mu_);
  compute_.wait(event(t));
  ++stats_.compute_waits;
}

void StreamCopyEngine::host_wait(Ticket t) {
  Event e;
  {
    std::lock_guard lk(mu_);
    e = event(t);
    ++stats_.host_waits;
  }
  e.synchronize();
}

bool StreamCopyEngine::done(Ticket t) {
  Event e;
  {
    std::lock_guard lk(mu_);
    e = event(t);
  }
  return e.query();
}

void StreamCopyEngine::release(Ticket t) noexcept {
  std::lock_guard lk(mu_);
  events_.erase(t);
}

StreamCopyEngine::Stats StreamCopyEngine::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

namespace detail {

OffloadCopies::~OffloadCopies() {
  try {
    drain();
  } catch (...) {  // a failed device: nothing left to protect
  }
}

void OffloadCopies::reap() {
  auto done = [&](const InFlight& f) {
    if (pending_in_ && pending_in_->ticket == f.ticket) return false;  // its ticket is still needed
    if (!engine_->done(f.ticket)) return false;
    engine_->release(f.ticket);
    return true;
  };
  flight_.erase(std::remove_if(flight_.begin(), flight_.end(), done), flight_.end());
}

void OffloadCopies::copy_in(const Tensor& dst, const Tensor& src) {
  if (pending_in_) throw kernels::InternalError("FSDP offload: a second copy-in while one is pending");
  reap();
  InFlight f{engine_->copy(dst, src), dst, src};
  flight_.push_back(f);
  pending_in_ = f;
  ++stats_.copies_in;
}

Tensor OffloadCopies::take_copy_in() {
  if (!pending_in_) throw kernels::InternalError("FSDP offload: the all-gather input was never copied in");
  InFlight f = *pending_in_;
  pending_in_.reset();
  engine_->compute_wait(f.ticket);  // NOTE [offload ordering] 2
  ++stats_.compute_waits;
  return f.dst;
}

void OffloadCopies::drop_copy_in() {
  if (!pending_in_) return;
  pending_in_.reset();
  ++stats_.dropped;
}

void OffloadCopies::copy_out(const Tensor& dst, const Tensor& src) {
  reap();
  flight_.push_back({engine_->copy(dst, src), dst, src});
  ++stats_.copies_out;
}

void OffloadCopies::drain() {
  drop_copy_in();
  for (const InFlight& f : flight_) {  // NOTE [offload ordering] 3
    engine_->host_wait(f.ticket);
    ++stats_.host_waits;
  }
  for (const InFlight& f : flight_) engine_->release(f.ticket);
  flight_.clear();
}

OffloadCopies::Stats OffloadCopies::stats() const {
  Stats s = stats_;
  s.in_flight = flight_.size();
  return s;
}

std::unique_ptr<OffloadCopies> make_offload_copies(const OffloadPolicy& policy, kernels::Device compute_device,
                                                   std::string& note) {
  if (!policy.offload_to_cpu) return nullptr;
  if (policy.copy_engine) return std::make_unique<OffloadCopies>(policy.copy_engine);
  if (!policy.pin_memory) return nullptr;  // synchronous copies from ordinary memory
  if (compute_device.is_cpu()) {
    note = "offload_policy.pin_memory is a no-op here: the compute device is the CPU, so the offloaded state stays "
           "in the same (ordinary) host memory";
    return nullptr;
  }
  return std::make_unique<OffloadCopies>(std::make_shared<StreamCopyEngine>(compute_device));
}

}  // namespace detail
}  // namespace fsdp
