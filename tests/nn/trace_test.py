#!/usr/bin/env python3
"""--trace FILE of fsdp-train, dtensor-bench and fsdp-bench: the file is one Chrome trace
({"traceEvents": [...]}) that parses as JSON, names a process "rank N" per rank, and holds per
rank the compute spans, the collectives (bytes > 0, group, the placement transition as "label"),
the waits (and FSDP's copies); per lane the events are in time order with durations >= 0; every
rank issued the same collectives. With --mpirun, fsdp-train under mpirun -np 2 too (rank 0
gathers both ranks' events into one file). An unwritable path is exit 2 naming it.

usage: trace_test.py FSDP_TRAIN DTENSOR_BENCH FSDP_BENCH [--mpirun MPIRUN]
"""
import collections
import json
import os
import subprocess
import sys
import tempfile

fsdp_train, dtensor_bench, fsdp_bench = sys.argv[1:4]
mpirun = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--mpirun" else None
failures = []
checks = 0
SMALL = ["--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "48", "--seq", "16", "--batch", "4"]


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def load(path, what):
    """The X events by rank, after the checks every trace must pass."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    xs = [e for e in events if e["ph"] == "X"]
    check(len(meta) + len(xs) == len(events), f"{what}: only M and X events")
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    by_rank = collections.defaultdict(list)
    last = {}
    for e in xs:
        check(names.get(e["pid"]) == f"rank {e['pid']}", f"{what}: process {e['pid']} named {names.get(e['pid'])}")
        check((e["pid"], e["tid"]) in lanes, f"{what}: event {e['name']} on an unnamed lane")
        check(e["dur"] >= 0 and e["ts"] >= 0, f"{what}: {e['name']} ts {e['ts']} dur {e['dur']}")
        key = (e["pid"], e["tid"])
        check(e["ts"] >= last.get(key, 0), f"{what}: {e['name']} at {e['ts']} before {last.get(key)} on its lane")
        last[key] = e["ts"]
        by_rank[e["pid"]].append(dict(e, lane=lanes.get(key)))
    return by_rank


def collectives(evs):
    return [e for e in evs if e["cat"] == "collective"]


def check_rank(what, rank, evs, compute, copies):
    """compute: names that must be on the compute lane; copies: whether FSDP copies must show."""
    named = collections.Counter(e["name"] for e in evs if e["lane"] == "compute")
    for name, count in compute.items():
        check(named[name] == count, f"{what} rank {rank}: {named[name]} compute events '{name}', expected {count}")
    colls = collectives(evs)
    check(all(e["lane"].startswith("comm ") for e in colls), f"{what} rank {rank}: a collective off a comm lane")
    check(all(isinstance(e["args"].get("bytes"), int) and e["args"]["bytes"] >= 0 for e in colls),
          f"{what} rank {rank}: a collective without bytes")
    check(all(e["args"].get("group_size", 0) >= 1 and "group" in e["args"] for e in colls),
          f"{what} rank {rank}: a collective without its group")
    moving = [e for e in colls if e["args"].get("bytes", 0) > 0 and "->" in e["args"].get("label", "")]
    check(len(moving) >= 1, f"{what} rank {rank}: no collective with bytes and a transition label")
    check(sum(1 for e in evs if e["lane"] == "waits") >= 1, f"{what} rank {rank}: no waits")
    if copies:
        check(sum(1 for e in evs if e["lane"] == "copies") >= 1, f"{what} rank {rank}: no copies")
    return len(colls)


def check_file(what, path, ranks, compute, copies, lo, hi, same_bytes=True):
    """same_bytes=False: all-to-all-v moves different byte counts per rank (MoE token exchanges)."""
    by_rank = load(path, what)
    check(sorted(by_rank) == list(range(ranks)), f"{what}: ranks {sorted(by_rank)}, expected 0..{ranks - 1}")
    total = sum(len(v) for v in by_rank.values())
    check(lo <= total <= hi, f"{what}: {total} events, expected {lo}..{hi}")
    counts = [check_rank(what, r, by_rank[r], compute, copies) for r in sorted(by_rank)]
    check(len(set(counts)) == 1, f"{what}: collectives per rank {counts} differ")
    sig = [[(e["name"], e["args"]["bytes"] if same_bytes else None, e["args"]["group"]) for e in sorted(collectives(by_rank[r]),
                                                                                 key=lambda e: e["ts"])
            if e["args"]["group"] != "world"] for r in sorted(by_rank)]
    check(all(s == sig[0] for s in sig), f"{what}: ranks issued different mesh collectives")
    return by_rank


STEPS = {"step 1": 1, "step 2": 1, "forward": 2, "backward": 2, "optimizer": 2}
ran = 0
with tempfile.TemporaryDirectory() as d:
    # fsdp-train, FSDP over 2 ranks (local threads), 2 steps.
    p = os.path.join(d, "train.json")
    r = run([fsdp_train, "--dp-shard", "2", "--steps", "2", "--log-every", "2", "--trace", p] + SMALL)
    check(r.returncode == 0, f"fsdp-train exit {r.returncode}: {r.stderr}")
    if r.returncode == 0:
        by_rank = check_file("fsdp-train", p, 2, STEPS, True, 100, 5000)
        labels = {e["args"].get("label") for e in collectives(by_rank[0])}
        check("S(0) -> R on mesh dim 0 (AG(0))" in labels, f"fsdp-train: labels {sorted(map(str, labels))}")
        ran += 1
    # The same run without --trace writes nothing and prints the same JSON line (but the speed).
    r2 = run([fsdp_train, "--dp-shard", "2", "--steps", "2", "--log-every", "2"] + SMALL)
    strip = lambda out: {k: v for k, v in json.loads(out.strip().splitlines()[-1]).items() if k != "tokens_per_s"}
    check(r2.returncode == 0 and r.returncode == 0 and strip(r.stdout) == strip(r2.stdout),
          "fsdp-train: --trace changed the result")

    # fsdp-train with MoE under EP 2: the token exchanges show with their labels (2 steps: forward
    # counts, dispatch, combine; backward dispatch and combine), the same on both ranks.
    p = os.path.join(d, "moe.json")
    r = run([fsdp_train, "--moe-experts", "4", "--ep", "2", "--steps", "2", "--log-every", "2", "--trace", p] + SMALL)
    check(r.returncode == 0, f"fsdp-train --ep 2 exit {r.returncode}: {r.stderr}")
    if r.returncode == 0:
        by_rank = check_file("fsdp-train --ep 2", p, 2, STEPS, False, 50, 5000, same_bytes=False)
        layers = int(SMALL[SMALL.index("--layers") + 1])
        for rank in (0, 1):
            moe = collections.Counter(e["args"].get("label") for e in collectives(by_rank[rank])
                                      if str(e["args"].get("label", "")).startswith("moe "))
            want = {k: 2 * layers for k in ("moe dispatch", "moe combine",
                                            "moe dispatch backward", "moe combine backward")}
            check(dict(moe) == want, f"fsdp-train --ep 2 rank {rank}: MoE exchanges {dict(moe)}, expected {want}")
        ran += 1

    # dtensor-bench: one transition, one size, 2 ranks.
    p = os.path.join(d, "bench.json")
    r = run([dtensor_bench, "--backend", "local", "--world", "2", "--from", "S(0)", "--to", "R", "--sizes", "64K",
             "--iters", "2", "--warmup", "1", "--trace", p])
    check(r.returncode == 0, f"dtensor-bench exit {r.returncode}: {r.stderr}")
    if r.returncode == 0:
        check_file("dtensor-bench", p, 2, {"redistribute S(0)->R": 3, "raw all_gather(0)": 3}, False, 20, 2000)
        ran += 1

    # fsdp-bench, the smallest configuration.
    p = os.path.join(d, "fsdp.json")
    r = run([fsdp_bench, "--dp-shard", "2", "--layers", "2", "--dim", "32", "--vocab", "64", "--seq", "16",
             "--batch", "4", "--iters", "1", "--warmup", "0", "--layouts", "padded", "--trace", p])
    check(r.returncode == 0, f"fsdp-bench exit {r.returncode}: {r.stderr}")
    if r.returncode == 0:
        steps = {f"FSDP step, padded, prefetch {k}": 1 for k in range(3)}
        check_file("fsdp-bench", p, 2, dict(steps, **{"compute alone": 1, "communication alone, padded": 1}), True,
                   100, 20000)
        ran += 1

    # Under mpirun: one file, both processes' events.
    if mpirun:
        p = os.path.join(d, "mpi.json")
        r = run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", fsdp_train, "--backend", "mpi",
                 "--dp-shard", "2", "--steps", "2", "--log-every", "2", "--trace", p] + SMALL)
        check(r.returncode == 0, f"mpirun fsdp-train exit {r.returncode}: {r.stderr}")
        if r.returncode == 0:
            check_file("fsdp-train mpi", p, 2, STEPS, True, 100, 5000)
            ran += 1

    # A path that cannot be written: exit 2, one line naming it, before any work.
    bad = os.path.join(d, "missing", "t.json")
    for cmd in ([fsdp_train, "--dp-shard", "2"], [dtensor_bench, "--world", "2"], [fsdp_bench, "--dp-shard", "2"]):
        r = run(cmd + ["--trace", bad])
        check(r.returncode == 2 and bad in r.stderr and r.stdout == "",
              f"{os.path.basename(cmd[0])} --trace {bad}: exit {r.returncode}, stdout {r.stdout[:80]!r}, "
              f"stderr {r.stderr!r}")
        ran += 1

expected = 7 + (1 if mpirun else 0)
check(ran == expected, f"{ran} cases ran, expected {expected}")
for f in failures:
    print("FAIL:", f)
print(f"{checks} checks, {ran} cases, {len(failures)} failures")
sys.exit(1 if failures else 0)
