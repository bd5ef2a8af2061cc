#!/usr/bin/env python3
"""fsdp-train checkpoints with expert parallelism: a run saved under EP 4 (experts S(0) over ep)
resumes under EP 4 (bit-identical progress lines), EP 2, one rank, EP 2 x FSDP 2 and EP 2 carved
from FSDP 4 (--ep-from-dp: experts FSDP over dp_mod_ep), each continuing the uninterrupted loss
curve (--check-parity against the uninterrupted single-rank run); a run saved under the carved
layout resumes under it (bit-identical), under EP 1 on one rank and under EP 2 (--check-parity).
The values load bit-exactly: tests/fsdp/param_mesh_test.cpp.
Usage: fsdp_train_ep_resume_test.py FSDP_TRAIN."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

exe = sys.argv[1]
small = ["--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "48", "--seq", "16", "--batch", "8",
         "--steps", "10", "--log-every", "1", "--moe-experts", "8"]
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def run(*extra):
    p = subprocess.run([exe, "--backend", "local", *small, *extra], capture_output=True, text=True, timeout=240)
    check(p.returncode == 0, f"{' '.join(extra)}: exit {p.returncode}: {p.stderr[-800:]}")
    return p


def losses(p):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+)/\d+ loss (\S+)", p.stdout, re.M)}


root = tempfile.mkdtemp(prefix="fsdp-train-ep-ckpt-")
try:
    ref = losses(run("--ep", "4", "--save-dir", root, "--save-every", "5"))
    check(len(ref) == 10, f"uninterrupted run printed {len(ref)} losses")
    ck = os.path.join(root, "step-00000005")
    same = losses(run("--ep", "4", "--resume-from", ck))
    check(sorted(same) == list(range(6, 11)) and all(same[s] == ref[s] for s in same),
          f"EP 4 -> EP 4 resume differs: {same} vs {ref}")
    cases = 1
    carved = ["--dp-shard", "4", "--ep", "2", "--ep-from-dp"]
    for mesh in (["--ep", "2"], [], ["--ep", "2", "--dp-shard", "2"], carved):
        p = run(*mesh, "--resume-from", ck, "--check-parity")
        check('"parity":"ok"' in p.stdout, f"EP 4 -> {mesh or 'one rank'}: {p.stdout[-300:]}")
        cases += 1
    # Saved under EP 2 carved from FSDP 4 (experts sharded over dp_mod_ep on their own mesh).
    root2 = os.path.join(root, "carved")
    ref2 = losses(run(*carved, "--save-dir", root2, "--save-every", "5"))
    check(len(ref2) == 10, f"carved run printed {len(ref2)} losses")
    ck2 = os.path.join(root2, "step-00000005")
    same2 = losses(run(*carved, "--resume-from", ck2))
    check(sorted(same2) == list(range(6, 11)) and all(same2[s] == ref2[s] for s in same2),
          f"carved -> carved resume differs: {same2} vs {ref2}")
    cases += 1
    for mesh in ([], ["--ep", "2"]):
        p = run(*mesh, "--resume-from", ck2, "--check-parity")
        check('"parity":"ok"' in p.stdout, f"carved -> {mesh or 'one rank'}: {p.stdout[-300:]}")
        cases += 1
    check(cases == 8, f"{cases} resume cases ran")
finally:
    shutil.rmtree(root, ignore_errors=True)
print(f"fsdp_train_ep_resume_test: {len(failures)} failures")
sys.exit(1 if failures else 0)
