// Offload that overlaps: OffloadPolicy{offload_to_cpu, pin_memory} on a CUDA compute device keeps
// each group's sharded parameters and gradients in pinned host memory and moves them on the
// device's copy stream (kernels/stream.h Stream::copy), so the copies run beside the compute
// stream's kernels instead of stopping them (PyTorch FSDP2's CPUOffloadPolicy(pin_memory=True)).
// The optimizer steps the sharded parameters on the host, so its state lives there too (in
// ordinary memory: it never crosses to the device).
//
//   fsdp::FullyShardOptions o;
//   o.offload_policy.offload_to_cpu = true;   // pin_memory defaults to true
//   for (auto& [n, b] : model.blocks().children()) fsdp::fully_shard(*b, comms, o);
//   fsdp::fully_shard(model, comms, o);       // parameters on cuda:0: state pinned on the host
//   ... forward / backward as usual; after backward the gradients are on the host, complete
//   opt.step();                               // the host steps the pinned shards
//
// Per step, for a group G (the forward order of the last forward; mirrored in backward):
//   pre-forward of the group depth+1 before G  copy-in of G issued ("copy-ahead"; depth: the
//                                              prefetch depth): its shard host -> a device
//                                              buffer, on the copy stream
//   pre-forward of the group depth before G    G's all-gather issued (prefetch; without one, at
//                                              G's pre-forward): the compute stream first waits
//                                              for the copy-in's event
//   reduce-scatter of G finished               its sharded gradient device -> pinned host, on the
//                                              copy stream
//   end of backward                            the host waits for every copy: the optimizer reads
//                                              the gradients and writes the parameters next
// Each copy is one group's whole flat buffer, in either layout (FullyShardOptions::layout): the
// padded shard or the contiguous layout's Rg range in, the sharded gradient buffer out; the
// sharded parameters and gradients are views of the host buffers.
//
// NOTE [offload ordering] (what detail::OffloadCopies enforces; tests/fsdp/offload_test.cpp runs
// FSDP over a fake engine whose copies only happen when something waits for them):
//   1. A copy is queued after the work queued on the compute stream so far (that work wrote its
//      source, or last used its destination's block).
//   2. The all-gather reads a copied-in buffer only after the compute stream waits for the copy.
//   3. The host reads offloaded gradients, or writes offloaded parameters, only after waiting for
//      every copy of the group (drain, at the end of every backward); a copy-in issued ahead and
//      not used by then is dropped (the parameters are about to change).
//   4. Both buffers of a copy stay alive until the copy has run.
//
// On a CPU compute device there is nothing to pin or overlap: the policy is a no-op that
// FSDPModule::note() says once. Tests may hand fully_shard a CopyEngine of their own
// (OffloadPolicy::copy_engine), which then runs on the CPU too.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/fully_shard.h"
#include "kernels/async_copy.h"
#include "kernels/stream.h"
#include "kernels/tensor.h"

namespace fsdp {

// The device side of the offload copies. Tickets are opaque and never 0. Implementations
// serialise their own calls (one engine may serve several groups).
class CopyEngine {
 public:
  using Ticket = uint64_t;
  virtual ~CopyEngine() = default;
  // Queues dst <- src (same shape and dtype, contiguous; host and compute device, either way) on
  // the copy stream, after the work queued on the compute stream so far. Returns at once.
  virtual Ticket copy(const kernels::Tensor& dst, const kernels::Tensor& src) = 0;
  // Work queued on the compute stream from now on runs after the copy (the host does not wait).
  virtual void compute_wait(Ticket t) = 0;
  // Blocks the host until the copy has run.
  virtual void host_wait(Ticket t) = 0;
  // Non-blocking: has the copy run?
  virtual bool done(Ticket t) = 0;
  // The ticket is no longer needed. Never throws.
  virtual void release(Ticket t) noexcept = 0;
  // Where the offloaded state is allocated (pinned host memory), or nullptr for the mesh's
  // allocator.
  virtual std::shared_ptr<kernels::Allocator> host_allocator() = 0;
};

// The engine over kernels streams on one CUDA device: copies on Stream::copy(device), an event
// recorded after each, the offloaded state from a PinnedHostAllocator. REQUIRES: a CUDA device
// (InvalidArgument otherwise; Unsupported in a build without CUDA or without that GPU).
class StreamCopyEngine final : public CopyEngine {
 public:
  struct Stats {
    int64_t host_to_device = 0, device_to_host = 0;
    int64_t copy_stream_events = 0;  // events recorded on the copy stream (one per copy)
    int64_t compute_waits = 0, host_waits = 0;
    uint64_t copy_stream = 0, compute_stream = 0;  // Stream::id() of each
  };
  explicit StreamCopyEngine(kernels::Device device);
  Ticket copy(const kernels::Tensor& dst, const kernels::Tensor& src) override;
  void compute_wait(Ticket t) override;
  void host_wait(Ticket t) override;
  bool done(Ticket t) override;
  void release(Ticket t) noexcept override;
  std::shared_ptr<kernels::Allocator> host_allocator() override { return pinned_; }
  Stats stats() const;

