// The nccl backend: CUDA tensors moved by NCCL, one rank per GPU. No CUDA or NCCL header is
// needed to use it: without CUDA or NCCL in the build (meson -Dcuda=disabled, or no NCCL found)
// this header still compiles and the factories throw Unsupported, so callers need no #ifdefs.
//
//   // One process drives 2 GPUs with one thread per rank, bootstrapped over the local backend:
//   run_ranks(2, [](Communicator& world) {
//     auto nccl = nccl_communicator(world, /*device=*/world.rank());  // group "world" [0,1]
//     Tensor x = Tensor::full({3}, world.rank(), DType::kF32, Device::cuda(world.rank()));
//     Tensor all = Tensor::empty({6}, DType::kF32, Device::cuda(world.rank()));
//     nccl->wait(nccl->all_gather(x, all));                             // [0,0,0,1,1,1]
//   });
//   // mpirun -np 8 prog: bootstrap over the mpi backend, device = local rank on the node.
//
// Buffers are contiguous CUDA tensors on the communicator's device (a CPU tensor or a tensor on
// another GPU raises InvalidArgument naming both devices).
//
// NOTE [nccl streams] Each communicator owns one CUDA stream (created non-blocking, so compute
// on the device's compute stream and communication overlap). Every call first makes that stream
// wait, through an event, for the work already queued on the compute stream, where the kernels
// layer runs its copies and kernels (NOTE [cuda ordering] in kernels/cuda/cuda_ops.h): an input
// written just before the call is complete when NCCL reads it. The call's Work holds an event
// recorded on the communicator's stream after the NCCL operation; wait() returns once that
// event has completed, so results are visible to anything issued after wait(); wait_on(stream)
// makes a stream wait for it instead, without the host waiting. Without either, nothing orders
// later compute-stream work after the collective. A Work keeps its buffers alive
// until the operation has completed, even when the Work itself is dropped.
//
// NOTE [nccl timeouts] Communicators are created non-blocking (ncclConfig_t::blocking = 0), so no
// NCCL call can block the host forever: creation, split and every enqueue are polled. wait()
// polls the event and ncclCommGetAsyncError until completion, an error or the deadline. On a
// timeout or an asynchronous error the NCCL communicator is aborted (ncclCommAbort: its kernels
// stop) and CommError names the collective, the group and the call number. NCCL cannot tell which
// ranks have not joined a call, so the message says they are unknown. An aborted communicator is
// broken: every later call on it throws CommError, and so does wait() on its other pending Works.
// The peers of an aborted rank typically time out in turn.
//
// NOTE [nccl teardown] The destructor waits (up to the communicator's timeout) for its pending
// operations, then calls ncclCommDestroy; if they did not complete it aborts instead. NCCL makes
// the destruction of the communicators of one node wait for one another (an intra-node barrier,
// run by NCCL's own threads for the communicators of one process), so destroy the communicators
// of all ranks, or let them time out. Nothing throws from the destructor.
//
// Threads: one communicator (and its Works) is used by one thread at a time; different
// communicators may be used from different threads (one thread per GPU). NCCL groups are per
// thread: while a batch (begin_batch) is open on a thread, calls on any other NCCL communicator
// from that thread raise InvalidArgument.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "collectives/communicator.h"

namespace collectives {

// True when this library was compiled with the nccl backend (CUDA and NCCL found).
bool nccl_built();

// Collective over `bootstrap`, any CPU communicator (the mpi backend across processes, or the
// local backend when one process drives several GPUs with one thread per rank): member 0 creates
// the ncclUniqueId and broadcasts it over `bootstrap`, then every member joins an NCCL
// communicator on CUDA device `device` with rank bootstrap.rank() of bootstrap.size(). The new
// communicator has bootstrap's name and ranks; `timeout` bounds its creation and is its default
// wait timeout. Before any NCCL call the members exchange whether their GPU is usable, so all of
// them fail together.
// Throws Unsupported when this build has no NCCL or the GPU cannot be used (no driver, no GPU,
// `device` beyond the visible GPUs), InvalidArgument for a negative device, CommError when NCCL
// fails or some member does not join within `timeout`.
std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, int device,
                                                Milliseconds timeout = kDefaultTimeout);

// One NCCL communicator per device for the GPUs of this process (what ncclCommInitAll does):
// element i has rank i of devices.size() in group "world" and runs on CUDA device devices[i].
// The caller then drives each from its own thread. Throws InvalidArgument for an empty list, a
// negative or repeated device, Unsupported and CommError as nccl_communicator.
std::vector<std::unique_ptr<Communicator>> nccl_communicators_all(
    std::span<const int> devices, Milliseconds timeout = kDefaultTimeout);

}  // namespace collectives
