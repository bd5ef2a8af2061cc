#!/usr/bin/env python3
"""Train the same GPT in PyTorch and with our fsdp-train, side by side, and compare.

Both sides start from the same weights (fsdp-train --dump-init writes a safetensors file that
torch loads with the `safetensors` package), see the same batches (the generator below is
fsdp-train's, bit for bit), and use the same optimizer (AdamW, foreach=False), gradient
clipping and hyper-parameters. Per config it reports the largest relative difference of the
per-step losses and the median step time and tokens/s of both.

Configs:
  tp1      ours: --backend local, 1 rank      torch: one process
(each side gets --cores / ranks CPU threads per rank: --threads for ours, set_num_threads for torch)
  tp2      ours: --backend local, 2 ranks     torch: 2 processes on gloo with parallelize_module
  tp2-mpi  ours: mpirun -np 2 --backend mpi   torch: as tp2
The torch tensor-parallel plan is ours (gpt_tensor_parallel_plan, sequence parallel, loss
parallel): RowwiseParallel embedding to Shard(1), SequenceParallel norms, PrepareModuleInput
Shard(1) -> Replicate for attention and MLP, ColwiseParallel q/k/v and fc1, RowwiseParallel wo
and fc2 to Shard(1), ColwiseParallel head to Shard(-1) under loss_parallel().

Usage (from the repository root):
    python3 bench/torch_train_compare.py --python /path/to/python-with-torch [--build-dir build]
    TORCH_PYTHON=... BUILD_DIR=... python3 bench/torch_train_compare.py --configs tp1,tp2
Without --python / TORCH_PYTHON a private virtual environment is created at bench/.venv and
torch (CPU) is installed there with pip. The last line of the output is one JSON object:
    {"max_rel_loss_diff": .., "configs": [{"config": "tp1", "max_rel_loss_diff": ..,
      "ours_step_ms": .., "torch_step_ms": .., ...}, ...]}
Exit status: 0 when every config's losses agree within --tolerance (default 1e-4), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The shared pieces, re-exported: torch_fsdp_compare.py and torch_checkpoint_exchange.py take them
# from here.
from torch_common import (  # noqa: E402,F401  (no torch at import time)
    TrainStep, add_common_args, apply_tensor_parallel, build_gpt, compared_losses, finish, free_port,
    fsdp_train_exe, make_adamw, make_batch, max_rel_diff, median_ms, ours_model_args, parse_progress,
    print_steps, run_fsdp_train, timed_steps, torch_model_cfg, torch_python)
import torch_common  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The torch side (runs under an interpreter with torch)
# ---------------------------------------------------------------------------------------------

def torch_worker(rank: int, world: int, cfg: dict, port: int, out_path: str) -> None:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    model = build_gpt(cfg)
    positions = torch.arange(cfg["seq"])
    loss_ctx = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        positions, loss_ctx = apply_tensor_parallel(model, mesh, cfg["seq"])

    params = list(model.parameters())
    opt = make_adamw(params, cfg)
    step_fn = TrainStep(model, params, opt, cfg, positions, loss_ctx, fix_grads=world > 1)
    losses, times = timed_steps(step_fn, cfg["steps"])
    out = {"losses": losses, "times": times}
    if cfg.get("track_peak") and world == 1:
        # torch_fsdp_compare's reference: peak live tensor bytes (torch's MemTracker) of one more,
        # untimed step.
        from torch.distributed._tools.mem_tracker import MemTracker
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step_fn(cfg["steps"])
        out["peak_bytes"] = max((s.get("Total", 0) for s in tracker.get_tracker_snapshot("peak").values()), default=0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


def torch_main(args) -> None:
    cfg = json.loads(args.torch_config)
    world = cfg["world"]
    if world == 1:
        torch_worker(0, 1, cfg, 0, args.torch_out)
        return
    import torch.multiprocessing as mp
    mp.spawn(torch_worker, args=(world, cfg, free_port(), args.torch_out), nprocs=world, join=True)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def run_ours(build: str, backend: str, tp: int, model_args: list[str], dump: str | None, threads: int) -> dict:
    exe = fsdp_train_exe(build)
    cmd = [exe, "--backend", backend, "--tp", str(tp), "--log-every", "1", "--threads", str(threads)] + model_args
    if dump:
        cmd += ["--dump-init", dump]
    if backend == "mpi":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(tp)] + cmd
    return run_fsdp_train(cmd)


def run_torch(py: str, cfg: dict, script: str | None = None, tag: str = "torch_train_compare",
              retries: int = 0) -> dict:
    """torch_common.run_torch with `script` this file by default (its torch_worker)."""
    return torch_common.run_torch(py, cfg, script or os.path.abspath(__file__), tag, retries)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "tp1,tp2,tp2-mpi")
    args = ap.parse_args()
    if args.torch_worker:
        torch_main(args)
        return 0

    py = torch_python(args.python)
    work = tempfile.mkdtemp(prefix="torch_train_compare.")
    dump = os.path.join(work, "init.safetensors")
    model_args = ours_model_args(args)
    cfg = torch_model_cfg(args, dump)
    results = []
    dumped = False
    for name in [c for c in args.configs.split(",") if c]:
        tp = 1 if name == "tp1" else 2
        backend = "mpi" if name.endswith("-mpi") else "local"
        if name not in ("tp1", "tp2", "tp2-mpi"):
            sys.exit(f"unknown config {name!r} (tp1, tp2, tp2-mpi)")
        ours_runs, torch_runs = [], []
        for rep in range(args.repeats):
            threads = max(1, args.cores // tp)  # per rank, the same on both sides
            ours_runs.append(run_ours(args.build_dir, backend, tp, model_args, None if dumped else dump, threads))
            dumped = True
            tcfg = dict(cfg, world=tp, threads=threads)
            torch_runs.append(run_torch(py, tcfg))
        ours_losses = ours_runs[0]["losses"]
        torch_losses = torch_runs[0]["losses"]
        rel = compared_losses(name, args.steps, ours_losses, torch_losses)
        ours_ms = statistics.median(median_ms(r["ms"]) for r in ours_runs)
        torch_ms = statistics.median(median_ms([t * 1e3 for t in r["times"]]) for r in torch_runs)
        tokens = args.batch * args.seq
        entry = {"config": name, "max_rel_loss_diff": rel, "ours_step_ms": round(ours_ms, 3),
                 "torch_step_ms": round(torch_ms, 3), "ours_tokens_per_s": round(tokens / ours_ms * 1e3),
                 "torch_tokens_per_s": round(tokens / torch_ms * 1e3), "ours_over_torch_time": round(ours_ms / torch_ms, 3),
                 "first_loss": ours_losses[0], "last_loss": ours_losses[-1], "backend": backend}
        results.append(entry)
        print(f"{name:8s} max rel loss diff {rel:.3e}   step ms ours {ours_ms:8.3f} torch {torch_ms:8.3f}   "
              f"tokens/s ours {entry['ours_tokens_per_s']} torch {entry['torch_tokens_per_s']}   "
              f"loss {ours_losses[0]:.4f} -> {ours_losses[-1]:.4f}", flush=True)
        print_steps(ours_losses, torch_losses)
    shutil.rmtree(work, ignore_errors=True)
    return finish(results, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
