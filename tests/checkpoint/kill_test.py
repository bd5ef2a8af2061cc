#!/usr/bin/env python3
"""Kill-during-save: a real process saving checkpoints in a loop (2 ranks, two slots that it
overwrites in turn) is killed with SIGKILL at random points, many times. After each kill the last
committed checkpoint must load with exactly its data, and the slot that was being written must
either load with its own step's data or be refused as incomplete: never wrong data, never
another error. Usage: kill_test.py HELPER [--kills N] [--seed S]."""
import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("helper")
ap.add_argument("--kills", type=int, default=25)
ap.add_argument("--seed", type=int, default=1)
args = ap.parse_args()
rng = random.Random(args.seed)
root = tempfile.mkdtemp(prefix="ckpt-kill-")
failures = 0
incomplete_seen = 0
ran = 0
try:
    for i in range(args.kills):
        d = os.path.join(root, f"run{i % 3}")  # later runs overwrite the checkpoints of earlier ones
        out_path = os.path.join(root, "out.txt")
        with open(out_path, "w") as out:
            p = subprocess.Popen([args.helper, "save", d], stdout=out, stderr=subprocess.STDOUT)
            # Wait for the first commit of this run (so a committed checkpoint exists), then kill
            # at a random point of a later save.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with open(out_path) as f:
                    if "committed" in f.read():
                        break
                if p.poll() is not None:
                    break
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
            p.send_signal(signal.SIGKILL)
            p.wait()
        with open(out_path) as f:
            text = f.read()
        commits = [int(l.split()[1]) for l in text.splitlines() if l.startswith("committed")]
        if not commits:
            print(f"kill {i}: the helper never committed: {text[-2000:]}")
            failures += 1
            continue
        v = subprocess.run([args.helper, "verify", d, str(commits[-1])], capture_output=True, text=True)
        incomplete_seen += v.stdout.count("incomplete")
        ran += 1
        if v.returncode != 0:
            print(f"kill {i} (last commit {commits[-1]}):\n{v.stdout}{v.stderr}")
            failures += 1
finally:
    shutil.rmtree(root, ignore_errors=True)
print(f"kill_test: {ran} kills verified, {incomplete_seen} incomplete checkpoints recognised, {failures} failures")
if ran != args.kills:
    failures += 1
sys.exit(1 if failures else 0)
