#!/usr/bin/env python3
"""A rank that fails reports its own error first, the others name it, and the run ends within
its --timeout-ms plus a few seconds with the root cause's exit status (program/main.h), on the
local backend and, when given mpirun, under mpirun (one process per rank). The failure is
injected by dtensor-check's hidden --inject-failure RANK (that rank raises a ResourceError
before redistributing, as an allocation failure would).

The time is counted from the plan line, which dtensor-check prints once it is up and before any
rank redistributes, to the exit: mpirun's launch, MPI_Init and planning before it take seconds on
a loaded machine (more under ASan) and no timeout bounds them.

  rank_failure_test.py build/tests/dtensor-check [--mpirun /usr/bin/mpirun]"""
import argparse
import subprocess
import sys
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("dtensor_check")
ap.add_argument("--mpirun")
args = ap.parse_args()
failures = 0


def check(ok, what):
    global failures
    if not ok:
        failures += 1
        print("FAIL:", what)


def run(cmd, limit):
    """Runs cmd (killed after limit + 60 s); returns its result and the seconds from its first
    stdout line to its exit (None without one)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err, first = [], [], []

    def read_out():
        for line in p.stdout:
            if not first:
                first.append(time.monotonic())
            out.append(line)

    readers = [threading.Thread(target=read_out), threading.Thread(target=lambda: err.append(p.stderr.read()))]
    for t in readers:
        t.start()
    try:
        p.wait(timeout=limit + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        print(f"FAIL: still running {limit + 60:.0f} s after the start: {cmd}")
    end = time.monotonic()
    for t in readers:
        t.join()
    r = subprocess.CompletedProcess(cmd, p.returncode, "".join(out), "".join(err))
    return r, (end - first[0] if first else None)


def check_took(took, timeout_s, what):
    check(took is not None, f"{what}: no plan line on stdout")
    if took is not None:
        print(f"{what}: ended {took:.2f} s after the plan line (timeout {timeout_s} s)")
        check(took < timeout_s + 10, f"{what}: took {took:.1f} s after the plan line, more than the timeout + 10 s")


base = ["redistribute", "--mesh", "4", "--shape", "64,8", "--from", "S(0)", "--to", "R", "--inject-failure", "2"]

# Local backend: one process; the failing thread's error is the one line, naming rank 2.
r, took = run([args.dtensor_check] + base + ["--timeout-ms", "300"], 0.3)
err = r.stderr.strip().splitlines()
check(r.returncode == 3, f"local: exit {r.returncode}, want 3 (out of resources)")
check(len(err) == 1 and err[0].startswith("dtensor-check: rank 2: out of resources:") and "injected" in err[0],
      f"local: stderr {r.stderr!r}")
check_took(took, 0.3, "local")

if args.mpirun:
    timeout_ms = 2000
    cmd = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", args.dtensor_check] + base + \
          ["--backend", "mpi", "--timeout-ms", str(timeout_ms)]
    r, took = run(cmd, timeout_ms / 1000)
    ours = [l for l in r.stderr.splitlines() if l.startswith("dtensor-check:")]
    check(r.returncode == 3, f"mpi: exit {r.returncode}, want 3 (the root cause's status)")
    check(len(ours) >= 1 and ours[0].startswith("dtensor-check: rank 2: out of resources:"),
          f"mpi: the failing rank's line is not first: {ours}")
    others = [l for l in ours[1:] if "rank 2:" not in l]
    check(len(others) == 3 and all("[2] never joined" in l for l in others),
          f"mpi: the other ranks do not each name rank 2: {ours}")
    # Survivors wait one collective timeout, then report; the print barriers and the closing
    # barrier are bounded by multiples of --timeout-ms, not by a fixed 300 s.
    check_took(took, timeout_ms / 1000, "mpi")
print(f"rank_failure_test: {failures} failures")
sys.exit(1 if failures else 0)
