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
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VENV = os.path.join(HERE, ".venv")
TORCH_REQUIREMENT = "torch==2.15.0"
PURE_DEPS = ["filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec", "mpmath", "MarkupSafe",
             "setuptools", "numpy", "safetensors"]
M64 = (1 << 64) - 1


def log(msg: str) -> None:
    print(f"[torch_train_compare] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# fsdp-train's data (examples/fsdp_train.cpp make_batch)
# ---------------------------------------------------------------------------------------------

def mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def make_batch(seed: int, step: int, first: int, rows: int, seq: int, vocab: int):
    ids, targets = [], []
    for r in range(rows):
        g = first + r
        t = mix64((seed * 0x100000001B3 + step * 0x9E3779B97F4A7C15 + g) & M64) % vocab
        row_i, row_t = [], []
        for _ in range(seq):
            row_i.append(t)
            t = (5 * t + 3) % vocab
            row_t.append(t)
        ids.append(row_i)
        targets.append(row_t)
    return ids, targets


# ---------------------------------------------------------------------------------------------
# The torch side (runs under an interpreter with torch)
# ---------------------------------------------------------------------------------------------

def torch_worker(rank: int, world: int, cfg: dict, port: int, out_path: str) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from safetensors.torch import load_file

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    D, H, V, T = cfg["dim"], cfg["heads"], cfg["vocab"], cfg["seq"]
    E = D // H

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Linear(D, D, bias=False)
            self.wk = nn.Linear(D, D, bias=False)
            self.wv = nn.Linear(D, D, bias=False)
            self.wo = nn.Linear(D, D, bias=False)

        def forward(self, x):
            B, Tq = x.shape[0], x.shape[1]
            # -1 heads: under tensor parallelism each rank holds H / tp whole heads.
            q = self.wq(x).view(B, Tq, -1, E).transpose(1, 2)
            k = self.wk(x).view(B, Tq, -1, E).transpose(1, 2)
            v = self.wv(x).view(B, Tq, -1, E).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(E)
            return self.wo(a.transpose(1, 2).reshape(B, Tq, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(D, cfg["mlp_hidden"], bias=False)
            self.fc2 = nn.Linear(cfg["mlp_hidden"], D, bias=False)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(D, eps=cfg["norm_eps"])
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(D, eps=cfg["norm_eps"])
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(V, D)
            self.pos_emb = nn.Embedding(T, D)
            self.blocks = nn.ModuleList([Block() for _ in range(cfg["layers"])])
            self.ln_f = nn.LayerNorm(D, eps=cfg["norm_eps"])
            self.lm_head = nn.Linear(D, V, bias=False)

        def forward(self, ids, positions):
            h = self.tok_emb(ids) + self.pos_emb(positions)
            for b in self.blocks:
                h = b(h)
            return self.lm_head(self.ln_f(h))

    model = GPT()
    state = load_file(cfg["init"])
    missing, unexpected = model.load_state_dict(state, strict=True), None
    del missing, unexpected

    positions = torch.arange(T)
    loss_ctx = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, loss_parallel, parallelize_module)

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        plan = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "blocks.*.ln1": SequenceParallel(),
            "blocks.*.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "blocks.*.attn.wq": ColwiseParallel(),
            "blocks.*.attn.wk": ColwiseParallel(),
            "blocks.*.attn.wv": ColwiseParallel(),
            "blocks.*.attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "blocks.*.ln2": SequenceParallel(),
            "blocks.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "blocks.*.mlp.fc1": ColwiseParallel(),
            "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
        parallelize_module(model, mesh, plan)
        # The position table stays replicated; positions are sharded like the sequence, so the
        # add with the Shard(1) token embeddings needs no communication (as ours).
        distribute_module(model.pos_emb, mesh)
        positions = distribute_tensor(torch.arange(T), mesh, [Shard(0)], src_data_rank=None)
        loss_ctx = loss_parallel

    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg["weight_decay"],
                            foreach=False)
    B, M = cfg["batch"], cfg["grad_accum"]
    micro = B // M
    losses, times = [], []
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        step_loss = 0.0
        for m in range(M):
            ids, targets = make_batch(cfg["seed"], step, step * B + m * micro, micro, T, V)
            ids = torch.tensor(ids, dtype=torch.long)
            targets = torch.tensor(targets, dtype=torch.long)
            logits = model(ids, positions)
            if loss_ctx is not None:
                with loss_ctx():
                    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                    (loss / M).backward()
                value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                (loss / M).backward()
                value = loss.item()
            step_loss += value / M
        if world > 1:
            from torch.distributed.tensor import DTensor
            for p in params:  # Partial gradients of replicated parameters: to the parameter's layout
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if cfg["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(step_loss)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "times": times}, f)
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(torch_worker, args=(world, cfg, port, args.torch_out), nprocs=world, join=True)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def torch_python(arg: str | None) -> str:
    py = arg or os.environ.get("TORCH_PYTHON")
    if py:
        return py
    vpy = os.path.join(VENV, "bin", "python")
    ok = os.path.exists(vpy) and subprocess.run([vpy, "-c", "import torch, safetensors"],
                                               capture_output=True).returncode == 0
    if not ok:
        if not os.path.exists(vpy):
            log(f"creating virtual environment {VENV}")
            subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        pip = [vpy, "-m", "pip", "install", "--disable-pip-version-check"]
        log("installing torch (CPU) into the private venv")
        subprocess.run(pip + ["--no-deps", TORCH_REQUIREMENT], check=True)
        subprocess.run(pip + PURE_DEPS, check=True)
        if subprocess.run([vpy, "-c", "import torch"], capture_output=True).returncode != 0:
            subprocess.run(pip + [TORCH_REQUIREMENT], check=True)
    return vpy


STEP_RE = re.compile(r"^step (\d+)/(\d+) loss (\S+) ms (\S+) tokens/s (\S+) peak_bytes (\d+)$")


def run_ours(build: str, backend: str, tp: int, model_args: list[str], dump: str | None, threads: int) -> dict:
    exe = os.path.join(build, "examples", "fsdp-train")
    if not os.path.exists(exe):
        sys.exit(f"{exe} not found: build it (ninja -C {build} examples/fsdp-train) or pass --build-dir")
    cmd = [exe, "--backend", backend, "--tp", str(tp), "--log-every", "1", "--threads", str(threads)] + model_args
    if dump:
        cmd += ["--dump-init", dump]
    if backend == "mpi":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(tp)] + cmd
    log("ours: " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"fsdp-train failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    losses, ms = [], []
    for line in r.stdout.splitlines():
        m = STEP_RE.match(line.strip())
        if m:
            losses.append(float(m.group(3)))
            ms.append(float(m.group(4)))
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    return {"losses": losses, "ms": ms, "summary": summary}


def run_torch(py: str, cfg: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [py, os.path.abspath(__file__), "--torch-worker", "--torch-config", json.dumps(cfg), "--torch-out", out]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(cfg["threads"]))
    log(f"torch: world {cfg['world']}, {cfg['threads']} thread(s) per process")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"torch side failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def median_ms(ms: list[float]) -> float:
    steady = ms[1:] if len(ms) > 1 else ms
    return statistics.median(steady)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", help="an interpreter with torch and safetensors (else TORCH_PYTHON, else bench/.venv)")
    ap.add_argument("--build-dir", default=os.environ.get("BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--configs", default="tp1,tp2,tp2-mpi")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per side; step times are the median over runs")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores both sides may use")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-config", help=argparse.SUPPRESS)
    ap.add_argument("--torch-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        torch_main(args)
        return 0

    py = torch_python(args.python)
    work = tempfile.mkdtemp(prefix="torch_train_compare.")
    dump = os.path.join(work, "init.safetensors")
    model_args = ["--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads),
                  "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
                  "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
                  "--grad-accum", str(args.grad_accum), "--clip", str(args.clip)]
    cfg = {"dim": args.dim, "heads": args.heads, "vocab": args.vocab, "seq": args.seq, "layers": args.layers,
           "mlp_hidden": 4 * args.dim, "norm_eps": 1e-5, "batch": args.batch, "grad_accum": args.grad_accum,
           "steps": args.steps, "lr": args.lr, "seed": args.seed, "clip": args.clip, "weight_decay": 0.0,
           "init": dump}
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
        if len(ours_losses) != args.steps or len(torch_losses) != args.steps:
            sys.exit(f"{name}: expected {args.steps} losses, got ours {len(ours_losses)} torch {len(torch_losses)}")
        rel = max(abs(a - b) / abs(b) for a, b in zip(ours_losses, torch_losses))
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
        for i, (a, b) in enumerate(zip(ours_losses, torch_losses)):
            print(f"    step {i + 1:3d} ours {a:.8f} torch {b:.8f} rel {abs(a - b) / abs(b):.2e}")
    shutil.rmtree(work, ignore_errors=True)
    top = max(r["max_rel_loss_diff"] for r in results) if results else 0.0
    print(json.dumps({"max_rel_loss_diff": top, "configs": results}))
    return 0 if top <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
