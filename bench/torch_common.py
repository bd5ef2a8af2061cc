"""What the PyTorch comparison scripts share: fsdp-train's data, its GPT's torch modules, the
training step, the torch interpreter, running fsdp-train and the torch side, the common options
and the loss report. torch_train_compare.py and torch_moe_compare.py import it (and
torch_fsdp_compare.py and torch_checkpoint_exchange.py through torch_train_compare.py, which
re-exports these names); each first puts its own folder on sys.path, so they run from any cwd.
Importing it imports no torch: the torch pieces import it inside, under the torch interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def log(msg: str, tag: str = "torch_train_compare") -> None:
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# fsdp-train's data (examples/fsdp_train_args.cpp make_batch)
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

def gpt_modules(cfg: dict):
    """fsdp-train's attention and dense MLP (nn/transformer.h) as torch module classes for cfg's
    sizes: (Attention, MLP). build_gpt's blocks and torch_moe_compare.py's are made of them."""
    import torch.nn as nn
    import torch.nn.functional as F

    D, H = cfg["dim"], cfg["heads"]
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

    return Attention, MLP


def build_gpt(cfg: dict):
    """fsdp-train's GPT (nn/transformer.h with fsdp-train's config) in torch, loaded from cfg["init"]
    (fsdp-train --dump-init)."""
    import torch.nn as nn
    from safetensors.torch import load_file

    D, V, T = cfg["dim"], cfg["vocab"], cfg["seq"]
    Attention, MLP = gpt_modules(cfg)

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
    model.load_state_dict(load_file(cfg["init"]), strict=True)
    return model


def apply_tensor_parallel(model, mesh, seq: int):
    """Our tensor-parallel plan (gpt_tensor_parallel_plan) with torch's parallelize_module on the 1-D
    `mesh`; returns (positions, loss context)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

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
    positions = distribute_tensor(torch.arange(seq), mesh, [Shard(0)], src_data_rank=None)
    return positions, loss_parallel


def make_adamw(params, cfg: dict):
    import torch
    return torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg["weight_decay"],
                             foreach=False)


