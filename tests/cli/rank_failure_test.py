#!/usr/bin/env python3
"""A rank that fails reports its own error first, the others name it within its --timeout-ms
plus a few seconds, and the run ends soon after with the root cause's exit status
(program/main.h), on the local backend and, when given mpirun, under mpirun (one process per
rank). The failure is injected by dtensor-check's hidden --inject-failure RANK (that rank raises
a ResourceError before redistributing, as an allocation failure would).

Times run from the plan line, which dtensor-check prints once it is up and before any rank
redistributes (mpirun's launch, MPI_Init and planning before it take seconds on a loaded machine,
more under ASan, and no timeout bounds them):
  - the failure: every line reporting it arrives within the timeout + 10 s (the survivors under
    mpi wait out one collective timeout);
  - the end, under mpi: the exit follows the last report within control_timeout (2 x timeout +
    5 s, tools/dtensor_check.cpp: what each print barrier may wait) + 10 s, not the backend's
    fixed 300 s. Most of it is the processes' exit: under ASan with LeakSanitizer's full
    unwinding (tools/sanitizers.sh) 6.6-8.7 s under stress-ng --cpu 2 on the 2-core machine.

  rank_failure_test.py build/tools/dtensor-check [--mpirun /usr/bin/mpirun]"""
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
    """Runs cmd (killed after limit + 60 s); returns its result, the time its first stdout line
    arrived (None without one), its stderr lines with their arrival times, and its end."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err, first = [], [], []

    def read_out():
        for line in p.stdout:
            if not first:
                first.append(time.monotonic())
            out.append(line)

    def read_err():
        for line in p.stderr:
            err.append((time.monotonic(), line))

    readers = [threading.Thread(target=read_out), threading.Thread(target=read_err)]
    for t in readers:
        t.start()
    try:
        p.wait(timeout=limit + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        check(False, f"still running {limit + 60:.0f} s after the start: {cmd}")
    end = time.monotonic()
    for t in readers:
        t.join()
    r = subprocess.CompletedProcess(cmd, p.returncode, "".join(out), "".join(l for _, l in err))
    return r, (first[0] if first else None), err, end


def check_within(start, when, limit, what):
    """when - start < limit (seconds), printed either way."""
    check(start is not None, f"{what}: no plan line on stdout")
    if start is not None:
        print(f"{what}: {when - start:.2f} s (limit {limit:.1f} s)")
        check(when - start < limit, f"{what}: {when - start:.1f} s, more than {limit:.1f} s")


base = ["redistribute", "--mesh", "4", "--shape", "64,8", "--from", "S(0)", "--to", "R", "--inject-failure", "2"]

# Local backend: one process; the failing thread's error is the one line, naming rank 2.
r, plan, lines, end = run([args.dtensor_check] + base + ["--timeout-ms", "300"], 0.3)
err = r.stderr.strip().splitlines()
check(r.returncode == 3, f"local: exit {r.returncode}, want 3 (out of resources)")
check(len(err) == 1 and err[0].startswith("dtensor-check: rank 2: out of resources:") and "injected" in err[0],
      f"local: stderr {r.stderr!r}")
check_within(plan, end, 0.3 + 10, "local: from the plan line to the exit")  # the others are woken at once

if args.mpirun:
    timeout_ms = 2000
    cmd = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", args.dtensor_check] + base + \
          ["--backend", "mpi", "--timeout-ms", str(timeout_ms)]
    r, plan, lines, end = run(cmd, timeout_ms / 1000)
    ours = [l for l in r.stderr.splitlines() if l.startswith("dtensor-check:")]
    check(r.returncode == 3, f"mpi: exit {r.returncode}, want 3 (the root cause's status)")
    check(len(ours) >= 1 and ours[0].startswith("dtensor-check: rank 2: out of resources:"),
          f"mpi: the failing rank's line is not first: {ours}")
    others = [l for l in ours[1:] if "rank 2:" not in l]
    check(len(others) == 3 and all("[2] never joined" in l for l in others),
          f"mpi: the other ranks do not each name rank 2: {ours}")
    reported = max((t for t, l in lines if l.startswith("dtensor-check:")), default=end)
    check_within(plan, reported, timeout_ms / 1000 + 10, "mpi: from the plan line to the last report")
    control_s = 2 * timeout_ms / 1000 + 5
    check_within(reported, end, control_s + 10, "mpi: from the last report to the exit")
print(f"rank_failure_test: {failures} failures")
sys.exit(1 if failures else 0)
