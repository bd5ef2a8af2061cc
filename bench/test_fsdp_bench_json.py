#!/usr/bin/env python3
"""Contract test of `fsdp-bench --json` (tiny model: it checks the records, never a speed).

    python3 bench/test_fsdp_bench_json.py build/bench/fsdp-bench

Runs FSDP over 2 local ranks with both layouts (`--layouts padded,contiguous`) and --host-cost,
then HSDP 2x2 with the padded layout alone, and checks: per requested layout either one record
per prefetch depth or one `skipped` record with its reason (a layout fully_shard refuses); the
documented keys and types; exposed == (step - compute) / comm, the same on the CPU times;
ms per collective == comm / (groups x 3, HSDP x 4); one compute figure for all rows and one comm
figure per layout; a `contiguous/padded` ratio record per depth exactly when both
layouts were measured, equal to the rows' quotients, and then the contiguous layout copying no
more bytes than the padded one; the host-cost record's group count.
"""
import json
import os
import subprocess
import sys
import tempfile

ROW_KEYS = {"mode": str, "backend": str, "layout": str, "prefetch": int, "step_ms": float, "compute_ms": float,
            "comm_ms": float, "collective_ms": float, "exposed": float, "step_cpu_ms": float, "compute_cpu_ms": float,
            "comm_cpu_ms": float, "exposed_cpu": float, "peak_bytes": int, "copy_bytes_per_step": int}
TINY = ["--layers", "2", "--dim", "32", "--vocab", "64", "--seq", "16", "--batch", "4", "--iters", "1", "--warmup", "0"]

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def typed(value, kind):
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)


def close(a, b, tol=1e-9):
    return abs(a - b) <= tol * max(1.0, abs(b))


def run(exe, args, tmp):
    path = os.path.join(tmp, "out.json")
    proc = subprocess.run([exe] + args + ["--json", path], capture_output=True, text=True, timeout=300)
    check(proc.returncode == 0, f"{' '.join(args)}: exit 0 (got {proc.returncode}: {proc.stderr.strip()[-300:]!r})")
    if proc.returncode != 0:
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_layouts(what, records, layouts, prefetch, collectives):
    """The row, skipped and ratio records of one run; returns the number of layouts measured."""
    rows = [r for r in records if "step_ms" in r]
    skipped = [r for r in records if "skipped" in r]
    ratios = [r for r in records if "ratio" in r]
    measured = []
    for layout in layouts:
        mine = [r for r in rows if r.get("layout") == layout]
        gone = [r for r in skipped if r.get("layout") == layout]
        if gone:
            check(len(gone) == 1 and not mine and isinstance(gone[0]["skipped"], str) and gone[0]["skipped"],
                  f"{what} {layout}: one skipped record with its reason, no rows: {gone[0].get('skipped')!r}")
            continue
        measured.append(layout)
        check(sorted(r.get("prefetch") for r in mine) == prefetch, f"{what} {layout}: one row per prefetch {prefetch}")
        for r in mine:
            for key, kind in ROW_KEYS.items():
                check(key in r and typed(r[key], kind), f"{what} {layout} prefetch {r.get('prefetch')}: {key} is {kind.__name__}")
            if not all(key in r and typed(r[key], kind) for key, kind in ROW_KEYS.items()):
                continue
            check(r["step_ms"] > 0 and r["compute_ms"] > 0 and r["comm_ms"] > 0 and r["peak_bytes"] > 0
                  and r["copy_bytes_per_step"] >= 0, f"{what} {layout} prefetch {r['prefetch']}: positive figures")
            check(close(r["exposed"], (r["step_ms"] - r["compute_ms"]) / r["comm_ms"], 1e-6),
                  f"{what} {layout} prefetch {r['prefetch']}: exposed == (step - compute) / comm")
            check(r["step_cpu_ms"] > 0 and r["compute_cpu_ms"] > 0 and r["comm_cpu_ms"] > 0
                  and close(r["exposed_cpu"], (r["step_cpu_ms"] - r["compute_cpu_ms"]) / r["comm_cpu_ms"], 1e-6),
                  f"{what} {layout} prefetch {r['prefetch']}: CPU times positive, exposed_cpu == their quotient")
            check(close(r["collective_ms"], r["comm_ms"] / collectives, 1e-6),
                  f"{what} {layout} prefetch {r['prefetch']}: collective_ms == comm_ms / {collectives}")
        check(len({r.get("comm_ms") for r in mine}) == 1 and len({r.get("comm_cpu_ms") for r in mine}) == 1,
              f"{what} {layout}: one comm figure (wall, CPU) for its rows")
    check(len({r.get("compute_ms") for r in rows}) <= 1 and len({r.get("compute_cpu_ms") for r in rows}) <= 1,
          f"{what}: one compute figure (wall, CPU) for every row")
    check(all(r.get("layout") in layouts for r in rows + skipped), f"{what}: only the requested layouts")
    both = "padded" in measured and "contiguous" in measured
    check(len(ratios) == (len(prefetch) if both else 0), f"{what}: {len(ratios)} ratio records, both measured: {both}")
    for q in ratios:
        by = {r["layout"]: r for r in rows if r.get("prefetch") == q.get("prefetch")}
        if set(by) != {"padded", "contiguous"}:
            check(False, f"{what}: ratio record for prefetch {q.get('prefetch')} without both rows")
            continue
        p, c = by["padded"], by["contiguous"]
        check(q.get("ratio") == "contiguous/padded" and close(q["step_ratio"], c["step_ms"] / p["step_ms"], 1e-6)
              and close(q["peak_ratio"], c["peak_bytes"] / p["peak_bytes"], 1e-6),
              f"{what} prefetch {q['prefetch']}: ratios are the rows' quotients")
        # --iters 1: the paired ratio is that one round's quotient, the same as the medians'.
        check(close(q.get("step_ratio_paired", -1), q["step_ratio"], 1e-6),
              f"{what} prefetch {q['prefetch']}: one round, paired ratio == ratio of medians")
        check(c["copy_bytes_per_step"] <= p["copy_bytes_per_step"],
              f"{what} prefetch {q['prefetch']}: contiguous copies no more than padded "
              f"({c['copy_bytes_per_step']} vs {p['copy_bytes_per_step']})")
    return len(measured)


def main():
    exe = sys.argv[1]
    cases = 0
    with tempfile.TemporaryDirectory() as tmp:
        records = run(exe, ["--dp-shard", "2"] + TINY + ["--host-cost", "--host-layers", "4"], tmp)
        if records:
            # 2 blocks + the root, 3 collectives each (2 all-gathers, 1 reduce-scatter).
            measured = check_layouts("FSDP 2", records, ["padded", "contiguous"], [0, 1, 2], 9)
            check(measured >= 1, "FSDP 2: the padded layout is always measured")
            host = [r for r in records if "host_us_per_group_step" in r]
            check(len(host) == 1 and host[0].get("groups") == 5 and typed(host[0].get("host_us_per_group_step"), float),
                  f"FSDP 2: one host-cost record over 4 blocks + root: {host}")
            cases += 1
        records = run(exe, ["--dp-replicate", "2", "--dp-shard", "2", "--layouts", "padded", "--prefetch", "1"] + TINY, tmp)
        if records:
            # HSDP: the reduction is a reduce-scatter and an all-reduce, 4 collectives per group.
            check(check_layouts("HSDP 2x2", records, ["padded"], [1], 12) == 1, "HSDP 2x2: padded measured")
            check(all(r.get("mode") == "HSDP 2x2" for r in records), "HSDP 2x2: mode")
            cases += 1
    check(cases == 2, f"2 runs checked ({cases})")
    print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