class TrainStep:
    """One optimizer step of fsdp-train's loop: grad-accum microbatches of make_batch rows, cross
    entropy (under loss_ctx when given), gradient clipping, AdamW, zero_grad. `rows(step, m)` gives
    the (first global row, count) this process trains on in microbatch m (default: the whole
    microbatch); `reduce_loss(value)` turns this process's loss into the global one (default: as is);
    `before_microbatch(m)` runs first in each microbatch (FSDP's no-sync switch). Calling it with a
    step index returns the step's loss. A model returning (logits, aux) has (cross entropy + aux) / M
    back-propagated per microbatch; the loss stays the cross entropy and each step's aux (mean over
    the microbatches) is appended to `aux_losses`."""

    def __init__(self, model, params, opt, cfg: dict, positions, loss_ctx=None, fix_grads: bool = False,
                 rows=None, reduce_loss=None, before_microbatch=None):
        self.model, self.params, self.opt, self.cfg = model, params, opt, cfg
        self.positions, self.loss_ctx, self.fix_grads = positions, loss_ctx, fix_grads
        micro = cfg["batch"] // cfg["grad_accum"]
        self.rows = rows or (lambda step, m: (step * cfg["batch"] + m * micro, micro))
        self.reduce_loss = reduce_loss or (lambda v: v)
        self.before_microbatch = before_microbatch
        self.aux_losses = []

    def __call__(self, step: int) -> float:
        import torch
        import torch.nn.functional as F
        cfg, M = self.cfg, self.cfg["grad_accum"]
        step_loss = step_aux = 0.0
        has_aux = False
        for m in range(M):
            if self.before_microbatch is not None:
                self.before_microbatch(m)
            first, count = self.rows(step, m)
            ids, targets = make_batch(cfg["seed"], step, first, count, cfg["seq"], cfg["vocab"])
            ids = torch.tensor(ids, dtype=torch.long)
            targets = torch.tensor(targets, dtype=torch.long)
            logits = self.model(ids, self.positions)
            aux = None
            if isinstance(logits, tuple):
                logits, aux = logits
            if self.loss_ctx is not None:
                with self.loss_ctx():
                    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                    (loss / M).backward()
                value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                if aux is None:
                    (loss / M).backward()
                else:
                    # fsdp-train seeds the loss with 1 / M and scales each MoE's aux gradient by the same.
                    ((loss + aux) / M).backward()
                    step_aux += aux.item() / M
                    has_aux = True
                value = loss.item()
            step_loss += value / M
        if self.fix_grads:
            from torch.distributed.tensor import DTensor
            for p in self.params:  # Partial gradients of replicated parameters: to the parameter's layout
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if cfg["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg["clip"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if has_aux:
            self.aux_losses.append(step_aux)
        return self.reduce_loss(step_loss)


def timed_steps(step_fn, steps: int):
    """Runs steps 0..steps-1; returns (losses, wall seconds per step)."""
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = step_fn(step)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return losses, times


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def torch_python(arg: str | None, tag: str = "torch_train_compare") -> str:
    py = arg or os.environ.get("TORCH_PYTHON")
    if py:
        return py
    vpy = os.path.join(VENV, "bin", "python")
    ok = os.path.exists(vpy) and subprocess.run([vpy, "-c", "import torch, safetensors"],
                                               capture_output=True).returncode == 0
    if not ok:
        if not os.path.exists(vpy):
            log(f"creating virtual environment {VENV}", tag)
            subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        pip = [vpy, "-m", "pip", "install", "--disable-pip-version-check"]
        log("installing torch (CPU) into the private venv", tag)
        subprocess.run(pip + ["--no-deps", TORCH_REQUIREMENT], check=True)
        subprocess.run(pip + PURE_DEPS, check=True)
        if subprocess.run([vpy, "-c", "import torch"], capture_output=True).returncode != 0:
            subprocess.run(pip + [TORCH_REQUIREMENT], check=True)
    return vpy


# fsdp-train's progress line: "step 3/20 loss 3.91 ms 6.21 tokens/s 41234 peak_bytes 1234567", then
# possibly more (the FSDP issue adds peak bytes per kind); read as "key value" pairs from the start,
# so that loss and ms, which come first, survive whatever follows.
STEP_RE = re.compile(r"^step (\d+)/(\d+)(\s.*)?$")


def parse_progress(stdout: str) -> dict:
    """fsdp-train's stdout -> {"losses", "ms", "progress" (each progress line's key -> number),
    "last_progress" (the last line's), "summary" (the last-line JSON)}. Raises ValueError when the output has no JSON last line."""
    losses, ms, progress, last = [], [], [], {}
    for line in stdout.splitlines():
        m = STEP_RE.match(line.strip())
        if not m:
            continue
        words = (m.group(3) or "").split()
        fields = {}
        for key, value in zip(words[0::2], words[1::2]):
            try:
                fields[key] = float(value)
            except ValueError:
                fields[key] = value
        if "loss" not in fields or "ms" not in fields:
            continue
        losses.append(fields["loss"])
        ms.append(fields["ms"])
        progress.append(fields)
        last = fields
    lines = stdout.strip().splitlines()
    if not lines:
        raise ValueError("fsdp-train printed nothing")
    summary = json.loads(lines[-1])
    return {"losses": losses, "ms": ms, "progress": progress, "last_progress": last, "summary": summary}


def fsdp_train_exe(build: str) -> str:
    exe = os.path.join(build, "examples", "fsdp-train")
    if not os.path.exists(exe):
        sys.exit(f"{exe} not found: build it (ninja -C {build} examples/fsdp-train) or pass --build-dir")
    return exe


def run_fsdp_train(cmd: list[str], tag: str = "torch_train_compare") -> dict:
    print(f"[{tag}] ours: " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"fsdp-train failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return parse_progress(r.stdout)


def run_torch(py: str, cfg: dict, script: str, tag: str = "torch_train_compare", retries: int = 0) -> dict:
    """Runs `script --torch-worker` under the torch interpreter; returns the JSON
    its rank 0 wrote. A failed run is started again up to `retries` times (said on stderr)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [py, script, "--torch-worker", "--torch-config", json.dumps(cfg),
           "--torch-out", out]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(cfg["threads"]))
    print(f"[{tag}] torch: {cfg.get('name', 'world ' + str(cfg['world']))}, {cfg['threads']} thread(s) per process",
          file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for attempt in range(retries):
        if r.returncode == 0:
            break
        tail = "\n".join(r.stderr.strip().splitlines()[-3:])
        print(f"[{tag}] torch side failed ({r.returncode}), retry {attempt + 1} of {retries}:\n{tail}",
              file=sys.stderr, flush=True)
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


def max_rel_diff(ours: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, ref))


def add_common_args(ap: argparse.ArgumentParser, configs: str) -> None:
    """The options both comparison scripts share: interpreter, build, configs, fsdp-train's model and
    training flags, repeats, cores, tolerance and the hidden worker options."""
    ap.add_argument("--python", help="an interpreter with torch and safetensors (else TORCH_PYTHON, else bench/.venv)")
    ap.add_argument("--build-dir", default=os.environ.get("BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--configs", default=configs)
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


def ours_model_args(args) -> list[str]:
    """fsdp-train's flags for the model and training options in `args`."""
    return ["--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads),
            "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
            "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
            "--grad-accum", str(args.grad_accum), "--clip", str(args.clip)]


def torch_model_cfg(args, init: str) -> dict:
    """The torch side's config for the same options (fsdp-train's fixed choices included)."""
    return {"dim": args.dim, "heads": args.heads, "vocab": args.vocab, "seq": args.seq, "layers": args.layers,
            "mlp_hidden": 4 * args.dim, "norm_eps": 1e-5, "batch": args.batch, "grad_accum": args.grad_accum,
            "steps": args.steps, "lr": args.lr, "seed": args.seed, "clip": args.clip, "weight_decay": 0.0,
            "init": init}


def compared_losses(name: str, steps: int, ours: list[float], torch: list[float]) -> float:
    """The largest relative difference of the per-step losses; exits naming the config when either
    side has not `steps` of them."""
    if len(ours) != steps or len(torch) != steps:
        sys.exit(f"{name}: expected {steps} losses, got ours {len(ours)} torch {len(torch)}")
    return max_rel_diff(ours, torch)


def print_steps(ours: list[float], torch: list[float]) -> None:
    for i, (a, b) in enumerate(zip(ours, torch)):
        print(f"    step {i + 1:3d} ours {a:.8f} torch {b:.8f} rel {abs(a - b) / abs(b):.2e}")


def finish(results: list[dict], tolerance: float) -> int:
    """Prints the last-line JSON; returns the exit status: 0 when every config's losses agree
    within `tolerance`, 1 otherwise."""
    top = max(r["max_rel_loss_diff"] for r in results) if results else 0.0
    print(json.dumps({"max_rel_loss_diff": top, "configs": results}))
    return 0 if top <= tolerance else 1
