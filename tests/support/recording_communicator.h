// RecordingCommunicator: a Communicator decorator that logs every collective call it forwards
// as a collectives::CollectiveCall, in call order, per communicator; split() wraps the new group
// too and logs into the same Recorder. After the ranks have run, Recorder::check_same_calls()
// proves that every member of every group issued the same call sequence (kind, dtype, counts,
// op, root; for send_recv and all_to_all_v only the kind and dtype, whose counts legitimately
// differ between members) -- the SPMD rule the in-order engine relies on.
//
//   testing_support::Recorder rec;
//   collectives::run_ranks(8, [&](Communicator& world) {
//     RecordingCommunicator recorded(world, rec);
//     MeshComms comms(mesh, recorded);      // every mesh-dim group is recorded
//     ... redistribute ...
//   });
//   CHECK(rec.check_same_calls() == "");     // on the test thread
//
// Host tasks and wait_for are forwarded but not logged (they are local, not collective).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "collectives/communicator.h"

namespace testing_support {

class Recorder {
 public:
  // Appends to the log of (group name + member list, group rank).
  void add(const std::string& group, int rank, const collectives::CollectiveCall& call) {
    std::lock_guard lk(mu_);
    logs_[group][rank].push_back(call);
  }
  // "" when every member of every group logged the same sequence, else the first difference.
  std::string check_same_calls() const {
    std::lock_guard lk(mu_);
    for (const auto& [group, members] : logs_) {
      const auto& [r0, ref] = *members.begin();
      for (const auto& [r, calls] : members) {
        if (calls.size() != ref.size())
          return fmt::format("group {}: rank {} made {} calls, rank {} made {}", group, r, calls.size(), r0, ref.size());
        for (size_t i = 0; i < calls.size(); ++i)
          if (!same(calls[i], ref[i]))
            return fmt::format("group {}: call #{} is {} on rank {} but {} on rank {}", group, i,
                               collectives::to_string(calls[i]), r, collectives::to_string(ref[i]), r0);
      }
    }
    return "";
  }
  // Calls logged by every member of every group, summed (each group counted once, by member 0).
  size_t calls() const {
    std::lock_guard lk(mu_);
    size_t n = 0;
    for (const auto& [group, members] : logs_) n += members.begin()->second.size();
    return n;
  }
  // The calls of one kind, counted like calls().
  size_t calls(collectives::CollectiveKind kind) const {
    std::lock_guard lk(mu_);
    size_t n = 0;
    for (const auto& [group, members] : logs_)
      for (const auto& c : members.begin()->second) n += c.kind == kind ? 1 : 0;
    return n;
  }
  size_t groups() const {
    std::lock_guard lk(mu_);
    return logs_.size();
  }

 private:
  static bool same(const collectives::CollectiveCall& a, const collectives::CollectiveCall& b) {
    using collectives::CollectiveKind;
    if (a.kind != b.kind) return false;
    // A member with nothing to send or receive passes no buffer, hence no dtype.
    if (a.kind == CollectiveKind::kBarrier || a.kind == CollectiveKind::kSendRecv) return true;
    if (a.kind == CollectiveKind::kAllToAllV) return a.dtype == b.dtype;
    return a == b;
  }
  mutable std::mutex mu_;
  std::map<std::string, std::map<int, std::vector<collectives::CollectiveCall>>> logs_;
};

class RecordingCommunicator final : public collectives::Communicator {
 public:
  RecordingCommunicator(collectives::Communicator& inner, Recorder& recorder)
      : Communicator(inner.rank(), inner.ranks(), inner.name(), inner.timeout()), inner_(&inner), rec_(&recorder),
        group_(fmt::format("'{}' [{}]", inner.name(), fmt::join(inner.ranks(), ","))) {}
  RecordingCommunicator(std::unique_ptr<collectives::Communicator> inner, Recorder& recorder)
      : RecordingCommunicator(*inner, recorder) {
    owned_ = std::move(inner);
  }

  std::string_view backend() const override { return inner_->backend(); }
  bool p2p_views() const override { return inner_->p2p_views(); }
  int64_t p2p_view_max_bytes() const override { return inner_->p2p_view_max_bytes(); }

  void wait_for(const collectives::WorkPtr& work) override { inner_->wait_for(work); }
  collectives::WorkPtr host_task(std::function<void()> fn) override { return inner_->host_task(std::move(fn)); }
  void kick() override { inner_->kick(); }
  void begin_batch() override { inner_->begin_batch(); }
  collectives::WorkPtr end_batch() override { return inner_->end_batch(); }
  std::unique_ptr<collectives::Communicator> split(std::span<const int> group, std::string name) override {
    auto sub = std::make_unique<RecordingCommunicator>(inner_->split(group, std::move(name)), *rec_);
    sub->set_timeout(timeout());
    return sub;
  }

 protected:
  collectives::WorkPtr issue(const collectives::Call& call) override {
    rec_->add(group_, rank(), call.summary());
    return collectives::forward(*inner_, call);
  }

 private:
  collectives::Communicator* inner_;
  std::unique_ptr<collectives::Communicator> owned_;
  Recorder* rec_;
  std::string group_;
};

}  // namespace testing_support