 private:
  kernels::Event event(Ticket t) const;
  kernels::Device device_;
  kernels::Stream copy_, compute_;
  std::shared_ptr<kernels::PinnedHostAllocator> pinned_;
  mutable std::mutex mu_;
  std::map<Ticket, kernels::Event> events_;
  Ticket next_ = 1;
  Stats stats_;
};

namespace detail {

// One group's offload copies in flight and who waits for what (NOTE [offload ordering]). Not
// thread-safe (a group runs on its rank's thread).
class OffloadCopies {
 public:
  struct Stats {
    int64_t copies_in = 0, copies_out = 0;
    int64_t compute_waits = 0, host_waits = 0;
    int64_t dropped = 0;  // copies-in issued ahead and never used
    size_t in_flight = 0;  // copies whose buffers are still held
  };
  explicit OffloadCopies(std::shared_ptr<CopyEngine> engine) : engine_(std::move(engine)) {}
  ~OffloadCopies();  // waits for every copy (no buffer is freed under a running copy)
  OffloadCopies(const OffloadCopies&) = delete;
  OffloadCopies& operator=(const OffloadCopies&) = delete;

  // Copy-in: dst (compute device) <- src (the sharded parameters, host). REQUIRES: no copy-in
  // pending (InternalError otherwise).
  void copy_in(const kernels::Tensor& dst, const kernels::Tensor& src);
  bool has_copy_in() const { return pending_in_.has_value(); }
  // The pending copy-in's destination, once the compute stream waits for it. REQUIRES: one is
  // pending (InternalError otherwise).
  kernels::Tensor take_copy_in();
  // Forgets a pending copy-in (its buffers stay held until it has run); none: a no-op.
  void drop_copy_in();
  // Copy-out: dst (host gradient) <- src (compute device); src is held until it has run.
  void copy_out(const kernels::Tensor& dst, const kernels::Tensor& src);
  // Waits for every copy, drops a pending copy-in and releases every buffer.
  void drain();
  Stats stats() const;
  const std::shared_ptr<CopyEngine>& engine() const { return engine_; }

 private:
  struct InFlight {
    CopyEngine::Ticket ticket;
    kernels::Tensor dst, src;
  };
  void reap();  // releases the copies the engine reports done
  std::shared_ptr<CopyEngine> engine_;
  std::vector<InFlight> flight_;
  std::optional<InFlight> pending_in_;  // also in flight_
  Stats stats_;
};

// The offload copies fully_shard gives a group (nullptr: none, the copies stay synchronous) and
// the note it reports: a CUDA compute device with offload_to_cpu and pin_memory gets a
// StreamCopyEngine (or policy.copy_engine); a CPU one gets none unless policy.copy_engine is set,
// and a note saying pin_memory is a no-op.
std::unique_ptr<OffloadCopies> make_offload_copies(const OffloadPolicy& policy, kernels::Device compute_device,
                                                   std::string& note);

}  // namespace detail
}  // namespace fsdp
