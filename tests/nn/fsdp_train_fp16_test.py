#!/usr/bin/env python3
"""fsdp-train --mp fp16 (issue 27, item 6): fp16 compute with nn::GradScaler (PyTorch's constants).
--inject-overflow K puts an inf in the last rank's gradient at step K: every rank skips that step
(one all-reduced flag) and the scale backs off 65536 -> 32768. --check-parity compares with one
rank given the same injection: a rank that stepped alone would leave its shard different from
the reference, so parity "ok" proves every rank skipped. The steps before K equal the clean
run's; the step after differs (the skipped update is missing).

usage: fsdp_train_fp16_test.py path/to/fsdp-train
"""
import json
import re
import subprocess
import sys

exe = sys.argv[1]
failures = []
runs = 0
SMALL = ["--mp", "fp16", "--steps", "6", "--log-every", "1", "--check-parity"]
STEP = re.compile(r"^step (\d+)/6 loss (\S+) ")
SCALE = re.compile(r"^  loss_scale (\S+) skipped_steps (\d+)$")


def check(ok, what):
    if not ok:
        failures.append(what)


def run(*args):
    """(exit status, last JSON, [(loss, scale used, skipped so far)] per step)"""
    global runs
    runs += 1
    r = subprocess.run([exe, *SMALL, *args], capture_output=True, text=True, timeout=240)
    lines = r.stdout.strip().splitlines()
    steps = []
    for i, line in enumerate(lines[:-1]):
        m = STEP.match(line)
        s = SCALE.match(lines[i + 1]) if m else None
        if m and s:
            steps.append((float(m.group(2)), float(s.group(1)), int(s.group(2))))
    check(len(steps) == 6, f"{args}: {len(steps)} step/scale line pairs: {lines[:2]}")
    last = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return r, last, steps


for mesh in (["--dp-shard", "4"], ["--dp-replicate", "2", "--dp-shard", "2"]):
    r, clean, cs = run(*mesh)
    check(r.returncode == 0 and clean.get("parity") == "ok", f"{mesh} clean: exit {r.returncode} {r.stderr.strip()}")
    check(all(s == 65536 and k == 0 for _, s, k in cs), f"{mesh} clean: scale / skips {cs}")
    r, inj, js = run(*mesh, "--inject-overflow", "3")
    check(r.returncode == 0 and inj.get("parity") == "ok",
          f"{mesh} injected: exit {r.returncode} {r.stderr.strip()} (a rank that did not skip breaks parity)")
    if len(cs) == 6 and len(js) == 6:
        check([k for _, _, k in js] == [0, 0, 1, 1, 1, 1], f"{mesh}: skipped counts {js}")
        check([s for _, s, _ in js] == [65536] * 3 + [32768] * 3, f"{mesh}: scales {js}")
        check([l for l, _, _ in js[:3]] == [l for l, _, _ in cs[:3]], f"{mesh}: steps 1-3 differ from the clean run")
        check(js[3][0] != cs[3][0], f"{mesh}: step 4 equals the clean run's: the skip changed nothing")

check(runs == 4, f"{runs} runs, expected 4")
if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"ok: {runs} runs")
