#!/usr/bin/env python3
"""RaggedShard checkpoints cross with PyTorch's DCP (checkpoint/README.md, "Ragged shards").

ours -> torch: checkpoint-tool demo saves the demo tensors ([13,10], [16,8], [7], [3,4,5]; element
  i of tensor k is (i % 1000) * 0.5 + k) under four ragged layouts (units with zeros and align 4
  over 4 ranks, HSDP [R, Rg] on 2x2, [Rg, S(0)] on 2x2, Rg of dims 1.. over 3 ranks): every rank's
  range is several boxes (DCP chunks). PyTorch loads each with dcp.load + HuggingFaceStorageReader
  into full tensors and compares them with the closed form (torch.equal).
torch -> ours: PyTorch saves the same tensors with dcp.save + HuggingFaceStorageWriter;
  checkpoint-tool demo-check loads that directory into Rg DTensors (three layouts) and compares
  every element. A copy with one element changed must be found (exit 1): the check can fail.

One PyTorch process (no process group), so it takes the few seconds of importing torch.

Usage: torch_ragged_test.py CHECKPOINT_TOOL [--python PY]
PY (default: $TORCH_PYTHON, else this interpreter) needs torch >= 2.9 with safetensors; without
it the test reports skipped (exit 77). Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

SHAPES = {"demo.a": (13, 10), "demo.b": (16, 8), "demo.c": (7,), "demo.d": (3, 4, 5)}
DEMOS = [("4", "Rg(0,[1,2,0,1],4)"), ("2,2", "R,Rg(0,[1,3],2)"), ("2,2", "Rg(0,[2,1],1),S(0)"),
         ("3", "Rg(1,[1,0,2],1)")]
TARGETS = [("4", "Rg(0,[1,2,0,1],4)"), ("2,2", "R,Rg(0,[1,3],2)"), ("3", "Rg(0,[0,2,1],5)")]


def torch_worker(cfg: dict) -> int:
    """Loads our directories and writes PyTorch's; exit 77 without torch."""
    import warnings
    warnings.filterwarnings("ignore")  # "assuming the intent is to load in a single process"
    try:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    except ImportError as e:
        print(f"skipped: no usable torch ({e})", file=sys.stderr)
        return 77

    def expected(k: int, shape: tuple) -> "torch.Tensor":
        n = 1
        for s in shape:
            n *= s
        return ((torch.arange(n, dtype=torch.float64) % 1000) * 0.5 + k).to(torch.float32).reshape(shape)

    results = []
    for d in cfg["ours"]:
        sd = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(d["dir"]), no_dist=True)
        for k, (name, shape) in enumerate(SHAPES.items()):
            results.append({"check": f"ours {d['label']} -> torch: {name}", "ok": bool(torch.equal(sd[name],
                                                                                                 expected(k, shape)))})
    full = {name: expected(k, shape) for k, (name, shape) in enumerate(SHAPES.items())}
    dcp.save(full, storage_writer=HuggingFaceStorageWriter(cfg["torch"]), no_dist=True)
    full["demo.d"].view(-1)[37] += 1.0  # the negative control: one element off
    dcp.save(full, storage_writer=HuggingFaceStorageWriter(cfg["torch_bad"]), no_dist=True)
    with open(cfg["out"], "w") as f:
        json.dump(results, f)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tool", nargs="?")
    ap.add_argument("--python", default=os.environ.get("TORCH_PYTHON") or sys.executable)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return torch_worker(json.loads(args.worker))
    if not args.tool:
        ap.error("CHECKPOINT_TOOL is required")
    tmp = tempfile.mkdtemp(prefix="ckpt-torch-ragged-")
    failures = []
    try:
        ours = []
        for i, (mesh, ps) in enumerate(DEMOS):
            d = os.path.join(tmp, f"ours{i}")
            p = subprocess.run([args.tool, "demo", d, "--mesh", mesh, "--placements", ps], capture_output=True,
                               text=True, timeout=60)
            if p.returncode != 0:
                failures.append(f"demo {mesh} {ps}: exit {p.returncode}: {p.stderr.strip()}")
            ours.append({"dir": d, "label": f"{mesh} [{ps}]"})
        cfg = {"ours": ours, "torch": os.path.join(tmp, "torch"), "torch_bad": os.path.join(tmp, "torch_bad"),
               "out": os.path.join(tmp, "torch.json")}
        p = subprocess.run([args.python, os.path.abspath(__file__), "--worker", json.dumps(cfg)], capture_output=True,
                           text=True, timeout=300)
        if p.returncode == 77:
            print(p.stderr.strip() or f"skipped: {args.python} has no torch")
            return 77
        if p.returncode != 0:
            print(f"FAIL: the torch worker exited {p.returncode}: {p.stderr[-2000:]}")
            return 1
        checks = json.load(open(cfg["out"]))
        failures += [c["check"] for c in checks if not c["ok"]]
        if len(checks) != len(DEMOS) * len(SHAPES):
            failures.append(f"{len(checks)} torch checks ran, expected {len(DEMOS) * len(SHAPES)}")
        ran = 0
        for mesh, ps in TARGETS:
            for which, want in (("torch", 0), ("torch_bad", 1)):
                p = subprocess.run([args.tool, "demo-check", cfg[which], "--mesh", mesh, "--placements", ps],
                                   capture_output=True, text=True, timeout=60)
                ran += 1
                if p.returncode != want:
                    failures.append(f"torch -> ours {which} under {mesh} [{ps}]: exit {p.returncode}, expected "
                                    f"{want}: {p.stdout.strip()} {p.stderr.strip()}")
        if ran != 2 * len(TARGETS):
            failures.append(f"{ran} demo-checks ran, expected {2 * len(TARGETS)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for f in failures:
        print(f"FAIL: {f}")
    print(json.dumps({"ours_to_torch": len(DEMOS) * len(SHAPES), "torch_to_ours": 2 * len(TARGETS),
                      "failures": len(failures)}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
