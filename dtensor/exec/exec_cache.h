// ExecCache: the executor's per-rank data for the steps of plans run on one MeshComms, memoised
// (dtensor/exec/executor.cpp defines StepSchedule). A schedule holds what depends only on the
// tensor's global shape and element size, the placements before the step, the step, this rank's
// mesh coordinate and the communicator's support for strided views: buffer shapes and, for an
// exchange, the pieces sent to and received from every peer. So a cached plan re-runs without
// recomputing any layout.
//
//   const MeshComms& comms = ...;
//   std::shared_ptr<const StepSchedule> s = comms.exec_cache().find(key);   // null: not yet
//   comms.exec_cache().insert(key, computed);
//
// Thread-safe. Bounded: past kMaxEntries the cache starts over.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "dtensor/exec/memory_check.h"

namespace dtensor {

struct StepSchedule;
struct Recipe;

class ExecCache {
 public:
  using Key = std::vector<int64_t>;
  static constexpr size_t kMaxEntries = 4096;

  // Whole redistributes of one tensor: the plan, the dtypes of every step and their schedules
  // (one look-up per call).
  std::shared_ptr<const Recipe> find_recipe(std::span<const int64_t> key) const {
    std::lock_guard lk(mu_);
    const auto it = recipes_.find(key);
    return it == recipes_.end() ? nullptr : it->second;
  }
  void insert_recipe(Key key, std::shared_ptr<const Recipe> recipe) {
    std::lock_guard lk(mu_);
    if (recipes_.size() >= kMaxEntries) recipes_.clear();
    recipes_.emplace(std::move(key), std::move(recipe));
  }

  std::shared_ptr<const StepSchedule> find(const Key& key) const {
    std::lock_guard lk(mu_);
    const auto it = map_.find(key);
    return it == map_.end() ? nullptr : it->second;
  }
  void insert(Key key, std::shared_ptr<const StepSchedule> schedule) {
    std::lock_guard lk(mu_);
    if (map_.size() >= kMaxEntries) map_.clear();
    map_.emplace(std::move(key), std::move(schedule));
  }
  size_t size() const {
    std::lock_guard lk(mu_);
    return map_.size();
  }
  // The memory check of transitions on these communicators (NOTE [memory gauge]).
  MemoryGauge& memory_gauge() const { return gauge_; }

 private:
  // Looked up by a span as well (no vector built per look-up).
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::span<const int64_t> key) const {
      uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
      for (int64_t v : key) {
        h ^= static_cast<uint64_t>(v);
        h *= 1099511628211ull;
      }
      return static_cast<size_t>(h);
    }
    size_t operator()(const Key& key) const { return (*this)(std::span<const int64_t>(key)); }
  };
  struct Equal {
    using is_transparent = void;
    static bool same(std::span<const int64_t> a, std::span<const int64_t> b) {
      return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
    }
    bool operator()(const Key& a, const Key& b) const { return a == b; }
    bool operator()(std::span<const int64_t> a, const Key& b) const { return same(a, b); }
    bool operator()(const Key& a, std::span<const int64_t> b) const { return same(a, b); }
  };
  mutable std::mutex mu_;
  mutable MemoryGauge gauge_;
  std::unordered_map<Key, std::shared_ptr<const StepSchedule>, Hash, Equal> map_;
  std::unordered_map<Key, std::shared_ptr<const Recipe>, Hash, Equal> recipes_;
};

}  // namespace dtensor
