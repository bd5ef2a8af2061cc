#!/usr/bin/env python3
"""One bf16 training step of fsdp-train's GPT under PyTorch on a GPU: tokens/s and TFLOP/s.

The model is fsdp-train's (nn/transformer.h): learned positions, pre-norm LayerNorm blocks with
q/k/v/o and a GELU (tanh) MLP of 4 * dim, no Linear biases, an untied LM head; AdamW. Compute in
bf16 (torch.autocast) over f32 master weights, as fsdp-train --mp bf16. Random weights and
tokens: this times the step, it does not compare losses (fsdp-train --check-parity does that).

    python3 bench/gpu_step_torch.py --dim 1024 --layers 8 --heads 16 --seq 1024 --batch 8 --vocab 8192

Last line, one JSON object:
    {"impl":"torch 2.11.0","tokens_per_s":..,"tflops":..,"step_ms":..,"flops_per_token":..}
flops_per_token = 6 * (12 * layers * dim^2 + vocab * dim) + 12 * layers * seq * dim (the matmuls
forward and backward, attention scores and values counted in full: PaLM's formula), the same
formula tools/gpu-check.sh applies to fsdp-train's tokens/s.
Exit status: 0; 2 bad arguments; 77 skipped (no torch, or no CUDA device), with one line
"skipped: <why>".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def flops_per_token(dim: int, layers: int, seq: int, vocab: int) -> int:
    return 6 * (12 * layers * dim * dim + vocab * dim) + 12 * layers * seq * dim


def build(torch, dim: int, layers: int, heads: int, seq: int, vocab: int):
    nn, F = torch.nn, torch.nn.functional
    e = dim // heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
            self.fc2 = nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x):
            b, t = x.shape[0], x.shape[1]
            h = self.ln1(x)
            q, k, v = (w(h).view(b, t, heads, e).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(b, t, dim))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb, self.pos_emb = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids, pos):
            h = self.tok_emb(ids) + self.pos_emb(pos)
            for blk in self.blocks:
                h = blk(h)
            return self.lm_head(self.ln_f(h))

    return GPT()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    # Tests of the skip path on machines that have torch.
    ap.add_argument("--pretend-no-torch", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("dim", "layers", "heads", "seq", "batch", "vocab", "steps"):
        if not 1 <= getattr(a, name) <= 1 << 20:
            print(f"gpu_step_torch: --{name} {getattr(a, name)}: expected 1..{1 << 20}", file=sys.stderr)
            return 2
    if a.dim % a.heads:
        print(f"gpu_step_torch: --dim {a.dim} is not a multiple of --heads {a.heads}", file=sys.stderr)
        return 2
    try:
        if a.pretend_no_torch:
            raise ImportError("--pretend-no-torch")
        import torch
    except ImportError as e:
        print(f"skipped: this python ({sys.executable}) has no torch ({e})")
        return 77
    if not torch.cuda.is_available():
        print(f"skipped: torch {torch.__version__} sees no CUDA device")
        return 77
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = build(torch, a.dim, a.layers, a.heads, a.seq, a.vocab).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    pos = torch.arange(a.seq, device=dev).unsqueeze(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    target = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, pos)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, a.vocab), target.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if not torch.isfinite(loss).item():
        print("gpu_step_torch: the loss is not finite", file=sys.stderr)
        return 1
    med = statistics.median(times)
    tokens = a.batch * a.seq / med
    fpt = flops_per_token(a.dim, a.layers, a.seq, a.vocab)
    print(json.dumps({"impl": f"torch {torch.__version__}", "device": torch.cuda.get_device_name(0),
                      "tokens_per_s": round(tokens), "tflops": round(tokens * fpt / 1e12, 2),
                      "step_ms": round(med * 1e3, 3), "flops_per_token": fpt}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
