#!/usr/bin/env python3
"""Record what PyTorch's redistribute does, so the C++ planner can be held to it.

Usage (needs a python with torch 2.15; the build and the tests never do):

    /work/torchvenv/bin/python tests/conformance/gen_redistribute_vectors.py
    TORCH_PYTHON=/path/to/python python3 tests/conformance/gen_redistribute_vectors.py  # re-execs there

Writes tests/conformance/redistribute_vectors.json. For every case (mesh shape, global shape,
source and target placements) torch runs the redistribute for real: one process simulates every
rank with the fake process group and torch.distributed._local_tensor.LocalTensorMode, which
executes each collective on every rank's local tensor. Recorded per case:

  * collectives   what CommDebugMode counted (op name -> count) and their total;
  * received      per rank, the elements torch's collectives delivered to it, from the buffers
                  torch passed (its padding included): all_gather (k-1) x input, reduce_scatter
                  (k-1) x output, all_to_all (k-1)/k x input, all_reduce ceil(2(k-1)/k x input)
                  (the busiest member of a bandwidth-optimal all-reduce, the same model the C++
                  planner uses);
  * torch_correct whether every rank's result equals the target layout of the same global
                  tensor (distribute_tensor of the target, the split rule of
                  docs/pytorch-semantics.md 2.3); a Partial target is reduced with torch's own
                  all-reduce first. Cases where torch is wrong are kept and marked, so the C++
                  test lists them instead of holding the planner to them;
  * error         when torch raised (type and message), instead of the above.
  * verified_by   "local_tensor_mode", or "gloo" for the cases LocalTensorMode could not simulate
                  (it raised): those are re-run with one real gloo process per rank (forked from a
                  fresh interpreter) and keep an error only if the real run fails too
                  (local_tensor_error keeps what LocalTensorMode said).

Cases: PyTorch's own redistribute tests (docs/pytorch-semantics.md 6.2), the FSDP / HSDP /
FSDP x TP / HSDP x TP transitions, then random ones (seed below): meshes 1-D to 3-D with at
most 8 ranks, 1- to 3-D tensors with sizes 0..13 (mostly uneven), placements S, _S (split
factors that encode a mesh order and arbitrary ones), R, P; targets S, _S, R, the source's own
P, and P(sum) from a plain Shard (PyTorch 2.15's zero-fill).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DEFAULT = os.path.join(HERE, "redistribute_vectors.json")
SEED = 2026
NUM_RANDOM = 640
MAX_RANKS = 8


def _reexec_with_torch() -> None:
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    py = os.environ.get("TORCH_PYTHON")
    if py and os.path.realpath(py) != os.path.realpath(sys.executable):
        os.execv(py, [py, os.path.abspath(__file__), *sys.argv[1:]])
    sys.exit("gen_redistribute_vectors: torch is not importable; run it with a python that has torch "
             "2.15 (e.g. /work/torchvenv/bin/python) or set TORCH_PYTHON")


# ----------------------------------------------------------------------------------------------
# Placement notation: S(d), _S(d,sf), R, P (= P(sum)), comma separated, one per mesh dim
# ----------------------------------------------------------------------------------------------

def parse(s: str) -> list[tuple]:
    out, i = [], 0
    while i < len(s):
        if s.startswith("_S(", i):
            j = s.index(")", i)
            d, sf = s[i + 3:j].split(",")
            out.append(("_S", int(d), int(sf)))
            i = j + 1
        elif s.startswith("S(", i):
            j = s.index(")", i)
            out.append(("S", int(s[i + 2:j])))
            i = j + 1
        elif s[i] in "RP":
            out.append((s[i],))
            i += 1
        else:
            raise ValueError(f"bad placements {s!r}")
        if i < len(s):
            assert s[i] == ","
            i += 1
    return out


def fmt(pl: list[tuple]) -> str:
    return ",".join(f"S({p[1]})" if p[0] == "S" else f"_S({p[1]},{p[2]})" if p[0] == "_S" else p[0] for p in pl)


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

def case(mesh, shape, src, dst, source):
    assert len(parse(src)) == len(mesh) == len(parse(dst)), (mesh, src, dst)
    assert math.prod(mesh) <= MAX_RANKS
    return {"source": source, "mesh": list(mesh), "shape": list(shape), "src": src, "dst": dst}


def doc_cases() -> list[dict]:
    c = []
    for shape in [(12, 3), (13, 3), (14, 3), (3, 12), (3, 13), (3, 14)]:
        d = 0 if shape[0] > 3 else 1
        c.append(case((4,), shape, f"S({d})", "R", "doc6.2"))
        c.append(case((4,), shape, "R", f"S({d})", "doc6.2"))
        c.append(case((4,), shape, "P", f"S({d})", "doc6.2"))
        c.append(case((4,), shape, "P", "R", "doc6.2"))
    for shape in [(8, 8), (8, 5), (5, 8), (5, 5)]:
        c.append(case((4,), shape, "S(0)", "S(1)", "doc6.2"))
        c.append(case((4,), shape, "S(1)", "S(0)", "doc6.2"))
    for shape in [(10, 5), (9, 5), (3, 5), (1, 3), (8, 8)]:
        c.append(case((2, 2), shape, "S(0),S(1)", "S(0),S(0)", "doc6.2"))
        c.append(case((2, 2), shape, "S(0),S(1)", "S(1),S(0)", "doc6.2"))
        c.append(case((2, 2), shape, "S(0),S(0)", "S(1),S(1)", "doc6.2"))
        c.append(case((2, 2), shape, "S(0),S(0)", "R,R", "doc6.2"))
    for src, dst in [("S(0),S(0),S(0)", "S(1),S(1),S(1)"), ("S(0),S(1),S(0)", "S(1),S(0),S(0)"),
                     ("S(0),S(1),S(2)", "S(2),S(1),S(0)"), ("S(1),S(0),S(0)", "R,S(0),S(0)"),
                     ("S(1),R,S(0)", "R,S(0),S(0)"), ("S(0),S(0),S(1)", "S(0),S(1),S(2)"),
                     ("P,P,S(0)", "S(0),S(0),S(0)"), ("P,P,P", "S(0),S(0),S(1)")]:
        c.append(case((2, 2, 2), (8, 8, 8), src, dst, "doc6.2"))
    # Redistribute to Partial: the allowed ones (PyTorch 2.15 adds S -> P(sum)).
    for src, dst in [("P,S(0)", "P,S(1)"), ("S(0),P", "R,P"), ("S(0),R", "P,R"), ("S(0),S(1)", "R,P"),
                     ("S(0),S(1)", "P,P"), ("S(0),S(0)", "P,S(0)")]:
        c.append(case((2, 2), (8, 6), src, dst, "doc6.2-partial"))
        c.append(case((2, 2), (7, 5), src, dst, "doc6.2-partial"))
    return c


def fsdp_cases() -> list[dict]:
    """The transitions FSDP, HSDP, FSDP x TP and HSDP x TP use, even and uneven."""
    c = []
    for rows in (16, 13, 7):
        # FSDP on 8 ranks: unshard, reshard, gradient reduce-scatter.
        c += [case((8,), (rows, 3), "S(0)", "R", "fsdp"), case((8,), (rows, 3), "R", "S(0)", "fsdp"),
              case((8,), (rows, 3), "P", "S(0)", "fsdp")]
        # HSDP (replicate 2, shard 4): unshard, reshard, gradient, replica all-reduce.
        c += [case((2, 4), (rows, 3), "R,S(0)", "R,R", "hsdp"), case((2, 4), (rows, 3), "R,R", "R,S(0)", "hsdp"),
              case((2, 4), (rows, 3), "P,P", "R,S(0)", "hsdp"), case((2, 4), (rows, 3), "P,S(0)", "R,S(0)", "hsdp")]
        # FSDP x TP, (dp, tp): column-parallel (TP shards dim 0) and row-parallel (dim 1) weights.
        for dp, tp in ((2, 4), (4, 2)):
            sf = tp
            c += [case((dp, tp), (rows, 6), f"_S(0,{sf}),S(0)", "R,S(0)", "fsdp-tp"),
                  case((dp, tp), (rows, 6), "R,S(0)", f"_S(0,{sf}),S(0)", "fsdp-tp"),
                  case((dp, tp), (rows, 6), "P,S(0)", f"_S(0,{sf}),S(0)", "fsdp-tp"),
                  case((dp, tp), (rows, 6), "S(0),S(1)", "R,S(1)", "fsdp-tp"),
                  case((dp, tp), (rows, 6), "P,S(1)", "S(0),S(1)", "fsdp-tp")]
        # HSDP x TP (replicate 2, shard 2, tp 2).
        c += [case((2, 2, 2), (rows, 4), "R,_S(0,2),S(0)", "R,R,S(0)", "hsdp-tp"),
              case((2, 2, 2), (rows, 4), "R,R,S(0)", "R,_S(0,2),S(0)", "hsdp-tp"),
              case((2, 2, 2), (rows, 4), "P,P,S(0)", "R,_S(0,2),S(0)", "hsdp-tp"),
              case((2, 2, 2), (rows, 4), "P,_S(0,2),S(0)", "R,_S(0,2),S(0)", "hsdp-tp")]
    # reshard_after_forward=k on a dp mesh of 8 unflattened to (2,4): R -> (R,S(0)) and back.
    for rows in (16, 13):
        c += [case((2, 4), (rows, 3), "R,R", "R,S(0)", "fsdp-int"), case((2, 4), (rows, 3), "R,S(0)", "R,R", "fsdp-int")]
    return c


def _mesh_shapes():
    by_nd = {1: [], 2: [], 3: []}
    for nd in (1, 2, 3):
        def rec(prefix):
            if len(prefix) == nd:
                if math.prod(prefix) <= MAX_RANKS:
                    by_nd[nd].append(tuple(prefix))
                return
            for s in range(1, MAX_RANKS + 1):
                if math.prod(prefix) * s <= MAX_RANKS:
                    rec(prefix + [s])
        rec([])
    return by_nd


def _size(rng) -> int:
    u = rng.random()
    if u < 0.05:
        return 0
    if u < 0.12:
        return 1
    return rng.randint(2, 13)


def _strided(rng, mesh, m, d, pl_so_far_unused) -> tuple:
    # Half the time a split factor that encodes a mesh order (the product of the later mesh dims'
    # sizes, what FSDP x TP produces), else an arbitrary one.
    later = math.prod(mesh[m + 1:]) if m + 1 < len(mesh) else 1
    if rng.random() < 0.5 and later > 1:
        return ("_S", d, later)
    return ("_S", d, rng.randint(1, 4))


def random_cases(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    meshes = _mesh_shapes()
    out, seen = [], set()
    while len(out) < n:
        nd = rng.choice((1, 2, 2, 3, 3))
        mesh = rng.choice([m for m in meshes[nd] if all(s > 1 for s in m)] if rng.random() < 0.8 else meshes[nd])
        tnd = rng.randint(1, 3)
        shape = tuple(_size(rng) for _ in range(tnd))
        src, dst = [], []
        for m in range(nd):
            u = rng.random()
            d = rng.randrange(tnd)
            if u < 0.35:
                src.append(("S", d))
            elif u < 0.6:
                src.append(_strided(rng, mesh, m, d, src))
            elif u < 0.8:
                src.append(("R",))
            else:
                src.append(("P",))
        for m in range(nd):
            u = rng.random()
            d = rng.randrange(tnd)
            if src[m][0] == "P" and u < 0.35:
                dst.append(("P",))
            elif src[m][0] == "S" and u < 0.08:
                dst.append(("P",))  # PyTorch 2.15's S -> P(sum)
            elif u < 0.5:
                dst.append(("S", d))
            elif u < 0.75:
                dst.append(_strided(rng, mesh, m, d, dst))
            else:
                dst.append(("R",))
        if src == dst:
            continue
        key = (mesh, shape, fmt(src), fmt(dst))
        if key in seen:
            continue
        seen.add(key)
        out.append(case(mesh, shape, fmt(src), fmt(dst), "random"))
    return out


# ----------------------------------------------------------------------------------------------
# Torch
# ----------------------------------------------------------------------------------------------

def run_all(cases: list[dict]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode, maybe_disable_local_tensor_mode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    def to_torch(pl):
        return [Shard(p[1]) if p[0] == "S" else _StridedShard(p[1], split_factor=p[2]) if p[0] == "_S"
                else Replicate() if p[0] == "R" else Partial() for p in pl]

    def per_rank_numel(t, world):
        lts = getattr(t, "_local_tensors", None)
        if lts is None:
            return {r: t.numel() for r in range(world)}
        return {r: lts[r].numel() for r in lts}

    class Recorder(TorchDispatchMode):
        """Per collective call: (name, group size, per-rank input numel, per-rank output numel)."""

        def __init__(self, world):
            super().__init__()
            self.world = world
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            ns = func.namespace
            name = func._opname
            if ns in ("_c10d_functional", "c10d_functional", "_dtensor"):
                if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
                            "shard_dim_alltoall"):
                    group_name = args[-1]
                    k = _resolve_process_group(group_name).size()
                    self.calls.append((name, k, per_rank_numel(args[0], self.world), per_rank_numel(out, self.world)))
            return out

    def received(calls, world):
        rec = [0] * world
        for name, k, inp, out in calls:
            for r in range(world):
                n = inp.get(r, 0)
                if name == "all_gather_into_tensor":
                    rec[r] += (k - 1) * n
                elif name == "reduce_scatter_tensor":
                    rec[r] += (k - 1) * out.get(r, 0)
                elif name == "all_reduce":
                    rec[r] += (2 * (k - 1) * n + k - 1) // k
                else:  # all_to_all: equal pieces after torch's padding
                    rec[r] += (k - 1) * n // k
        return rec

    def locals_of(t, world):
        lt = t.to_local()
        lts = getattr(lt, "_local_tensors", None)
        return [lts[r] for r in range(world)] if lts is not None else [lt]

    current_world = None
    start = time.time()
    for i, c in enumerate(cases):
        world = math.prod(c["mesh"])
        if world != current_world:
            if current_world is not None:
                dist.destroy_process_group()
            dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
            current_world = world
        src, dst = parse(c["src"]), parse(c["dst"])
        try:
            with LocalTensorMode(frozenset(range(world))):
                with maybe_disable_local_tensor_mode():
                    mesh = init_device_mesh("cpu", tuple(c["mesh"]))
                full = torch.arange(math.prod(c["shape"]), dtype=torch.float64).reshape(c["shape"]) + 1
                x = distribute_tensor(full, mesh, to_torch(src), src_data_rank=None)
                comm = CommDebugMode()
                rec = Recorder(world)
                with comm, rec:
                    y = x.redistribute(mesh, to_torch(dst))
                counts = {str(k).split("'")[1] if "'" in str(k) else str(k): v for k, v in comm.get_comm_counts().items()}
                # Check: a Partial target is reduced with torch's all-reduce first.
                dst_r = [("R",) if p[0] == "P" else p for p in dst]
                z = y.redistribute(mesh, to_torch(dst_r)) if any(p[0] == "P" for p in dst) else y
                want = distribute_tensor(full, mesh, to_torch(dst_r), src_data_rank=None)
                got_l, want_l = locals_of(z, world), locals_of(want, world)
                correct = len(got_l) == len(want_l) and all(
                    a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-9) for a, b in zip(got_l, want_l))
                wrong_ranks = [r for r, (a, b) in enumerate(zip(got_l, want_l))
                               if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-12, atol=1e-9)]
            c["collectives"] = counts
            c["num_collectives"] = sum(counts.values())
            c["received_elements"] = received(rec.calls, world)
            c["torch_correct"] = correct
            c["verified_by"] = "local_tensor_mode"
            if not correct:
                c["wrong_ranks"] = wrong_ranks
        except Exception as e:  # torch refused (or failed on) the transition
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            c["error"] = f"{type(e).__name__}: {msg}"[:300]
        if (i + 1) % 50 == 0:
            print(f"[gen_redistribute_vectors] {i + 1}/{len(cases)} cases, {time.time() - start:.0f} s",
                  file=sys.stderr, flush=True)
    if current_world is not None:
        dist.destroy_process_group()


def _gloo_rank(rank, world, c, init_file, queue):
    """One rank of a real gloo run of case c (a process of its own): counts, what this rank
    received, whether its result is right, or the error it raised."""
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.utils._python_dispatch import TorchDispatchMode

    def to_torch(pl):
        return [Shard(p[1]) if p[0] == "S" else _StridedShard(p[1], split_factor=p[2]) if p[0] == "_S"
                else Replicate() if p[0] == "R" else Partial() for p in pl]

    received = [0]

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace in ("_c10d_functional", "c10d_functional", "_dtensor"):
                name = func._opname
                if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
                            "shard_dim_alltoall"):
                    k = _resolve_process_group(args[-1]).size()
                    n = args[0].numel()
                    received[0] += ((k - 1) * n if name == "all_gather_into_tensor"
                                    else (k - 1) * out.numel() if name == "reduce_scatter_tensor"
                                    else (2 * (k - 1) * n + k - 1) // k if name == "all_reduce"
                                    else (k - 1) * n // k)
            return out

    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}",
                                timeout=datetime.timedelta(seconds=30))
        mesh = init_device_mesh("cpu", tuple(c["mesh"]))
        src, dst = parse(c["src"]), parse(c["dst"])
        full = torch.arange(math.prod(c["shape"]), dtype=torch.float64).reshape(c["shape"]) + 1
        x = distribute_tensor(full, mesh, to_torch(src), src_data_rank=None)
        comm = CommDebugMode()
        with comm, Recorder():
            y = x.redistribute(mesh, to_torch(dst))
        result["counts"] = {str(k).split("'")[1] if "'" in str(k) else str(k): v for k, v in comm.get_comm_counts().items()}
        dst_r = [("R",) if p[0] == "P" else p for p in dst]
        z = y.redistribute(mesh, to_torch(dst_r)) if any(p[0] == "P" for p in dst) else y
        want = distribute_tensor(full, mesh, to_torch(dst_r), src_data_rank=None).to_local()
        got = z.to_local()
        result["correct"] = got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-9)
        result["received"] = received[0]
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        result["error"] = f"{type(e).__name__}: {msg}"[:300]
    queue.put(result)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_gloo(cases: list[dict]) -> None:
    """Re-runs, with one real gloo process per rank, the cases LocalTensorMode could not simulate
    (it raised): these get the outcome of a real run (torch's own error, if it really raises)."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("fork")
    for c in cases:
        world = math.prod(c["mesh"])
        with tempfile.TemporaryDirectory() as tmp:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_gloo_rank, args=(r, world, c, os.path.join(tmp, "init"), queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            results = []
            for _ in procs:
                try:
                    results.append(queue.get(timeout=120))
                except Exception:
                    break
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        lt_error = c.pop("error")
        errors = [r["error"] for r in results if "error" in r]
        if len(results) < world or errors:
            c["error"] = errors[0] if errors else f"gloo run incomplete ({len(results)} of {world} ranks)"
            c["local_tensor_error"] = lt_error
            continue
        results.sort(key=lambda r: r["rank"])
        c["collectives"] = results[0]["counts"]
        c["num_collectives"] = sum(results[0]["counts"].values())
        c["received_elements"] = [r["received"] for r in results]
        c["torch_correct"] = all(r["correct"] for r in results)
        if not c["torch_correct"]:
            c["wrong_ranks"] = [r["rank"] for r in results if not r["correct"]]
        c["verified_by"] = "gloo"
        c["local_tensor_error"] = lt_error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT_DEFAULT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--num-random", type=int, default=NUM_RANDOM)
    ap.add_argument("--gloo-only", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    _reexec_with_torch()
    import torch

    if args.gloo_only:
        with open(args.gloo_only[0]) as f:
            todo = json.load(f)
        run_gloo(todo)
        with open(args.gloo_only[1], "w") as f:
            json.dump(todo, f)
        return

    cases = doc_cases() + fsdp_cases() + random_cases(args.seed, args.num_random)
    # Group by world size so the fake process group is re-created rarely; ids keep the order.
    for i, c in enumerate(cases):
        c["id"] = i
    order = sorted(cases, key=lambda c: (math.prod(c["mesh"]), c["id"]))
    run_all(order)
    failed = [c for c in cases if "error" in c]
    print(f"[gen_redistribute_vectors] re-running {len(failed)} cases LocalTensorMode raised on with gloo",
          file=sys.stderr, flush=True)
    # In a fresh interpreter: forked rank processes must not inherit LocalTensorMode's patches.
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        todo, done = os.path.join(tmp, "todo.json"), os.path.join(tmp, "done.json")
        with open(todo, "w") as f:
            json.dump(failed, f)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--gloo-only", todo, done], check=True)
        with open(done) as f:
            by_id = {c["id"]: c for c in json.load(f)}
    cases = [by_id.get(c["id"], c) for c in cases]
    errors = sum(1 for c in cases if "error" in c)
    wrong = sum(1 for c in cases if c.get("torch_correct") is False)
    header = {
        "torch_version": torch.__version__,
        "generator": "tests/conformance/gen_redistribute_vectors.py",
        "seed": args.seed,
        "num_cases": len(cases),
        "num_error_cases": errors,
        "num_torch_wrong": wrong,
        "received_model": "elements per rank delivered by torch's collectives (padding included): all_gather "
                          "(k-1) x input, reduce_scatter (k-1) x output, all_to_all (k-1)/k x input, all_reduce "
                          "ceil(2(k-1)/k x input)",
    }
    with open(args.out, "w") as f:
        f.write(json.dumps(header)[:-1] + ',"cases":[\n')
        f.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
        f.write("\n]}\n")
    print(f"[gen_redistribute_vectors] {len(cases)} cases, {errors} torch errors, {wrong} where torch is wrong "
          f"-> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
