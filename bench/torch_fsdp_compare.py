#!/usr/bin/env python3
"""PyTorch FSDP2 and our fsdp-train side by side: FSDP, HSDP and FSDP x TP (issue 11 item 7).

Both sides train fsdp-train's GPT from the same initial weights (one plain `fsdp-train
--dump-init` run writes them; torch reads them with `safetensors`), on the same batches (the
generator of torch_train_compare.py, fsdp-train's bit for bit), with the same AdamW
(foreach=False), gradient clipping and hyper-parameters. The model, the generator, the optimizer,
the training step, the TP plan and the option parsing are imported from torch_train_compare.py.

Configs (the world size is the product; each side gets --cores / world CPU threads per rank):
  fsdp4      ours: fsdp-train --backend local --dp-shard 4
             torch: 4 gloo processes, 1-D mesh, fully_shard on every block, then on the root
  hsdp2x2    ours: --dp-replicate 2 --dp-shard 2
             torch: 2-D mesh (replicate, shard), fully_shard with that mesh (HSDP)
  fsdp2xtp2  ours: --dp-shard 2 --tp 2
             torch: 2-D mesh (dp, tp): parallelize_module on tp with torch_train_compare.py's plan
             (sequence parallel, loss parallel), then fully_shard on dp
(other sizes by name: fsdpN, hsdpRxS, fsdpDxtpT; a `-mpi` suffix runs ours under mpirun
--backend mpi.) fully_shard options as ours: reshard_after_forward=True (the root is kept
unsharded after forward by FSDP2 itself, as ours), fp32; --mp bf16 gives both sides bf16
parameters with f32 gradient reduction (MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=f32), the root's also output_dtype=f32 so that the loss is computed in f32).
--no-sync: with --grad-accum > 1, gradients are reduced on the last microbatch only
(set_requires_gradient_sync).

Data parallelism: the global batch is the same as one rank's; dp rank d of D trains rows
[d * micro / D, (d + 1) * micro / D) of each microbatch; the loss reported is the mean over the
dp ranks (TP ranks of one dp rank share its rows).

Peak memory, per config, both as "the largest live tensor bytes of one rank, maximum over ranks":
  ours_peak_bytes   fsdp-train's JSON `peak_bytes` (its mesh allocator's high-water mark:
                    parameters, gradients, optimizer state, activations, buffers); null when absent
  torch_peak_bytes  torch's own tensor-memory tracker (torch.distributed._tools.FSDPMemTracker, a
                    TorchDispatchMode that counts every live tensor storage, FSDP's all-gather and
                    reduce-scatter buffers included, exact bytes on CPU) over one extra, untimed
                    step after the timed ones (optimizer state exists then, as in ours' steady
                    state), the maximum over ranks
  torch_peak_rss_delta_bytes  a coarse cross-check: growth of the process's peak RSS (getrusage
                    ru_maxrss) over the timed steps, the maximum over ranks (includes allocator
                    caching, gloo buffers, thread stacks; not comparable to ours)
Validation of the torch side alone: every run also trains torch on one process (the tp1 path of
torch_train_compare.py) and reports torch_ref_max_rel_diff, FSDP2's losses against it (limit
--reference-tolerance, default 1e-5; fp32 only: under --mp bf16 it is null), and that process's
peak (torch's MemTracker, the same way) as torch_one_process_peak_bytes.

Exposed communication (FSDP and HSDP configs in fp32; fsdp-bench has no TP), both sides split
the same way as fsdp-bench: step = forward + backward under FSDP (no optimizer), compute = the
same forward + backward without FSDP on the local batch, comm = the step's collectives alone in
sequence (per FSDP module two unshard + reshard, one reduce-scatter of its flat gradient, HSDP
then an all-reduce over the replicate dim); exposed = (step - compute) / comm, medians over
--exposed-iters interleaved rounds (default 5; 0: off), then over repeats. Ours: fsdp-bench with
the same model, dp layout and threads at FSDP2's defaults (prefetch 1, the padded layout). Torch:
the same FSDP2 model after its timed steps; compute on an unsharded copy from the same weights;
comm: FSDPModule.unshard() / reshard() and dist.reduce_scatter_tensor of FSDP2's padded flat
size (flat_reduce_numel), on gloo. Targets per config: ours <= torch's (exposed_vs_torch_ok),
and ours <= 0.10 only where our collectives take >= 1 ms each (exposed_absolute_applies /
exposed_absolute_ok); shorter collectives are dominated by per-call costs no overlap hides. A
median step faster than the median compute alone (a load swing between the two) gives no
verdict (exposed_note). Both sides also give the three parts as CPU time per rank (each side's
process CPU time over its ranks) and exposed_cpu, their quotient: where the collectives are
copies by CPU threads on cores the compute already fills, wall-clock exposed cannot drop far
below it, and CPU time is much less disturbed by other jobs' load than wall time.

Usage (from the repository root):
    python3 bench/torch_fsdp_compare.py --python /path/to/python-with-torch [--build-dir build]
    TORCH_PYTHON=... BUILD_DIR=... python3 bench/torch_fsdp_compare.py --configs fsdp4,hsdp2x2
    python3 bench/torch_fsdp_compare.py --torch-only ...       # torch's side only (no FSDP in ours)
    python3 bench/torch_fsdp_compare.py --torch-json T.json    # ours against a recorded torch run
The last line of the output is one JSON object:
    {"max_rel_loss_diff": .., "configs": [{"config": "fsdp4", "max_rel_loss_diff": ..,
      "ours_step_ms": .., "torch_step_ms": .., "ratio": .., "ours_peak_bytes": ..,
      "torch_peak_bytes": .., "ours_exposed": .., "torch_exposed": .., "exposed_vs_torch_ok": ..,
      "ours_exposed_parts": {"step_ms", "compute_ms", "lost_ms", "comm_ms", "collective_ms",
      "exposed", "step_cpu_ms", "compute_cpu_ms", "comm_cpu_ms", "exposed_cpu"}, ...}, ...]}
(a Markdown table of the exposed communication, ours and torch side by side, comes before it).
Exit status: 0 when every config's losses agree within --tolerance (default 1e-4; bf16 2e-2) and
torch FSDP2 agrees with torch on one process within --reference-tolerance; 1 otherwise; 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_train_compare as ttc  # noqa: E402  (no torch at import time)

TAG = "torch_fsdp_compare"


def log(msg: str) -> None:
    print(f"[{TAG}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Configs and the data split (pure Python: the offline test checks them)
# ---------------------------------------------------------------------------------------------

def parse_config(name: str) -> dict:
    """`fsdp4` / `hsdp2x2` / `fsdp2xtp2` (any sizes), optionally `-mpi`, -> the layout on both sides.
    Raises ValueError for anything else."""
    base, backend = (name[:-4], "mpi") if name.endswith("-mpi") else (name, "local")
    m = re.fullmatch(r"fsdp(\d+)", base)
    if m:
        n = int(m.group(1))
        c = {"kind": "fsdp", "mesh": [n], "dp": n, "tp": 1, "ours": ["--dp-shard", str(n)]}
    elif (m := re.fullmatch(r"hsdp(\d+)x(\d+)", base)):
        r, s = int(m.group(1)), int(m.group(2))
        c = {"kind": "hsdp", "mesh": [r, s], "dp": r * s, "tp": 1,
             "ours": ["--dp-replicate", str(r), "--dp-shard", str(s)]}
    elif (m := re.fullmatch(r"fsdp(\d+)xtp(\d+)", base)):
        d, t = int(m.group(1)), int(m.group(2))
        c = {"kind": "fsdp_tp", "mesh": [d, t], "dp": d, "tp": t, "ours": ["--dp-shard", str(d), "--tp", str(t)]}
    else:
        raise ValueError(f"unknown config {name!r}: expected fsdpN, hsdpRxS or fsdpDxtpT (e.g. fsdp4, hsdp2x2, "
                         f"fsdp2xtp2), optionally with -mpi")
    if any(v < 1 for v in c["mesh"]):
        raise ValueError(f"config {name!r}: mesh sizes must be >= 1")
    c.update(name=name, backend=backend, world=c["dp"] * c["tp"])
    return c


def dp_rows(step: int, m: int, batch: int, grad_accum: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """(first global row, count) of microbatch m of `step` that dp rank `dp_rank` of `dp_size` trains.
    REQUIRES: batch % grad_accum == 0 and (batch / grad_accum) % dp_size == 0."""
    micro = batch // grad_accum
    local = micro // dp_size
    return step * batch + m * micro + dp_rank * local, local


# ---------------------------------------------------------------------------------------------
# The torch side (runs under an interpreter with torch)
# ---------------------------------------------------------------------------------------------

def fsdp_worker(rank: int, world: int, cfg: dict, port: int, out_path: str) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    model = ttc.build_gpt(cfg)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layout = cfg["layout"]
    positions, loss_ctx, loss_group = torch.arange(cfg["seq"]), None, None
    if layout["kind"] == "fsdp":
        dp_mesh = init_device_mesh("cpu", tuple(layout["mesh"]), mesh_dim_names=("shard",))
        dp_rank, dp_size = rank, world
    elif layout["kind"] == "hsdp":
        dp_mesh = init_device_mesh("cpu", tuple(layout["mesh"]), mesh_dim_names=("replicate", "shard"))
        dp_rank, dp_size = rank, world  # rank = r * shard + s: the flattened (replicate, shard) index
    else:
        mesh = init_device_mesh("cpu", tuple(layout["mesh"]), mesh_dim_names=("dp", "tp"))
        positions, loss_ctx = ttc.apply_tensor_parallel(model, mesh["tp"], cfg["seq"])
        dp_mesh = mesh["dp"]
        dp_rank, dp_size = dp_mesh.get_local_rank(), layout["dp"]
        loss_group = dp_mesh.get_group()
    if cfg["mp"] == "bf16":
        # The root's output (the logits) in f32: the loss's statistics in f32, as fsdp-train --mp bf16.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
    else:
        policy = root_policy = MixedPrecisionPolicy()  # fp32 throughout
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True, mp_policy=root_policy)

    params = list(model.parameters())
    opt = ttc.make_adamw(params, cfg)
    B, M = cfg["batch"], cfg["grad_accum"]

    def reduce_loss(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=loss_group)
        return t.item() / dp_size

    def before_microbatch(m: int) -> None:
        if cfg["no_sync"]:
            model.set_requires_gradient_sync(m == M - 1)

    step_fn = ttc.TrainStep(model, params, opt, cfg, positions, loss_ctx,
                            rows=lambda step, m: dp_rows(step, m, B, M, dp_rank, dp_size),
                            reduce_loss=reduce_loss, before_microbatch=before_microbatch)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    losses, times = ttc.timed_steps(step_fn, cfg["steps"])
    rss_delta = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024  # KiB on Linux
    exposed = None
    if cfg.get("exposed_iters", 0) > 0 and layout["kind"] in ("fsdp", "hsdp"):
        model.set_requires_gradient_sync(True)
        exposed = exposed_parts(model, cfg, dp_mesh, layout["kind"] == "hsdp", dp_rows(0, 0, B, 1, dp_rank, dp_size))

    # Peak live tensor bytes: torch's tracker over one more (untimed) step.
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    tracker = FSDPMemTracker(model, opt)

    def before_tracked_microbatch(m: int) -> None:
        before_microbatch(m)
        if m > 0:  # the tracker takes one forward per module; its global peak survives the reset
            tracker.reset_mod_stats()

    step_fn.before_microbatch = before_tracked_microbatch
    peak, breakdown, error = None, None, None
    try:
        with tracker:
            step_fn(cfg["steps"])
        peak_snap = tracker.get_tracker_snapshot("peak")
        peak = max((snap.get("Total", 0) for snap in peak_snap.values()), default=0)
        breakdown = {getattr(k, "name", str(k)): v for snap in peak_snap.values() for k, v in snap.items()}
    except Exception as e:  # a tracker limitation costs the memory figure (null, with why), not the losses
        error = f"{type(e).__name__}: {e}"

    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"peak": peak, "rss_delta": rss_delta, "breakdown": breakdown, "error": error})
    if rank == 0:
        errors = [r["error"] for r in per_rank if r["error"]]
        worst = None if errors else max(range(world), key=lambda r: per_rank[r]["peak"])
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "times": times,
                       "peak_bytes": None if errors else per_rank[worst]["peak"],
                       "peak_breakdown": None if errors else per_rank[worst]["breakdown"],
                       "peak_error": errors[0] if errors else None,
                       "peak_bytes_per_rank": [r["peak"] for r in per_rank],
                       "rss_delta_bytes": max(r["rss_delta"] for r in per_rank), "exposed": exposed}, f)
    dist.destroy_process_group()


def flat_reduce_numel(params, shard: int) -> int:
    """FSDP2's reduce-scatter input elements for one group: each parameter's dim 0 padded to a
    multiple of the shard ranks, summed (what FSDP2's copy-in fills)."""
    total = 0
    for p in params:
        rows = -(-p.shape[0] // shard) * shard
        total += rows * (p.numel() // p.shape[0] if p.shape[0] else 0)
    return total


def exposed_parts(model, cfg: dict, dp_mesh, hsdp: bool, rows: tuple[int, int]) -> dict:
    """fsdp-bench's decomposition for torch FSDP2 (fwd + bwd, no optimizer), `exposed_iters`
    rounds interleaved, medians, seconds:
      step     forward + backward of the FSDP2 model on this rank's rows
      compute  the same forward + backward on an unsharded copy of the model (no FSDP)
      comm     per FSDP module (blocks, then the root) two unshard() + reshard() and one
               reduce_scatter_tensor of its flat gradient size (HSDP: then all_reduce of the shard
               over the replicate group), in sequence
    each between two barriers. REQUIRES: a 1-D (shard) or 2-D (replicate, shard) dp_mesh."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    positions = torch.arange(cfg["seq"])
    ids, targets = ttc.make_batch(cfg["seed"], 0, rows[0], rows[1], cfg["seq"], cfg["vocab"])
    ids, targets = torch.tensor(ids, dtype=torch.long), torch.tensor(targets, dtype=torch.long)
    plain = ttc.build_gpt(cfg)  # the same weights, no FSDP

    def fwd_bwd(m) -> None:
        F.cross_entropy(m(ids, positions).flatten(0, 1), targets.flatten(0, 1)).backward()
        m.zero_grad(set_to_none=True)

    shard_group = dp_mesh["shard"].get_group() if hsdp else dp_mesh.get_group()
    rep_group = dp_mesh["replicate"].get_group() if hsdp else None
    shard = dist.get_world_size(shard_group)
    modules = list(model.blocks) + [model]
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    owned = [list(b.parameters()) for b in model.blocks] + [[p for p in model.parameters() if id(p) not in in_blocks]]
    flats = [torch.zeros(flat_reduce_numel(ps, shard)) for ps in owned]
    outs = [torch.empty(f.numel() // shard) for f in flats]

    def comm_only() -> None:
        for m, flat, out in zip(modules, flats, outs):
            for _ in range(2):  # the forward and the backward all-gather
                m.unshard()
                m.reshard()
            dist.reduce_scatter_tensor(out, flat, group=shard_group)
            if rep_group is not None:
                dist.all_reduce(out, group=rep_group)

    def timed(fn) -> tuple[float, float]:
        """Wall-clock and this process's (this rank's) CPU time, seconds."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        dist.barrier()
        return time.perf_counter() - t0, time.process_time() - c0

    for fn in (lambda: fwd_bwd(plain), comm_only, lambda: fwd_bwd(model)):  # warm-up
        timed(fn)
    step, compute, comm = [], [], []
    for _ in range(cfg["exposed_iters"]):  # rounds interleave, as fsdp-bench
        compute.append(timed(lambda: fwd_bwd(plain)))
        comm.append(timed(comm_only))
        step.append(timed(lambda: fwd_bwd(model)))
    out = {"collectives": len(modules) * (4 if hsdp else 3)}
    for name, times in (("step", step), ("compute", compute), ("comm", comm)):
        out[f"{name}_s"] = statistics.median(t[0] for t in times)
        out[f"{name}_cpu_s"] = statistics.median(t[1] for t in times)
    return out


def torch_main(args) -> None:
    cfg = json.loads(args.torch_config)
    import torch.multiprocessing as mp
    mp.spawn(fsdp_worker, args=(cfg["world"], cfg, ttc.free_port(), args.torch_out), nprocs=cfg["world"], join=True)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def dump_init(build: str, model_args: list[str], path: str) -> None:
    """The initial weights from one plain fsdp-train run (no data parallelism: works before FSDP)."""
    exe = ttc.fsdp_train_exe(build)
    args = list(model_args)
    args[args.index("--steps") + 1] = "1"
    ttc.run_fsdp_train([exe, "--backend", "local", "--log-every", "1"] + args + ["--dump-init", path], TAG)


def run_ours(build: str, layout: dict, model_args: list[str], threads: int, extra: list[str]) -> dict:
    exe = ttc.fsdp_train_exe(build)
    cmd = [exe, "--backend", layout["backend"]] + layout["ours"] + ["--log-every", "1", "--threads", str(threads)]
    cmd += model_args + extra
    if layout["backend"] == "mpi":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(layout["world"])] + cmd
    return ttc.run_fsdp_train(cmd, TAG)


def fsdp_bench_exe(build: str) -> str:
    exe = os.path.join(build, "bench", "fsdp-bench")
    if not os.path.exists(exe):
        sys.exit(f"{exe} not found: build it (ninja -C {build} bench/fsdp-bench), pass --build-dir, or --exposed-iters 0")
    return exe


def run_ours_exposed(build: str, layout: dict, args, threads: int) -> dict:
    """fsdp-bench on the same model and dp layout, FSDP2's defaults (prefetch 1, the padded layout):
    {"step_s", "compute_s", "comm_s", their *_cpu_s, "collectives"} of rank 0, as exposed_parts
    gives torch's (no *_cpu_s from an fsdp-bench without them)."""
    exe = fsdp_bench_exe(build)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [exe, "--backend", layout["backend"]] + layout["ours"] + [
        "--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads), "--vocab", str(args.vocab),
        "--seq", str(args.seq), "--batch", str(args.batch), "--threads", str(threads), "--prefetch", "1",
        "--layouts", "padded", "--iters", str(args.exposed_iters), "--warmup", "1", "--json", out]
    if layout["backend"] == "mpi":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(layout["world"])] + cmd
    log("ours: " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        if r.returncode != 0:
            sys.exit(f"fsdp-bench failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        with open(out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    finally:
        os.unlink(out)
    row = next((x for x in rows if x.get("layout") == "padded" and x.get("prefetch") == 1), None)
    if row is None:
        sys.exit(f"fsdp-bench printed no padded prefetch 1 row: {rows}")
    groups = args.layers + 1
    out = {"collectives": groups * (4 if layout["kind"] == "hsdp" else 3)}
    for name in ("step", "compute", "comm"):
        out[f"{name}_s"] = row[f"{name}_ms"] / 1e3
        if f"{name}_cpu_ms" in row:
            out[f"{name}_cpu_s"] = row[f"{name}_cpu_ms"] / 1e3
    return out


def exposed_summary(parts: list[dict]):
    """Medians over repeats of each part -> {step_ms, compute_ms, comm_ms, exposed, collective_ms,
    step_cpu_ms, compute_cpu_ms, comm_cpu_ms, exposed_cpu}; the CPU figures None unless every part
    has them. None when there are no parts (TP configs, --exposed-iters 0, an old torch record)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    step, compute, comm = (statistics.median(p[k] for p in parts) * 1e3 for k in ("step_s", "compute_s", "comm_s"))
    out = {"step_ms": round(step, 3), "compute_ms": round(compute, 3), "comm_ms": round(comm, 3),
           "lost_ms": round(step - compute, 3), "exposed": round((step - compute) / comm, 3) if comm > 0 else None,
           "collective_ms": round(comm / parts[0]["collectives"], 4),
           "step_cpu_ms": None, "compute_cpu_ms": None, "comm_cpu_ms": None, "exposed_cpu": None}
    if all("step_cpu_s" in p for p in parts):
        cpu = {k: statistics.median(p[f"{k}_cpu_s"] for p in parts) * 1e3 for k in ("step", "compute", "comm")}
        out.update({f"{k}_cpu_ms": round(v, 3) for k, v in cpu.items()})
        if cpu["comm"] > 0:
            out["exposed_cpu"] = round((cpu["step"] - cpu["compute"]) / cpu["comm"], 3)
    return out


# The absolute target applies where each collective takes at least this long (shorter ones are
# dominated by fixed per-call costs that no overlap can hide).
ABSOLUTE_EXPOSED = 0.10
ABSOLUTE_MIN_COLLECTIVE_MS = 1.0


def exposed_verdict(ours, torch_side) -> dict:
    """The exposed-communication targets of one config: ours <= torch's (both measured), and
    ours <= 0.10 where our collectives take >= 1 ms each. A side whose median step is faster than
    its median compute alone (load moved between them) is no figure: no verdict, exposed_note."""
    oe = ours["exposed"] if ours else None
    te = torch_side["exposed"] if torch_side else None
    applies = bool(ours) and ours["collective_ms"] >= ABSOLUTE_MIN_COLLECTIVE_MS and oe is not None
    noisy = [side for side, x in (("ours", ours), ("torch", torch_side)) if x and x["lost_ms"] < 0]
    out = {"ours_exposed": oe, "torch_exposed": te,
           "exposed_vs_torch_ok": None if oe is None or te is None or noisy else oe <= te,
           "exposed_absolute_applies": applies,
           "exposed_absolute_ok": (oe <= ABSOLUTE_EXPOSED) if applies and "ours" not in noisy else None}
    if noisy:
        out["exposed_note"] = f"{' and '.join(noisy)}: step faster than compute alone (load): not a figure"
    return out


def ours_peak(runs: list[dict]):
    """fsdp-train's `peak_bytes` (max over repeats), None when its JSON has no such key; plus the
    progress line's other peak_* figures (the FSDP issue's per-kind peaks) when present."""
    peaks = [r["summary"].get("peak_bytes") for r in runs]
    peak = None if any(p is None for p in peaks) else max(int(p) for p in peaks)
    detail = {k: int(v) for k, v in runs[-1]["last_progress"].items()
              if k.startswith("peak_") and k != "peak_bytes" and isinstance(v, float)}
    return peak, detail


def torch_entry(name: str, runs: list[dict], ref_losses: list[float] | None) -> dict:
    """The torch side of one config from its repeats (losses of the first run)."""
    losses = runs[0]["losses"]
    ms = statistics.median(ttc.median_ms([t * 1e3 for t in r["times"]]) for r in runs)
    peaks = [r["peak_bytes"] for r in runs]
    return {"config": name, "torch_losses": losses, "torch_step_ms": round(ms, 3),
            "torch_peak_bytes": None if None in peaks else max(peaks),
            "torch_peak_breakdown": runs[0].get("peak_breakdown"), "torch_peak_error": runs[0].get("peak_error"),
            "torch_peak_rss_delta_bytes": max(r["rss_delta_bytes"] for r in runs),
            "torch_ref_max_rel_diff": ttc.max_rel_diff(losses, ref_losses) if ref_losses else None,
            "torch_exposed_parts": exposed_summary([r.get("exposed") for r in runs])}


def merge(layout: dict, ours_runs: list[dict], t: dict, steps: int, tokens: int, ours_exposed=None) -> dict:
    """One config's record: ours' runs against the torch entry `t` (torch_entry); ours_exposed:
    exposed_summary of fsdp-bench's runs (None: not measured)."""
    name = layout["name"]
    ours_losses, torch_losses = ours_runs[0]["losses"], t["torch_losses"]
    if len(ours_losses) != steps or len(torch_losses) != steps:
        sys.exit(f"{name}: expected {steps} losses, got ours {len(ours_losses)} torch {len(torch_losses)}")
    rel = ttc.max_rel_diff(ours_losses, torch_losses)
    ours_ms = statistics.median(ttc.median_ms(r["ms"]) for r in ours_runs)
    torch_ms = t["torch_step_ms"]
    peak, detail = ours_peak(ours_runs)
    tpeak = t["torch_peak_bytes"]
    return {"config": name, "world": layout["world"], "backend": layout["backend"], "ours_flags": " ".join(layout["ours"]),
            "max_rel_loss_diff": rel, "ours_step_ms": round(ours_ms, 3), "torch_step_ms": torch_ms,
            "ratio": round(ours_ms / torch_ms, 3), "ours_tokens_per_s": round(tokens / ours_ms * 1e3),
            "torch_tokens_per_s": round(tokens / torch_ms * 1e3), "ours_peak_bytes": peak,
            "torch_peak_bytes": tpeak,
            "peak_ratio": round(peak / tpeak, 3) if peak is not None and tpeak else None,
            "ours_peak_detail": detail, "torch_peak_breakdown": t.get("torch_peak_breakdown"),
            "torch_peak_rss_delta_bytes": t.get("torch_peak_rss_delta_bytes"),
            "torch_ref_max_rel_diff": t.get("torch_ref_max_rel_diff"),
            "torch_one_process_peak_bytes": t.get("torch_one_process_peak_bytes"),
            "ours_exposed_parts": ours_exposed, "torch_exposed_parts": t.get("torch_exposed_parts"),
            **exposed_verdict(ours_exposed, t.get("torch_exposed_parts")),
            "first_loss": ours_losses[0], "last_loss": ours_losses[-1],
            "ours_losses": ours_losses, "torch_losses": torch_losses}


def fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / 1024:.1f}K"


