#!/usr/bin/env python3
"""The mixture-of-experts GPT of fsdp-train and the same model in PyTorch, side by side (issue 29
item 6).

Both sides train from the same initial weights (one `fsdp-train --moe-experts E --dump-init`
run writes them, with the MoE settings in the safetensors header), on the same batches
(torch_train_compare.py's generator, fsdp-train's bit for bit), with the same AdamW
(foreach=False), gradient clipping and hyper-parameters; torch runs on one process.

The torch MoE is nn/moe.h's maths written plainly: router logits x Wr^T, softmax (or sigmoid)
scores, top-k (renormalised), each expert a tanh-GELU MLP with batched weights w1 [E, D, H] and
w2 [E, H, D] applied to the tokens routed to it (a loop over experts, index_add_ back), optional
shared expert; dropless. Its load-balancing loss coef * E * sum_e f_e * P_e (f_e the fraction
of assignments to e, detached; P_e the mean score of e) is added to the cross entropy before
backward, as ours adds its gradient; the losses compared are the cross entropies (what
fsdp-train prints as `loss`), and the aux losses are compared too.

Configs (each side gets --cores / ranks CPU threads per rank):
  ep1   ours: fsdp-train --backend local, one rank
  ep4   ours: fsdp-train --backend local --ep 4 (experts S(0) over 4 ranks, tokens by all-to-all-v)
(epN for other sizes; N must divide --experts and the batch.) Torch is always one process.

Usage (from the repository root; not in CI, it needs torch):
    python3 bench/torch_moe_compare.py --python /work/torchvenv/bin/python [--build-dir build]
    python3 bench/torch_moe_compare.py --python ... --experts 8 --top-k 2 --moe-every 1 --shared
The last line of the output is one JSON object:
    {"max_rel_loss_diff": .., "configs": [{"config": "ep4", "max_rel_loss_diff": ..,
      "max_rel_aux_diff": .., "ours_step_ms": .., "torch_step_ms": .., ...}, ...]}
Exit status: 0 when every config's losses agree within --tolerance (default 1e-4), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_train_compare as ttc  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The torch side (runs under an interpreter with torch)
# ---------------------------------------------------------------------------------------------

def build_moe_gpt(cfg: dict):
    """fsdp-train's GPT with MoE blocks (blocks i with (i + 1) % every == 0), loaded from
    cfg["init"]. forward(ids, positions) -> (logits, aux loss summed over the MoE blocks)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from safetensors.torch import load_file

    D, Hd, V, T = cfg["dim"], cfg["heads"], cfg["vocab"], cfg["seq"]
    Eh = D // Hd
    Hm = cfg["mlp_hidden"]
    moe = cfg["moe"]
    E, K = moe["experts"], moe["top_k"]
    if moe.get("capacity_factor", 0) > 0:
        raise SystemExit("torch_moe_compare: capacity factors are not modelled (dropless only)")

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Linear(D, D, bias=False)
            self.wk = nn.Linear(D, D, bias=False)
            self.wv = nn.Linear(D, D, bias=False)
            self.wo = nn.Linear(D, D, bias=False)

        def forward(self, x):
            B, Tq = x.shape[0], x.shape[1]
            q = self.wq(x).view(B, Tq, Hd, Eh).transpose(1, 2)
            k = self.wk(x).view(B, Tq, Hd, Eh).transpose(1, 2)
            v = self.wv(x).view(B, Tq, Hd, Eh).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(a.transpose(1, 2).reshape(B, Tq, D))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(D, Hm, bias=False)
            self.fc2 = nn.Linear(Hm, D, bias=False)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    class Holder(nn.Module):
        pass

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = Holder()
            self.router.weight = nn.Parameter(torch.empty(E, D))
            self.experts = Holder()
            self.experts.w1 = nn.Parameter(torch.empty(E, D, Hm))
            self.experts.w2 = nn.Parameter(torch.empty(E, Hm, D))
            self.shared = MLP() if moe["shared_expert"] else None

        def forward(self, x):
            xf = x.reshape(-1, D)
            n = xf.shape[0]
            logits = xf @ self.router.weight.t()
            s = torch.softmax(logits, dim=-1) if moe["score"] == "softmax" else torch.sigmoid(logits)
            top, sel = torch.topk(s, K, dim=-1)  # ties: improbable in floats
            g = top / top.sum(dim=-1, keepdim=True) if moe["renormalize"] else top
            f = F.one_hot(sel, E).sum(dim=(0, 1)).to(s.dtype) / (n * K)
            aux = moe["aux_loss_coef"] * E * (f.detach() * s.mean(dim=0)).sum()
            out = torch.zeros_like(xf)
            for e in range(E):
                tok, slot = (sel == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                h = F.gelu(xf[tok] @ self.experts.w1[e], approximate="tanh") @ self.experts.w2[e]
                out = out.index_add(0, tok, g[tok, slot].unsqueeze(1) * h)
            if self.shared is not None:
                out = out + self.shared(xf)
            return out.view_as(x), aux

    class Block(nn.Module):
        def __init__(self, is_moe: bool):
            super().__init__()
            self.ln1 = nn.LayerNorm(D, eps=cfg["norm_eps"])
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(D, eps=cfg["norm_eps"])
            if is_moe:
                self.moe = MoE()
            else:
                self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            if hasattr(self, "moe"):
                m, aux = self.moe(self.ln2(x))
                return x + m, aux
            return x + self.mlp(self.ln2(x)), None

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(V, D)
            self.pos_emb = nn.Embedding(T, D)
            self.blocks = nn.ModuleList([Block((i + 1) % moe["every"] == 0) for i in range(cfg["layers"])])
            self.ln_f = nn.LayerNorm(D, eps=cfg["norm_eps"])
            self.lm_head = nn.Linear(D, V, bias=False)

        def forward(self, ids, positions):
            h = self.tok_emb(ids) + self.pos_emb(positions)
            aux = torch.zeros(())
            for b in self.blocks:
                h, a = b(h)
                if a is not None:
                    aux = aux + a
            return self.lm_head(self.ln_f(h)), aux

    model = GPT()
    model.load_state_dict(load_file(cfg["init"]), strict=True)
    return model


def torch_worker(cfg: dict, out_path: str) -> None:
    import time

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    model = build_moe_gpt(cfg)
    params = list(model.parameters())
    opt = ttc.make_adamw(params, cfg)
    positions = torch.arange(cfg["seq"])
    M, micro = cfg["grad_accum"], cfg["batch"] // cfg["grad_accum"]
    losses, auxes, times = [], [], []
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        step_loss = step_aux = 0.0
        for m in range(M):
            ids, targets = ttc.make_batch(cfg["seed"], step, step * cfg["batch"] + m * micro, micro, cfg["seq"],
                                          cfg["vocab"])
            logits, aux = model(torch.tensor(ids, dtype=torch.long), positions)
            ce = F.cross_entropy(logits.flatten(0, 1), torch.tensor(targets, dtype=torch.long).flatten(0, 1))
            # fsdp-train seeds the loss with 1 / M and scales each MoE's aux gradient by the same.
            ((ce + aux) / M).backward()
            step_loss += ce.item() / M
            step_aux += aux.item() / M
        if cfg["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(step_loss)
        auxes.append(step_aux)
    with open(out_path, "w") as f:
        json.dump({"losses": losses, "aux": auxes, "times": times}, f)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def run_ours(args, ep: int, model_args: list[str], dump: str | None) -> dict:
    exe = ttc.fsdp_train_exe(args.build_dir)
    threads = max(1, args.cores // ep)
    cmd = [exe, "--backend", "local", "--log-every", "1", "--threads", str(threads)] + model_args
    if ep > 1:
        cmd += ["--ep", str(ep)]
    if dump:
        cmd += ["--dump-init", dump]
    print("[torch_moe_compare] ours: " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"fsdp-train failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    out = ttc.parse_progress(r.stdout)
    aux = []
    for line in r.stdout.splitlines():
        words = line.split()
        if words and words[0] == "step" and "aux_loss" in words:
            aux.append(float(words[words.index("aux_loss") + 1]))
    out["aux"] = aux
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ttc.add_common_args(ap, "ep1,ep4")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-every", type=int, default=1)
    ap.add_argument("--shared", action="store_true", help="a shared expert in every MoE block")
    args = ap.parse_args()
    if args.torch_worker:
        torch_worker(json.loads(args.torch_config), args.torch_out)
        return 0

    py = ttc.torch_python(args.python)
    work = tempfile.mkdtemp(prefix="torch_moe_compare.")
    dump = os.path.join(work, "init.safetensors")
    moe_args = ["--moe-experts", str(args.experts), "--moe-top-k", str(args.top_k), "--moe-every",
                str(args.moe_every)] + (["--moe-shared"] if args.shared else [])
    model_args = ttc.ours_model_args(args) + moe_args
    results = []
    torch_runs = []
    configs = [c for c in args.configs.split(",") if c]
    for name in configs:
        if not (name.startswith("ep") and name[2:].isdigit() and int(name[2:]) >= 1):
            sys.exit(f"unknown config {name!r} (epN: ep1, ep4, ...)")
    for name in configs:
        ep = int(name[2:])
        ours_runs = []
        for rep in range(args.repeats):
            first = not os.path.exists(dump)
            ours_runs.append(run_ours(args, ep, model_args, dump if first else None))
            if len(torch_runs) < args.repeats:  # torch: one process, the same for every config
                with open(dump, "rb") as f:
                    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
                meta = json.loads(header["__metadata__"]["config"])
                cfg = dict(ttc.torch_model_cfg(args, dump), moe=meta["moe"], threads=args.cores, world=1,
                           name="one process")
                torch_runs.append(ttc.run_torch(py, cfg, script=os.path.abspath(__file__), tag="torch_moe_compare"))
        ours_losses, torch_losses = ours_runs[0]["losses"], torch_runs[0]["losses"]
        if len(ours_losses) != args.steps or len(torch_losses) != args.steps:
            sys.exit(f"{name}: expected {args.steps} losses, got ours {len(ours_losses)} torch {len(torch_losses)}")
        rel = ttc.max_rel_diff(ours_losses, torch_losses)
        rel_aux = ttc.max_rel_diff(ours_runs[0]["aux"], torch_runs[0]["aux"]) if ours_runs[0]["aux"] else None
        ours_ms = statistics.median(ttc.median_ms(r["ms"]) for r in ours_runs)
        torch_ms = statistics.median(ttc.median_ms([t * 1e3 for t in r["times"]]) for r in torch_runs)
        entry = {"config": name, "max_rel_loss_diff": rel, "max_rel_aux_diff": rel_aux,
                 "ours_step_ms": round(ours_ms, 3), "torch_step_ms": round(torch_ms, 3),
                 "ours_over_torch_time": round(ours_ms / torch_ms, 3), "first_loss": ours_losses[0],
                 "last_loss": ours_losses[-1]}
        results.append(entry)
        print(f"{name:5s} max rel loss diff {rel:.3e}  aux {rel_aux if rel_aux is None else f'{rel_aux:.3e}'}   "
              f"step ms ours {ours_ms:8.3f} torch {torch_ms:8.3f}   loss {ours_losses[0]:.4f} -> "
              f"{ours_losses[-1]:.4f}", flush=True)
        for i, (a, b) in enumerate(zip(ours_losses, torch_losses)):
            print(f"    step {i + 1:3d} ours {a:.8f} torch {b:.8f} rel {abs(a - b) / abs(b):.2e}")
    shutil.rmtree(work, ignore_errors=True)
    top = max(r["max_rel_loss_diff"] for r in results) if results else 0.0
    print(json.dumps({"max_rel_loss_diff": top, "configs": results}))
    return 0 if top <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
