// A Communicator decorator that forwards every call to another communicator but reports
// p2p_views() == false, so the DTensor executor takes the packed exchange path (one contiguous
// buffer per peer: what it does on NCCL) on a CPU backend that would otherwise receive views.
// It also holds send_recv to the contiguous-only contract: a strided buffer throws
// InvalidArgument, as on a backend without views. split() wraps the new communicator too, so a
// MeshComms built over a wrapped world has wrapped mesh-dim groups.
//
//   collectives::run_ranks(4, [&](Communicator& world) {
//     NoViewsCommunicator packed(world);          // or NoViewsCommunicator(std::move(owned))
//     dtensor::MeshComms comms(mesh, packed);     // comms.dim(d).p2p_views() == false
//   });
//
// An optional observer sees every call (kind, and the buffers passed) before it is forwarded;
// it is shared with the communicators split() returns and may be called from any rank thread.
// The wrapper has its own timeout (Communicator::wait uses it); it starts as the inner one's.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "collectives/communicator.h"

namespace testing_support {

class NoViewsCommunicator final : public collectives::Communicator {
 public:
  using Observer = std::function<void(collectives::CollectiveKind, std::span<const kernels::Tensor>)>;

  // Wraps `inner` without owning it (it must outlive the wrapper).
  explicit NoViewsCommunicator(collectives::Communicator& inner, Observer observer = nullptr)
      : Communicator(inner.rank(), inner.ranks(), inner.name(), inner.timeout()),
        inner_(&inner), observer_(std::move(observer)) {}
  // Wraps and owns `inner`.
  explicit NoViewsCommunicator(std::unique_ptr<collectives::Communicator> inner, Observer observer = nullptr)
      : NoViewsCommunicator(*inner, std::move(observer)) {
    owned_ = std::move(inner);
  }

  collectives::Communicator& inner() const { return *inner_; }

  std::string_view backend() const override { return inner_->backend(); }
  bool p2p_views() const override { return false; }

  void wait_for(const collectives::WorkPtr& work) override { inner_->wait_for(work); }
  collectives::WorkPtr host_task(std::function<void()> fn) override { return inner_->host_task(std::move(fn)); }
  void kick() override { inner_->kick(); }
  void begin_batch() override { inner_->begin_batch(); }
  collectives::WorkPtr end_batch() override { return inner_->end_batch(); }
  std::unique_ptr<collectives::Communicator> split(std::span<const int> group, std::string name) override {
    auto sub = std::make_unique<NoViewsCommunicator>(inner_->split(group, std::move(name)), observer_);
    sub->set_timeout(timeout());
    return sub;
  }

 protected:
  // The contract (validate) already held send_recv to contiguous buffers: p2p_views() is false.
  collectives::WorkPtr issue(const collectives::Call& call) override {
    if (observer_) {
      std::vector<kernels::Tensor> buffers;
      if (call.kind == collectives::CollectiveKind::kSendRecv) {
        for (const collectives::P2POp& op : call.ops) buffers.push_back(op.buffer);
      } else if (call.kind == collectives::CollectiveKind::kBroadcast) {
        buffers.push_back(call.output);
      } else if (call.kind != collectives::CollectiveKind::kBarrier) {
        buffers = {call.input, call.output};
      }
      observer_(call.kind, buffers);
    }
    return collectives::forward(*inner_, call);
  }

 private:
  collectives::Communicator* inner_;
  std::unique_ptr<collectives::Communicator> owned_;
  Observer observer_;
};

}  // namespace testing_support
