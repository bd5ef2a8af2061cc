// Executes a Plan on this rank's local tensors through its MeshComms: one function per Step
// kind; it decides how (buffers, which collective, casts), never what.
//
//   ExecHandle h = issue(plan, src_spec, local, comms);   // every step enqueued; returns at once
//   ...                                                    // compute meanwhile
//   Tensor result = h.wait(collectives::Milliseconds{60'000})[0];
//   Tensor same = execute(plan, src_spec, local, comms);   // issue + wait
//
// NOTE [exchange] Every data-movement step among S/_S/R placements of one mesh dim is an
// exchange on that mesh dim's group: member r sends member g the elements it holds that g holds
// after the step (per tensor dim, the intersection of index sets), and g receives them in the
// same global order; the elements r keeps go from its input to its result the same way (a
// message to itself, moved by the backend). Everything comes from the layouts before and after
// the step, so any step a planner emits on one mesh dim works. Uneven and strided shards need no
// padding: the counts are exact, so the bytes moved equal what must move. Where the backend
// takes strided views (local, mpi) the pieces go straight from the input into the peer's result;
// otherwise (nccl) they are packed per peer. Even all-gathers along the leading dim use
// all_gather straight into the result, and Partial steps use all_reduce / reduce_scatter
// (padding-free: uneven reduce-scatters become an exchange plus a local reduce). What a step
// needs from the layouts (buffer shapes, pieces per peer) is computed once per transition, from
// this rank's coordinate only (dtensor/exec/schedule.h), and kept with the plan in the
// MeshComms' PlanCache entry (a Recipe).
//
// NOTE [deferred plans] issue() enqueues every step of a plan at once, each on the communicator
// of its mesh dim (NOTE [in-order engine] in collectives/communicator.h), and returns;
// ExecHandle::wait() waits for the calls. A step that consumes the previous step's result from
// another communicator is preceded by wait_for(the previous step's last call), and the copies
// around a collective (packing, unpacking, casts, the local reduce of an uneven reduce-scatter)
// are host tasks of the collective's communicator, so they run once the data they read has
// arrived. So every call takes its place in its communicator's order when the redistribute is
// issued, not when its input is ready: two redistributes issued in the same order on every rank
// reach every communicator as (the first one's calls, then the second's), whatever the timing,
// and can never pair one rank's step of the first with another rank's step of the second (a
// mismatch, or a deadlock when each waits for input the other has not produced). Any number of
// redistributes may be in flight on one mesh; on each communicator they complete in issue order.
// Buffers are allocated at issue, so issuing never waits for data; before the first one, issue
// checks the bytes they take against what the mesh's allocator can hand out and throws
// ResourceError naming both when they do not fit (NOTE [memory limit], memory_check.h). The
// inputs must stay unchanged, and the outputs unread, until the handle is ready.
//
// NOTE [reduce policy] The reducing steps of a plan (all_reduce, reduce_scatter, and the
// exchange + local reduce of an uneven reduce-scatter) compute in policy.reduce_dtype: the data
// is cast once on its way into the first reducing step (fused into the copy that feeds the
// collective) and cast back once after the last (fused into the copy out of it), so a bf16
// tensor reduced in f32 is rounded once. Steps between them move the reduce dtype; steps after
// them move the output's dtype. divide_factor f divides the result, the way FSDP2 divides
// gradients (docs/pytorch-semantics.md 7.3), with K the product of the reducing steps' group sizes:
//  - reduce dtype f32 or bf16 (no overflow risk), without force_sum: f == K: every reducing step
//    averages (avg), so P(sum) with f = K equals P(avg) bit for bit; f == size of the first
//    reducing step's group: that step averages, the others sum; otherwise the first step is a
//    pre-multiplied sum by 1/f (Reduction::premul_sum: NCCL's ncclRedOpCreatePreMulSum) and the
//    others sum;
//  - any other reduce dtype (f16: overflow risk) or force_sum: every step sums; with overflow
//    risk the first step pre-divides by p (p doubles from 1 while p divides f and f/p > p: about
//    sqrt(f)), and the result is post-divided by f/p after the last reducing step, in the reduce
//    dtype, before the cast back (force_sum without overflow risk: p = 1, all after).
// A divide factor needs every reducing step to be a sum (P(sum)); a plan that reduces nothing
// takes none.
//
// NOTE [wire dtype] policy.wire_dtype, a floating dtype narrower than the reduce dtype (bf16 or
// f8e5m2 with f32), is what the reducing steps on groups of k > 1 move; the planner marks those
// steps ("RS(0:0,sum,wire=bf16)", "AR(1,sum,wire=f8e5m2)") and costs them in wire bytes. Such a
// step runs on every backend as exchanges plus a local sum, never as a reducing collective (NCCL
// cannot reduce fp8, and sums bf16 in bf16 before 2.27):
//  - P -> S(d) / _S(d,sf): member g's chunk of every member's contribution (the contribution in
//    the reduce dtype, then rounded to the wire) goes to g in one send_recv; g sums the k pieces
//    in the reduce dtype in member order 0..k-1 (exact f32 accumulation of bf16 / e5m2 values,
//    the same on every rank and every run), then pre-multiplier / avg / post-scale as above;
//  - P -> R: the same on k chunks of the flat tensor (the first N % k members take one element
//    more), then each member's sum, post-scaled and rounded once to the wire, is sent to every
//    member. R's result is therefore the reduce-dtype sum rounded to the wire dtype (then cast to
//    the output dtype), identical on every member.
// fp8 wires (e5m2: 2 mantissa bits, normal range 2^-14 .. 57344) would flush small gradients to
// zero and overflow large ones, so each sender scales what it sends by one power of two s = 2^e,
// the largest with amax(its finite |values|) x s <= the format's max (e5m2 57344, e4m3 448;
// |e| <= 120; 1 when all are zero), and sends s (one f32) with the payload; the receiver divides
// by s (exact). A piece is then round(x s) / s: the format's 3 significant bits at the sender's
// own exponent range, nothing lost to range unless a value is 2^-17 times smaller than the
// sender's largest. bf16 / f16 wires are cast plainly (bf16 has f32's range).
// Bytes per rank: (k-1)/k of the reduce-scatter's and N + (k-2) ceil(N/k) for P -> R, times the
// wire's item size (bf16 halves an f32 reduction), plus for fp8 4 bytes of scale to and from each
// peer per exchange. A step on a group of one moves nothing and is not rounded. make_transition
// refuses a wire wider than the reduce dtype, a non-floating one, or one under a Partial other
// than sum / avg.
#pragma once