def fmt_exposed(ours, torch_side) -> str:
    def one(x):
        return "-" if not x or x["exposed"] is None else f"{x['exposed']:.3f} ({x['collective_ms']:.3f} ms/collective)"
    return f"ours {one(ours)} torch {one(torch_side)}"


def exposed_table(results: list[dict]) -> str:
    """Markdown: exposed communication, ours and torch side by side, per config measured."""
    lines = ["| config | side | step ms | compute ms | step - compute ms | comm ms | ms / collective | exposed | "
             "exposed (CPU) | target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ours, theirs = r.get("ours_exposed_parts"), r.get("torch_exposed_parts")
        if not ours and not theirs:
            continue
        for side, x in (("ours", ours), ("torch", theirs)):
            if not x:
                lines.append(f"| {r['config']} | {side} | - | - | - | - | - | - | - | |")
                continue
            target = ""
            if side == "ours":
                vs = r.get("exposed_vs_torch_ok")
                target = "ours <= torch: " + ("-" if vs is None else "yes" if vs else "no")
                if r.get("exposed_absolute_applies"):
                    ok = r.get("exposed_absolute_ok")
                    target += f"; <= {ABSOLUTE_EXPOSED}: " + ("-" if ok is None else "yes" if ok else "no")
                if r.get("exposed_note"):
                    target += f" ({r['exposed_note']})"
            exposed = "-" if x["exposed"] is None else f"{x['exposed']:.3f}"
            cpu = "-" if x.get("exposed_cpu") is None else f"{x['exposed_cpu']:.3f}"
            lines.append(f"| {r['config']} | {side} | {x['step_ms']:.2f} | {x['compute_ms']:.2f} | {x['lost_ms']:.2f} | "
                         f"{x['comm_ms']:.2f} | "
                         f"{x['collective_ms']:.3f} | {exposed} | {cpu} | {target} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ttc.add_common_args(ap, "fsdp4,hsdp2x2,fsdp2xtp2")
    ap.set_defaults(tolerance=None)
    ap.add_argument("--mp", choices=["fp32", "bf16"], default="fp32", help="both sides' precision (fsdp-train --mp)")
    ap.add_argument("--no-sync", action="store_true", help="reduce gradients on the last microbatch only")
    ap.add_argument("--reference-tolerance", type=float, default=None,
                    help="torch FSDP2 vs torch on one process, fp32 (default 1e-5)")
    ap.add_argument("--torch-only", action="store_true", help="run and report torch's side only")
    ap.add_argument("--torch-json", help="take torch's side from this file (the last line of a --torch-only run)")
    ap.add_argument("--init", help="initial weights (safetensors); default: fsdp-train --dump-init")
    ap.add_argument("--exposed-iters", type=int, default=5,
                    help="rounds of the exposed-communication measurement per side and repeat (0: off)")
    args = ap.parse_args()
    if args.torch_worker:
        torch_main(args)
        return 0
    tolerance = args.tolerance if args.tolerance is not None else (2e-2 if args.mp == "bf16" else 1e-4)
    ref_tolerance = args.reference_tolerance if args.reference_tolerance is not None else 1e-5
    try:
        layouts = [parse_config(c) for c in args.configs.split(",") if c]
        if not layouts:
            raise ValueError("--configs: no config given")
        for lay in layouts:
            micro = args.batch // args.grad_accum if args.grad_accum > 0 else 0
            if args.grad_accum < 1 or args.batch % args.grad_accum or micro % lay["dp"]:
                raise ValueError(f"{lay['name']}: --batch {args.batch} / --grad-accum {args.grad_accum} = {micro} "
                                 f"sequences per microbatch, not divisible over {lay['dp']} dp ranks")
        if args.exposed_iters < 0:
            raise ValueError(f"--exposed-iters {args.exposed_iters}: expected >= 0")
        if args.torch_only and args.torch_json:
            raise ValueError("--torch-only and --torch-json exclude each other")
    except ValueError as e:
        print(f"{TAG}: {e}", file=sys.stderr)
        return 2

    model_args = ttc.ours_model_args(args)
    extra = (["--mp", args.mp] if args.mp != "fp32" else []) + (["--no-sync"] if args.no_sync else [])
    tokens = args.batch * args.seq
    work = tempfile.mkdtemp(prefix=f"{TAG}.")
    try:
        recorded = None
        if args.torch_json:
            with open(args.torch_json) as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
            record = json.loads(lines[-1])
            # The same model, data and training on both sides, or the comparison means nothing.
            if "model_args" in record and (record["model_args"] != model_args or record.get("mp") != args.mp
                                           or record.get("no_sync") != args.no_sync):
                print(f"{TAG}: {args.torch_json} was recorded with {' '.join(record['model_args'])} --mp "
                      f"{record.get('mp')} no_sync {record.get('no_sync')}, not {' '.join(model_args)} --mp {args.mp} "
                      f"no_sync {args.no_sync}", file=sys.stderr)
                return 2
            recorded = {c["config"]: c for c in record["configs"]}
        else:
            py = ttc.torch_python(args.python)
            init = args.init
            if not init:
                init = os.path.join(work, "init.safetensors")
                dump_init(args.build_dir, model_args, init)
            cfg = dict(ttc.torch_model_cfg(args, init), mp=args.mp, no_sync=args.no_sync,
                       exposed_iters=args.exposed_iters)
            # torch on one process (torch_train_compare's tp1 path): validates torch's FSDP2 alone.
            ref_losses, ref_peak = None, None
            if args.mp == "fp32":
                ref = ttc.run_torch(py, dict(cfg, world=1, threads=max(1, args.cores), name="one process",
                                             track_peak=True), tag=TAG)
                ref_losses, ref_peak = ref["losses"], ref.get("peak_bytes")

        results = []
        for lay in layouts:
            threads = max(1, args.cores // lay["world"])  # per rank, the same on both sides
            ours_runs, torch_runs, ours_exposed = [], [], []
            # fsdp-bench has no TP and runs fp32: exposed communication for FSDP / HSDP in fp32.
            exposed = args.exposed_iters > 0 and lay["kind"] != "fsdp_tp" and args.mp == "fp32"
            for _ in range(args.repeats):  # the two sides alternate
                if not args.torch_only:
                    ours_runs.append(run_ours(args.build_dir, lay, model_args, threads, extra))
                    if exposed:
                        ours_exposed.append(run_ours_exposed(args.build_dir, lay, args, threads))
                if not recorded:
                    tcfg = dict(cfg, world=lay["world"], threads=threads, layout=lay, name=lay["name"],
                                exposed_iters=args.exposed_iters if exposed else 0)
                    # One retry: gloo on a loaded machine has been seen to abort a process at random
                    # (std::terminate) once in about twenty runs; said on stderr when it happens.
                    torch_runs.append(ttc.run_torch(py, tcfg, script=os.path.abspath(__file__), tag=TAG, retries=1))
            if recorded:
                if lay["name"] not in recorded:
                    sys.exit(f"{args.torch_json} has no config {lay['name']!r}")
                t = recorded[lay["name"]]
            else:
                t = dict(torch_entry(lay["name"], torch_runs, ref_losses), torch_one_process_peak_bytes=ref_peak)
            if args.torch_only:
                entry = dict(t, world=lay["world"], torch_tokens_per_s=round(tokens / t["torch_step_ms"] * 1e3))
                ref = entry["torch_ref_max_rel_diff"]
                print(f"{lay['name']:10s} torch step ms {t['torch_step_ms']:8.3f}   peak {fmt_bytes(t['torch_peak_bytes'])} "
                      f"(one process {fmt_bytes(t.get('torch_one_process_peak_bytes'))}, rss delta "
                      f"{fmt_bytes(t['torch_peak_rss_delta_bytes'])})   losses vs one process "
                      f"{'-' if ref is None else f'{ref:.2e}'}   loss {t['torch_losses'][0]:.4f} -> "
                      f"{t['torch_losses'][-1]:.4f}", flush=True)
                if ref_losses:
                    for i, (a, b) in enumerate(zip(t["torch_losses"], ref_losses)):
                        print(f"    step {i + 1:3d} fsdp2 {a:.8f} one process {b:.8f} rel {abs(a - b) / abs(b):.2e}")
            else:
                entry = merge(lay, ours_runs, t, args.steps, tokens, exposed_summary(ours_exposed))
                print(f"{lay['name']:10s} max rel loss diff {entry['max_rel_loss_diff']:.3e}   step ms ours "
                      f"{entry['ours_step_ms']:8.3f} torch {entry['torch_step_ms']:8.3f} (ratio {entry['ratio']:.3f})   "
                      f"peak ours {fmt_bytes(entry['ours_peak_bytes'])} torch {fmt_bytes(entry['torch_peak_bytes'])}   "
                      f"exposed {fmt_exposed(entry['ours_exposed_parts'], entry['torch_exposed_parts'])}", flush=True)
                for i, (a, b) in enumerate(zip(entry["ours_losses"], entry["torch_losses"])):
                    print(f"    step {i + 1:3d} ours {a:.8f} torch {b:.8f} rel {abs(a - b) / abs(b):.2e}")
            results.append(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = "" if args.torch_only else exposed_table(results)
    if table:
        print("\nExposed communication, (step - compute) / comm (fsdp-bench's decomposition; ours: prefetch 1, "
              "padded):\n" + table + "\n", flush=True)
    refs = [r["torch_ref_max_rel_diff"] for r in results if r.get("torch_ref_max_rel_diff") is not None]
    ref_ok = all(v <= ref_tolerance for v in refs)
    if args.torch_only:
        top = None
        ok = ref_ok
    else:
        top = max(r["max_rel_loss_diff"] for r in results)
        ok = top <= tolerance and ref_ok
    print(json.dumps({"max_rel_loss_diff": top, "tolerance": tolerance, "torch_ref_max_rel_diff": max(refs, default=None),
                      "reference_tolerance": ref_tolerance, "mp": args.mp, "no_sync": args.no_sync,
                      "steps": args.steps, "model_args": model_args,
                      "torch_only": args.torch_only, "configs": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
