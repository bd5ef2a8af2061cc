#!/usr/bin/env python3
"""PyTorch reads our low-precision checkpoints (issue 27; not part of CI: it needs torch).

lowp-checkpoint-export saves one weight (64 x 96 by default) quantised under FSDP 4: fp8 as
safetensors F8_E4M3 plus "w._scale", NF4 as U8 codes plus "w._scale" (double-quantised absmax),
"w._scale_factor" and "w._scale_mean". This script loads every shard file with
safetensors.torch, checks the codes arrive as torch.float8_e4m3fn (fp8) / torch.uint8 (nf4),
assembles the full tensor from the files' DCP_SHARDING_INFO offsets, dequantises in torch
(fp8: q.float() / scale; nf4: level[code] * (scaler / factor + mean), float32 throughout) and
compares with our fsdp::fake_quantize values bit for bit.

Usage (from the repository root, after ninja -C build bench/lowp-checkpoint-export):
    /work/torchvenv/bin/python bench/torch_lowp_checkpoint.py [--build-dir build]
The last line is one JSON object; exit 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file

NF4_LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0]


def assemble(ck_dir: str) -> dict[str, torch.Tensor]:
    """Every key's full tensor from the shard files (each file: one chunk per key, offsets in
    its metadata)."""
    chunks: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for path in sorted(glob.glob(os.path.join(ck_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        for key, t in load_file(path).items():
            chunks.setdefault(key, []).append((info[key]["saved_offsets"], t))
    out = {}
    for key, parts in chunks.items():
        shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        full = torch.empty(shape, dtype=parts[0][1].dtype)
        for o, t in parts:
            full[tuple(slice(o[d], o[d] + t.shape[d]) for d in range(t.dim()))] = t
        out[key] = full
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    exe = os.path.join(args.build_dir, "bench", "lowp-checkpoint-export")
    checks: list[tuple[str, bool]] = []
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([exe, "--dir", d, "--world", str(args.world)], check=True)
        ref = load_file(os.path.join(d, "reference.safetensors"))
        fp8 = assemble(os.path.join(d, "fp8"))
        checks.append(("fp8 codes are torch.float8_e4m3fn", fp8["w"].dtype == torch.float8_e4m3fn))
        deq = fp8["w"].float() / fp8["w._scale"][0]
        checks.append(("fp8 dequantised == fake_quantize, bit for bit", torch.equal(deq, ref["fp8"])))
        nf4 = assemble(os.path.join(d, "nf4"))
        codes = nf4["w"]
        checks.append(("nf4 codes are torch.uint8", codes.dtype == torch.uint8))
        rows, half = codes.shape
        idx = torch.stack([codes >> 4, codes & 0x0F], dim=-1).reshape(rows, 2 * half).long()
        scalers = nf4["w._scale"].view(torch.int8).float()
        factors = nf4["w._scale_factor"]
        mean = nf4["w._scale_mean"][0]
        block = torch.arange(scalers.numel())
        f = factors[block // 256]
        absmax = torch.where(f == 0, mean, scalers / torch.where(f == 0, torch.ones_like(f), f) + mean)
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
        flat = levels[idx.reshape(-1)] * absmax[torch.arange(idx.numel()) // 64]
        checks.append(("nf4 dequantised == fake_quantize, bit for bit",
                       torch.equal(flat.reshape(rows, 2 * half), ref["nf4"])))
    for what, ok in checks:
        print(("ok   " if ok else "FAIL ") + what)
    failed = [w for w, ok in checks if not ok]
    print(json.dumps({"checks": len(checks), "failed": failed, "torch": torch.__version__}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