#include <boost/container/small_vector.hpp>
#include <optional>
#include <span>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/mesh_comms.h"
#include "dtensor/plan/planner.h"
#include "dtensor/plan/transition.h"
#include "dtensor/spec.h"
#include "kernels/tensor.h"

namespace dtensor {

using collectives::Milliseconds;
using kernels::Tensor;

// Lists of an issue that hold one or two entries on the common path (one tensor, one collective):
// inline, so a cached redistribute allocates only its result (host cost, bench/RESULTS.md).
using TensorList = boost::container::small_vector<Tensor, 1>;
using WorkList = boost::container::small_vector<collectives::WorkPtr, 2>;
using CommList = boost::container::small_vector<collectives::Communicator*, 2>;

// A redistribute in flight (NOTE [deferred plans]): its results and the calls producing them.
// Destroying a pending handle completes its calls first (bounded by the communicators'
// timeout), unless the thread unwinds an exception.
class ExecHandle {
 public:
  ExecHandle() = default;
  ExecHandle(WorkList&& works, TensorList&& results, Milliseconds default_timeout, CommList&& used = {})
      : works_(std::move(works)), results_(std::move(results)), default_timeout_(default_timeout), used_(std::move(used)) {}
  ExecHandle(ExecHandle&& other) noexcept { *this = std::move(other); }
  ExecHandle& operator=(ExecHandle&& other) noexcept;
  ExecHandle(const ExecHandle&) = delete;
  ExecHandle& operator=(const ExecHandle&) = delete;
  ~ExecHandle();

