#!/usr/bin/env python3
"""The mixture-of-experts GPT of fsdp-train and the same model in PyTorch, side by side (issue 29
item 6).

Both sides train from the same initial weights (one `fsdp-train --moe-experts E --dump-init`
run writes them, with the MoE settings in the safetensors header), on the same batches
(torch_common.py's generator, fsdp-train's bit for bit), with the same AdamW
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
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_common as tc  # noqa: E402  (no torch at import time)

TAG = "torch_moe_compare"


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

    D, V, T = cfg["dim"], cfg["vocab"], cfg["seq"]
    Hm = cfg["mlp_hidden"]
    moe = cfg["moe"]
    E, K = moe["experts"], moe["top_k"]
    if moe.get("capacity_factor", 0) > 0:
        raise SystemExit("torch_moe_compare: capacity factors are not modelled (dropless only)")

    Attention, MLP = tc.gpt_modules(cfg)

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
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(cfg["threads"])
    model = build_moe_gpt(cfg)
    params = list(model.parameters())
    step_fn = tc.TrainStep(model, params, tc.make_adamw(params, cfg), cfg, torch.arange(cfg["seq"]))
    losses, times = tc.timed_steps(step_fn, cfg["steps"])
    with open(out_path, "w") as f:
        json.dump({"losses": losses, "aux": step_fn.aux_losses, "times": times}, f)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def run_ours(args, ep: int, model_args: list[str], dump: str | None) -> dict:
    exe = tc.fsdp_train_exe(args.build_dir)
    threads = max(1, args.cores // ep)
    cmd = [exe, "--backend", "local", "--log-every", "1", "--threads", str(threads)] + model_args
    if ep > 1:
        cmd += ["--ep", str(ep)]
    if dump:
        cmd += ["--dump-init", dump]
    out = tc.run_fsdp_train(cmd, TAG)
    out["aux"] = [p["aux_loss"] for p in out["progress"] if "aux_loss" in p]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tc.add_common_args(ap, "ep1,ep4")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-every", type=int, default=1)
    ap.add_argument("--shared", action="store_true", help="a shared expert in every MoE block")
    args = ap.parse_args()
    if args.torch_worker:
        torch_worker(json.loads(args.torch_config), args.torch_out)
        return 0

    py = tc.torch_python(args.python)
    work = tempfile.mkdtemp(prefix="torch_moe_compare.")
    dump = os.path.join(work, "init.safetensors")
    moe_args = ["--moe-experts", str(args.experts), "--moe-top-k", str(args.top_k), "--moe-every",
                str(args.moe_every)] + (["--moe-shared"] if args.shared else [])
    model_args = tc.ours_model_args(args) + moe_args
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
                cfg = dict(tc.torch_model_cfg(args, dump), moe=meta["moe"], threads=args.cores, world=1,
                           name="one process")
                torch_runs.append(tc.run_torch(py, cfg, os.path.abspath(__file__), TAG))
        ours_losses, torch_losses = ours_runs[0]["losses"], torch_runs[0]["losses"]
        rel = tc.compared_losses(name, args.steps, ours_losses, torch_losses)
        rel_aux = tc.max_rel_diff(ours_runs[0]["aux"], torch_runs[0]["aux"]) if ours_runs[0]["aux"] else None
        ours_ms = statistics.median(tc.median_ms(r["ms"]) for r in ours_runs)
        torch_ms = statistics.median(tc.median_ms([t * 1e3 for t in r["times"]]) for r in torch_runs)
        entry = {"config": name, "max_rel_loss_diff": rel, "max_rel_aux_diff": rel_aux,
                 "ours_step_ms": round(ours_ms, 3), "torch_step_ms": round(torch_ms, 3),
                 "ours_over_torch_time": round(ours_ms / torch_ms, 3), "first_loss": ours_losses[0],
                 "last_loss": ours_losses[-1]}
        results.append(entry)
        print(f"{name:5s} max rel loss diff {rel:.3e}  aux {rel_aux if rel_aux is None else f'{rel_aux:.3e}'}   "
              f"step ms ours {ours_ms:8.3f} torch {torch_ms:8.3f}   loss {ours_losses[0]:.4f} -> "
              f"{ours_losses[-1]:.4f}", flush=True)
        tc.print_steps(ours_losses, torch_losses)
    shutil.rmtree(work, ignore_errors=True)
    return tc.finish(results, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
