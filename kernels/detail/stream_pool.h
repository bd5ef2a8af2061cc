// Internal: the host logic of a stream-aware block cache, with no CUDA in it (the device side is
// an EventOps: record an event on a stream, ask whether it completed, release it), so the rules
// are unit-tested on the CPU with a fake (tests/kernels/stream_pool_test.cpp) and reused over
// real CUDA events.
//
// NOTE [stream-aware reuse] A block is given back with the stream that freed it and the other
// streams that used it; an event is recorded on each of those streams then. It is handed out
// again on stream t only when every one of its events recorded on a stream other than t has
// completed: work queued on t itself is ordered by t, so a block freed on t is reusable on t at
// once, and on another stream only after the freeing stream has passed the free. Blocks are
// matched by exact size (callers round sizes: CachingAllocator::rounded_size). Small blocks
// (below small_limit) have a byte budget of their own and are never evicted by age; larger ones
// are evicted oldest first past max_cached_bytes and handed back to the caller to free. Not
// thread-safe: its owner serialises calls.
//
//   FakeEvents ev;                       // any EventOps
//   StreamBlockPool pool(ev, {});
//   pool.give({p, 4096}, /*stream=*/1);  // freed on stream 1: an event recorded there
//   pool.take(4096, 1);                  // p at once (stream 1 orders it)
//   pool.give({p, 4096}, 1);
//   pool.take(4096, 2);                  // nullptr until stream 1's event completes, then p
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

namespace kernels::detail {

using StreamId = uint64_t;  // an opaque stream handle (0: the device's default stream)
using EventId = uint64_t;   // an opaque event handle, never 0

class EventOps {
 public:
  virtual ~EventOps() = default;
  // An event recorded on `stream` now (it completes when the work queued there before it has).
  virtual EventId record(StreamId stream) = 0;
  // Non-blocking: has the event completed?
  virtual bool done(EventId event) = 0;
  // The pool no longer needs the event. Never throws.
  virtual void release(EventId event) noexcept = 0;
};

class StreamBlockPool {
 public:
  struct Options {
    size_t small_limit = size_t{1} << 20;        // blocks below this are "small"
    size_t max_small_bytes = size_t{64} << 20;   // small free blocks kept, at most
    size_t max_cached_bytes = size_t{1} << 30;   // large free blocks kept (oldest evicted)
  };
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;
  };
  struct Stats {
    size_t cached_bytes = 0;     // free blocks held, small and large
    int64_t reused = 0;          // take() calls served
    int64_t waited = 0;          // take() calls that found blocks of the size, none ready
    int64_t pending_events = 0;  // events held now
  };

  StreamBlockPool(EventOps& events, Options options) : events_(events), options_(options) {}
  ~StreamBlockPool();  // releases the events; the blocks still cached are the owner's to free
  StreamBlockPool(const StreamBlockPool&) = delete;
  StreamBlockPool& operator=(const StreamBlockPool&) = delete;

  // A cached block of exactly `size` that is safe to use on `stream` now, or nullptr.
  void* take(size_t size, StreamId stream);
  // Caches a block freed on `stream` and also used on `also_used_on` (NOTE [stream-aware
  // reuse]). Returns the blocks the caller must free now: `block` itself when it does not fit
  // the small budget, or large blocks evicted (oldest first) to stay within max_cached_bytes.
  // A block returned here may still be in use by queued work: free it with a call that waits
  // for the device (cudaFree does).
  std::vector<Block> give(Block block, StreamId stream, std::span<const StreamId> also_used_on = {});
  // Every cached block, for the caller to free; the pool is empty afterwards.
  std::vector<Block> drain();
  Stats stats() const;

 private:
  struct Entry {
    void* ptr;
    uint64_t age;
    std::vector<std::pair<StreamId, EventId>> events;  // recorded when it was given back
  };
  bool ready(const Entry& e, StreamId stream);
  void release_events(Entry& e) noexcept;

  EventOps& events_;
  Options options_;
  std::multimap<size_t, Entry> free_;  // size -> block
  uint64_t clock_ = 0;
  size_t small_bytes_ = 0, large_bytes_ = 0;
  Stats stats_;
};

}  // namespace kernels::detail