  // Non-blocking (it may advance the calls a little): true once wait() returns at once.
  bool ready();
  // Blocks until every call finished, within `timeout` in all; rethrows the first failure (a
  // timeout names the call, its group and the missing ranks). Then the results are valid.
  std::span<const Tensor> wait(Milliseconds timeout);
  std::span<const Tensor> wait() { return wait(default_timeout_); }
  // The result tensors (valid once ready; allocated, or the caller's `out`, from issue on).
  std::span<const Tensor> results() const { return {results_.data(), results_.size()}; }
  // Calls made on the communicators (0 when every step was local).
  size_t calls() const { return works_.size(); }
  // The caller will not wait soon: the communicators' workers start on the calls now
  // (Communicator::kick).
  void kick() const;
  // Every result re-viewed as `shape` (NOTE [ragged plans]: a plan on a view returns the
  // caller's local shape). REQUIRES: contiguous results of that many elements.
  void view_results(const Dims& shape);

 private:
  void finish_quietly() noexcept;
  WorkList works_;
  TensorList results_;
  Milliseconds default_timeout_{collectives::kDefaultTimeout};
  CommList used_;  // the communicators of the calls
  size_t done_ = 0;     // works_[0, done_) have completed
  bool failed_ = false;  // wait() threw
};

// Issues every step of `plan` for a batch of tensors (NOTE [deferred plans]). specs[i] / locals[i]
// describe tensor i: every spec has plan.src placements, the comms' mesh and one dtype; shapes
// may differ. One collective per communicating step for the whole batch (flat buffers; copy-in,
// collective, copy-out). outs, when given (one per tensor, or empty), receive the results: any
// strides and dtype (the result is cast to it), the destination's local shape; a step writes
// straight into them where it can (all_gather into a contiguous out, reduce_scatter, the pieces
// of an exchange), else the result is copied in at the end.
// REQUIRES: locals[i] has the local shape specs[i].layout(rank) gives (checked). The inputs are
// never written.
ExecHandle issue_batch(const Plan& plan, std::span<const DTensorSpec> specs, std::span<const Tensor> locals,
                       const MeshComms& comms, const ReducePolicy& policy = {}, std::span<const Tensor> outs = {});
ExecHandle issue(const Plan& plan, const DTensorSpec& src, const Tensor& local, const MeshComms& comms,
                 const ReducePolicy& policy = {}, const Tensor& out = {});

// The DTensor path (DTensor::redistribute, redistribute_async): runs `plan`, the plan of `t`
// from comms.plans(), with this rank's recipe for t: `recipe` (from the same cache entry), or,
// when null, one made now and kept in comms.plans() for the next call. The executor never plans;
// a repeated call costs the caller one look-up. Ranks outside the mesh get a handle with no
// calls whose result is `out`, or `local`. REQUIRES: src is t's source, the comms' mesh. A plan
// on a RaggedShard view keeps the view's recipe, with the caller's local shapes; the caller's
// tensors are reshaped to the view (an out must be contiguous) (NOTE [ragged plans]).
//
// NOTE [background copies] With background = true (redistribute_async) the caller does none of
// the copying: the copies that read no pending data (a local step such as R -> S(0), the copy
// into a reduction's buffer before its collective) become host tasks of the step's communicator
// too, so they run while the caller computes, progressed like its calls (a caller that waits at
// once runs them itself). Without it (a synchronous redistribute) they run at issue.
ExecHandle issue_cached(const Transition& t, const Plan& plan, std::shared_ptr<const Recipe> recipe,
                        const DTensorSpec& src, const Tensor& local, const MeshComms& comms, const Tensor& out = {},
                        bool background = false);

// The recipe issue_cached would build for `plan` on the rank at `coord` of src's mesh, built
// without communicators (dtensor-check plan: any rank of any mesh): the time it took and the
// bytes it holds.
struct ScheduleCost {
  double us = 0;
  int64_t bytes = 0;
};
// REQUIRES: coord inside src's mesh; views: the communicators take strided views (local, mpi),
// splitting pieces above view_max_bytes (0: never).
ScheduleCost measure_schedule(const Plan& plan, const DTensorSpec& src, const Dims& coord, bool views = true,
                              int64_t view_max_bytes = 0);

// issue + wait. Returns the new local tensor (or `out`).
Tensor execute(const Plan& plan, const DTensorSpec& src, const Tensor& local, const MeshComms& comms,
               const ReducePolicy& policy = {}, const Tensor& out = {});
std::vector<Tensor> execute_batch(const Plan& plan, std::span<const DTensorSpec> specs,
                                  std::span<const Tensor> locals, const MeshComms& comms,
                                  const ReducePolicy& policy = {}, std::span<const Tensor> outs = {});

}  // namespace dtensor
