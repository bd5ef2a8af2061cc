#!/usr/bin/env python3
"""fsdp-train is deterministic: the same flags give the same losses, bit for bit, run after run.

Four rank threads under FSDP make the heap layout (and so the alignment of the kernels' scratch
rows) depend on timing; the losses once differed by an f32 ulp at random steps in about half
the runs. Checks the progress-line losses and the JSON's first/last loss (full double precision).

usage: fsdp_train_determinism_test.py path/to/fsdp-train
"""
import json
import subprocess
import sys

exe = sys.argv[1]
RUNS = 6
ARGS = ["--backend", "local", "--dp-shard", "4", "--steps", "12", "--log-every", "1", "--threads", "1",
        "--prefetch", "0"]


def losses():
    r = subprocess.run([exe] + ARGS, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"fsdp-train {' '.join(ARGS)}: exit {r.returncode}: {r.stderr.strip()}")
    lines = r.stdout.strip().splitlines()
    steps = [l.split()[3] for l in lines if l.startswith("step ")]
    last = json.loads(lines[-1])
    return steps + [repr(last["first_loss"]), repr(last["last_loss"])]


runs = [losses() for _ in range(RUNS)]
if len(runs[0]) != 12 + 2:
    sys.exit(f"expected 12 progress losses and 2 JSON losses, got {len(runs[0])}: {runs[0]}")
differing = [i for i, r in enumerate(runs) if r != runs[0]]
if differing:
    first = differing[0]
    where = [k for k in range(len(runs[0])) if runs[first][k] != runs[0][k]]
    sys.exit(f"{len(differing)} of {RUNS} runs differ from run 0; run {first} at positions {where}: "
             f"{[runs[0][k] for k in where]} vs {[runs[first][k] for k in where]}")
print(f"{RUNS} runs, {len(runs[0])} losses each: identical")
