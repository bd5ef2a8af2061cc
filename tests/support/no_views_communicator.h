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

  collectives::WorkPtr all_gather(const kernels::Tensor& input, const kernels::Tensor& output) override {
    observe(collectives::CollectiveKind::kAllGather, {input, output});
    return inner_->all_gather(input, output);
  }
  collectives::WorkPtr reduce_scatter(const kernels::Tensor& input, const kernels::Tensor& output,
                                      collectives::Reduction r) override {
    observe(collectives::CollectiveKind::kReduceScatter, {input, output});
    return inner_->reduce_scatter(input, output, r);
  }
  collectives::WorkPtr all_reduce(const kernels::Tensor& input, const kernels::Tensor& output,
                                  collectives::Reduction r) override {
    observe(collectives::CollectiveKind::kAllReduce, {input, output});
    return inner_->all_reduce(input, output, r);
  }
  collectives::WorkPtr all_to_all(const kernels::Tensor& input, const kernels::Tensor& output) override {
    observe(collectives::CollectiveKind::kAllToAll, {input, output});
    return inner_->all_to_all(input, output);
  }
  collectives::WorkPtr all_to_all_v(const kernels::Tensor& input, std::span<const int64_t> send_counts,
                                    const kernels::Tensor& output,
                                    std::span<const int64_t> recv_counts) override {
    observe(collectives::CollectiveKind::kAllToAllV, {input, output});
    return inner_->all_to_all_v(input, send_counts, output, recv_counts);
  }
  collectives::WorkPtr broadcast(const kernels::Tensor& buffer, int root) override {
    observe(collectives::CollectiveKind::kBroadcast, {buffer});
    return inner_->broadcast(buffer, root);
  }
  collectives::WorkPtr scatter(const kernels::Tensor& input, const kernels::Tensor& output, int root) override {
    observe(collectives::CollectiveKind::kScatter, {input, output});
    return inner_->scatter(input, output, root);
  }
  collectives::WorkPtr barrier() override {
    observe(collectives::CollectiveKind::kBarrier, {});
    return inner_->barrier();
  }
  collectives::WorkPtr send_recv(std::span<const collectives::P2POp> ops) override {
    std::vector<kernels::Tensor> buffers;
    for (const collectives::P2POp& op : ops) {
      collectives::detail::check_p2p_tensor(*this, op.buffer);  // contiguous: p2p_views() is false
      buffers.push_back(op.buffer);
    }
    observe(collectives::CollectiveKind::kSendRecv, buffers);
    return inner_->send_recv(ops);
  }
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

 private:
  void observe(collectives::CollectiveKind kind, std::vector<kernels::Tensor> buffers) {
    if (observer_) observer_(kind, buffers);
  }

  collectives::Communicator* inner_;
  std::unique_ptr<collectives::Communicator> owned_;
  Observer observer_;
};

}  // namespace testing_support
