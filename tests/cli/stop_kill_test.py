#!/usr/bin/env python3
"""Under mpirun, a rank process that is stopped (SIGSTOP) or killed (SIGKILL) in the middle of a
run makes the whole job end within --timeout-ms plus 10 s, and the failure names that rank:
  - stopped: every survivor's collective times out and its one line names the stopped rank
    among the ranks that never joined, or among those that joined but have not completed the
    call, and no line names nobody ("ranks []") (exit 4, communication failure);
  - killed: mpirun aborts the job and names the rank that died.
The job runs on 4 processes for far longer than the test waits: dtensor-bench timing S(0) -> R,
or fsdp-train training with FSDP over 4 ranks (--dp-shard 4), chosen by the program's name.

  stop_kill_test.py build/bench/dtensor-bench /usr/bin/mpirun
  stop_kill_test.py build/examples/fsdp-train /usr/bin/mpirun"""
import os
import re
import signal
import subprocess
import sys
import time

program, mpirun = sys.argv[1], sys.argv[2]
NAME = os.path.basename(program)
TIMEOUT_MS = 2000
VICTIM = 2
failures = 0
ran = 0


def check(ok, what):
    global failures
    if not ok:
        failures += 1
        print("FAIL:", what)


def rank_pids(parent):
    """OMPI_COMM_WORLD_RANK -> pid of mpirun's children."""
    out = {}
    kids = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    for pid in kids:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(kv.split(b"=", 1)[1])] = int(pid)
    return out


def one(sig):
    global ran
    if NAME == "fsdp-train":
        job = ["--dp-shard", "4", "--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "48", "--seq", "16",
               "--batch", "4", "--steps", "1000000", "--log-every", "1000000"]
    else:
        job = ["--from", "S(0)", "--to", "R", "--sizes", "256K", "--iters", "1000000", "--warmup", "0"]
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", program, "--backend", "mpi"] + job + [
        "--timeout-ms", str(TIMEOUT_MS)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = {}
    deadline = time.monotonic() + 60
    while len(pids) < 4 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
        pids = rank_pids(p.pid)
    check(len(pids) == 4, f"{sig.name}: found rank processes {pids}")
    if len(pids) < 4:
        p.kill()
        p.communicate()
        return
    time.sleep(3)  # well inside the timed loop (MPI_Init and the first collectives are done)
    victim = pids[VICTIM]
    os.kill(victim, sig)
    sent = time.monotonic()
    try:
        _, err = p.communicate(timeout=TIMEOUT_MS / 1000 + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        check(False, f"{sig.name}: the job still ran 60 s after the timeout")
    took = time.monotonic() - sent
    for pid in pids.values():  # a stopped victim outlives mpirun
        for s in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, s)
            except OSError:
                pass
    ran += 1
    print(f"{sig.name} rank {VICTIM}: exit {p.returncode} after {took:.1f} s")
    print("\n".join("  " + l for l in err.splitlines() if l.strip() and not l.startswith("---")))
    check(p.returncode != 0, f"{sig.name}: exit status 0")
    check(took < TIMEOUT_MS / 1000 + 10, f"{sig.name}: took {took:.1f} s, more than the timeout + 10 s")
    if sig == signal.SIGSTOP:
        # The survivors' lines (mpirun continues the victim before it terminates it, so the victim
        # may print a line of its own).
        ours = [l for l in err.splitlines() if l.startswith(NAME + ":") and not l.startswith(f"{NAME}: rank {VICTIM}:")]
        # The honest outcomes: the victim never joined the call, or joined it (a stopped member may
        # have entered later calls as well) and has not completed it; a line naming nobody
        # ("ranks []") is wrong.
        victim_in = r"ranks \[(?:[0-9]+,)*%d(?:,[0-9]+)*\] " % VICTIM
        named = [l for l in ours if re.search(victim_in + r"(never joined|joined but have not completed it)", l)]
        check(len(ours) >= 1 and len(named) == len(ours), f"SIGSTOP: not every line names rank {VICTIM}: {ours}")
        check(not any("ranks []" in l for l in ours), f"SIGSTOP: a line names nobody: {ours}")
        # Every survivor names it: a line from each of the other ranks.
        speakers = {int(m.group(1)) for l in ours for m in [re.match(NAME + r": rank (\d+): ", l)] if m}
        check(set(range(4)) - {VICTIM} <= speakers, f"SIGSTOP: lines from ranks {sorted(speakers)}, want every survivor")
        check(p.returncode == 4, f"SIGSTOP: exit {p.returncode}, want 4 (communication failure)")
    else:
        check(re.search(r"process rank %d .*signal 9" % VICTIM, err) is not None,
              f"SIGKILL: mpirun does not name rank {VICTIM}: {err!r}")


for sig in (signal.SIGSTOP, signal.SIGKILL):
    one(sig)
check(ran == 2, f"{ran} of 2 cases ran")
print(f"summary: {ran - failures if failures <= ran else 0} passed, {failures} failed")
sys.exit(1 if failures else 0)
