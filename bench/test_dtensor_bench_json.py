#!/usr/bin/env python3
"""Contract test of `dtensor-bench --json` (the records torch_compare.py and the plot script read).

    python3 bench/test_dtensor_bench_json.py build/bench/dtensor-bench [--plot bench/plot_dtensor_bench.py]

Runs a tiny sweep of the default suite on 4 local ranks, the host-cost mode (worlds 1, 2, 4, 8)
and the overlap mode, then checks every record: the documented keys and types, every rank's
result correct (wrong == 0), overhead == time / raw, algbw / busbw from bytes and the lower
bound, the lower bound never above what the plan moves, single-collective transitions with a raw
op of the same kind, no raw op where the plan has no collective; host records one per world with
framework_us == redistribute_us - raw_us; overlap records with exposed == (overlapped_us -
compute_us) / comm_us. With --plot it also draws the real records (PNG files must appear).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

TRANSITION_KEYS = {
    "kind": str, "transition": str, "src": str, "dst": str, "mesh": str, "mesh_shape": list,
    "backend": str, "world": int, "dtype": str, "planner": str, "bytes": int, "shape": list,
    "local_bytes": int, "route": str, "collectives": int, "single_mesh_dim": bool, "iters": int,
    "warmup": int, "time_us": float, "time_min_us": float, "time_max_us": float, "raw_ops": list,
    "algbw_gbps": float, "busbw_gbps": float, "bytes_per_rank": int, "lower_bound_bytes": int,
    "wrong": int,
}
NULLABLE = {"raw_time_us": float, "raw_min_us": float, "raw_max_us": float, "overhead": float}
HOST_KEYS = {"kind": str, "transition": str, "mesh": str, "bytes": int, "shape": list, "calls": int,
             "world": int, "redistribute_us": float, "raw_us": float, "framework_us": float,
             "time_us": float, "time_min_us": float, "time_max_us": float}
OVERLAP_KEYS = {"kind": str, "transition": str, "src": str, "dst": str, "mesh": str, "mesh_shape": list,
                "backend": str, "world": int, "bytes": int, "local_bytes": int, "shape": list, "route": str,
                "collectives": int, "iters": int, "warmup": int,
                "comm_us": float, "comm_warm_us": float, "compute_us": float, "overlapped_us": float,
                "issue_us": float, "exposed": float, "wrong": int}

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def typed(value, kind):
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
        sys.exit(f"FAIL: {' '.join(cmd)} exited {proc.returncode}")
    return proc.stdout


def check_transition(r):
    name = f"{r.get('transition')} {r.get('bytes')}"
    for key, kind in TRANSITION_KEYS.items():
        check(key in r and typed(r[key], kind), f"{name}: key {key} missing or not {kind.__name__}")
    for key, kind in NULLABLE.items():
        check(key in r and (r[key] is None or typed(r[key], kind)), f"{name}: key {key} missing or bad")
    if failures:
        return
    check(r["wrong"] == 0, f"{name}: {r['wrong']} ranks wrong")
    check(r["time_min_us"] <= r["time_us"] <= r["time_max_us"], f"{name}: median outside [min, max]")
    check(r["bytes"] == math.prod(r["shape"]) * 4, f"{name}: bytes != prod(shape) * 4 (f32)")
    check(r["transition"] == f"{r['src']}->{r['dst']}", f"{name}: transition != src->dst")
    check(r["lower_bound_bytes"] <= r["bytes_per_rank"], f"{name}: lower bound above the plan's bytes")
    t = r["time_us"] * 1e-6
    check(math.isclose(r["algbw_gbps"], r["bytes"] / t / 1e9, rel_tol=1e-6), f"{name}: algbw")
    check(math.isclose(r["busbw_gbps"], r["lower_bound_bytes"] / t / 1e9, rel_tol=1e-6), f"{name}: busbw")
    if r["collectives"] == 0:
        check(r["raw_ops"] == [] and r["raw_time_us"] is None and r["overhead"] is None,
              f"{name}: a plan without collectives has a raw time")
    else:
        check(len(r["raw_ops"]) == r["collectives"], f"{name}: {len(r['raw_ops'])} raw ops for "
              f"{r['collectives']} collectives")
        check(math.isclose(r["overhead"], r["time_us"] / r["raw_time_us"], rel_tol=1e-6), f"{name}: overhead")
        for op in r["raw_ops"]:
            check(op["op"] in {"all_gather", "all_to_all", "reduce_scatter", "all_reduce"}, f"{name}: op {op}")
            check(op["group_size"] == r["mesh_shape"][op["mesh_dim"]], f"{name}: group size of {op}")
    expected_op = {"S(0)->R": "all_gather", "P->R": "all_reduce", "P->S(0)": "reduce_scatter",
                   "S(0)->S(1)": "all_to_all"}.get(r["transition"])
    if expected_op:
        check([op["op"] for op in r["raw_ops"]] == [expected_op], f"{name}: raw ops {r['raw_ops']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("--plot", help="plot_dtensor_bench.py: also draw the records")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sweep = os.path.join(tmp, "sweep.json")
        host = os.path.join(tmp, "host.json")
        host1 = os.path.join(tmp, "host1.json")
        overlap = os.path.join(tmp, "overlap.json")
        run([args.bench, "--backend", "local", "--world", "4", "--sizes", "1K:8K", "--iters", "2",
             "--warmup", "1", "--json", sweep])
        run([args.bench, "--host-cost", "--iters", "2", "--host-calls", "50", "--json", host])
        run([args.bench, "--host-cost", "--world", "1", "--iters", "2", "--host-calls", "50", "--json", host1])
        run([args.bench, "--backend", "local", "--world", "4", "--overlap", "--suite", "single", "--sizes", "16K,64K",
             "--iters", "2", "--warmup", "1", "--json", overlap])
        records = json.load(open(sweep))
        check(isinstance(records, list) and records, "sweep JSON is not a non-empty list")
        names = {r["transition"] for r in records}
        for expected in ["S(0)->R", "R->S(0)", "P->R", "P->S(0)", "S(0)->S(1)",
                         "S(0),S(0)->_S(0,2),S(0)", "_S(0,2),S(0)->S(0),S(0)"]:
            check(expected in names, f"suite lacks {expected} on 4 ranks")
        check(len(records) == len(names) * 4, f"{len(records)} records for {len(names)} transitions x 4 sizes")
        for r in records:
            check(r.get("kind") == "transition", f"record kind {r.get('kind')}")
            check_transition(r)
        host_records = json.load(open(host))
        check([r.get("world") for r in host_records] == [1, 2, 4, 8],
              f"host records for worlds {[r.get('world') for r in host_records]} (expected 1, 2, 4, 8)")
        check(len(json.load(open(host1))) == 1, "--host-cost --world 1 writes one record")
        for r in host_records:
            for key, kind in HOST_KEYS.items():
                check(key in r and typed(r[key], kind), f"host {r.get('transition')}: key {key}")
            if failures:
                break
            check(r["kind"] == "host" and r["transition"] == "S(0)->R", "host record kind / transition")
            check(math.isclose(r["framework_us"], r["redistribute_us"] - r["raw_us"], rel_tol=1e-9, abs_tol=1e-9),
                  f"host world {r['world']}: framework_us != redistribute_us - raw_us")
            check(r["time_us"] == r["redistribute_us"] and r["mesh"] == str(r["world"]),
                  f"host world {r['world']}: time_us / mesh")
        overlap_records = json.load(open(overlap))
        names = {r.get("transition") for r in overlap_records}
        check(names == {"S(0)->R", "R->S(0)", "P->R", "P->S(0)", "S(0)->S(1)", "Rg(0,[1,2,0,1],4)->R",
                        "P->Rg(0,[1,2,0,1],4)", "Rg(0,[1,2,0,1],4)->Rg(0,[1,1,1,1],1)"},
              f"overlap transitions {names}")
        check(len(overlap_records) == 2 * len(names), f"{len(overlap_records)} overlap records for {len(names)} x 2 sizes")
        for r in overlap_records:
            name = f"overlap {r.get('transition')} {r.get('bytes')}"
            for key, kind in OVERLAP_KEYS.items():
                check(key in r and typed(r[key], kind), f"{name}: key {key} missing or not {kind.__name__}")
            if failures:
                break
            check(r["kind"] == "overlap" and r["wrong"] == 0, f"{name}: kind / wrong")
            check(math.isclose(r["exposed"], (r["overlapped_us"] - r["compute_us"]) / r["comm_us"], rel_tol=1e-6),
                  f"{name}: exposed != (overlapped - compute) / comm")
            check(r["comm_us"] > 0 and r["compute_us"] > 0 and r["overlapped_us"] > 0, f"{name}: times")
            check(0 < r["issue_us"] <= r["overlapped_us"], f"{name}: issue_us {r['issue_us']} not within (0, overlapped_us]")
        if args.plot and not failures:
            out = os.path.join(tmp, "figures")
            proc = subprocess.run([sys.executable, args.plot, sweep, host, overlap, "--out", out],
                                  capture_output=True, text=True, timeout=300)
            check(proc.returncode == 0, f"plot exited {proc.returncode}: {proc.stderr[-2000:]}")
            pngs = [f for f in os.listdir(out) if f.endswith(".png")] if os.path.isdir(out) else []
            check(len(pngs) >= 4 and "dtensor_local_host.png" in pngs and "dtensor_local4_overlap.png" in pngs,
                  f"plot wrote {pngs}")
    for f in failures[:40]:
        print("FAIL:", f)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
