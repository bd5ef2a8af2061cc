#!/usr/bin/env python3
"""Test of bench/plot_dtensor_bench.py (plain python, no pytest).

Writes a small synthetic dtensor-bench JSON (two transitions, a few sizes, one null overhead, one
host record) and a torch_compare JSON (with one host row) to a temp folder, runs the script, and checks the PNGs it
prints exist and are valid PNG files of a plausible size; then checks a malformed file exits
non-zero naming the missing key. Run: python3 bench/test_plot_dtensor_bench.py
Exit status 0 when all checks pass, 1 otherwise (a missing matplotlib is a failure too).
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "plot_dtensor_bench.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}")
    else:
        print(f"ok:   {what}")


def transition(tr, src, dst, nbytes, time_us, raw_us, lb_per_rank):
    overhead = None if raw_us is None else time_us / raw_us
    return {
        "kind": "transition", "transition": tr, "src": src, "dst": dst, "mesh": "4", "mesh_shape": [4],
        "backend": "local", "world": 4, "dtype": "f32", "planner": "search", "bytes": nbytes,
        "shape": [nbytes // 4], "route": f"[{src}] -> [{dst}]", "collectives": 0 if raw_us is None else 1,
        "single_mesh_dim": True, "iters": 5, "warmup": 1,
        "time_us": time_us, "time_min_us": time_us * 0.9, "time_max_us": time_us * 1.2,
        "raw_time_us": raw_us, "raw_min_us": raw_us, "raw_max_us": raw_us, "raw_ops": [],
        "overhead": overhead, "algbw_gbps": nbytes / time_us / 1e3,
        "busbw_gbps": lb_per_rank / time_us / 1e3, "bytes_per_rank": lb_per_rank,
        "lower_bound_bytes": lb_per_rank, "wrong": 0,
    }


def bench_records():
    recs = []
    for nbytes in (1 << 10, 1 << 14, 1 << 18, 1 << 20):
        raw = 5.0 + nbytes / 5e3
        recs.append(transition("S(0)->R", "S(0)", "R", nbytes, raw * 1.3 + 2, raw, nbytes * 3 // 4))
        # R -> S(0) has no collective: overhead null at every size, busbw 0 (skipped in both plots)
        recs.append(transition("R->S(0)", "R", "S(0)", nbytes, 1.0 + nbytes / 1e5, None, 0))
        recs.append(transition("P(sum)->R", "P(sum)", "R", nbytes, raw * 2.1 + 3, raw * 2, nbytes * 3 // 2))
    # one null overhead on a transition that otherwise has values
    recs[0]["overhead"] = None
    recs[0]["raw_time_us"] = None
    recs.append({"kind": "host", "transition": "S(0)->R", "backend": "local", "world": 4, "time_us": 3.5,
                 "what": "plan (cached)"})
    # --host-cost records (one per world) and --overlap records
    for world, red, raw in ((1, 0.4, 0.6), (2, 6.0, 5.0), (4, 15.0, 12.0), (8, 35.0, 30.0)):
        recs.append({"kind": "host", "transition": "S(0)->R", "mesh": str(world), "backend": "local",
                     "world": world, "redistribute_us": red, "raw_us": raw, "framework_us": red - raw,
                     "time_us": red})
    for tr, base in (("S(0)->R", 0.02), ("P->S(0)", 0.3)):
        for local in (1 << 20, 1 << 22, 1 << 24):
            recs.append({"kind": "overlap", "transition": tr, "mesh": "4", "backend": "local", "world": 4,
                         "bytes": local * 4, "local_bytes": local, "collectives": 1, "comm_us": 100.0,
                         "compute_us": 100.0, "overlapped_us": 100.0 + 100 * base, "exposed": base})
    return recs


def torch_records():
    recs = []
    for tr, supported in (("S(0)->R", True), ("P(sum)->S(0)", False)):
        for nbytes in (1 << 10, 1 << 16, 1 << 20):
            recs.append({
                "transition": tr, "mesh": "4", "bytes": nbytes,
                "torch_time_us": 80.0 if supported else None, "torch_raw_time_us": 20.0 if supported else None,
                "torch_overhead": (4.0 - nbytes / (1 << 19)) if supported else None,
                "ours_time_us": 22.0, "ours_raw_time_us": 20.0, "ours_overhead": 1.1 + 1e3 / nbytes,
                "ours_backend": "local", "torch_supported": supported,
            })
    recs.append({"kind": "host", "transition": "S(0)->R", "mesh": "1", "bytes": 64, "torch_time_us": 25.0,
                 "ours_time_us": 1.2, "ours_backend": "local", "torch_supported": True})
    return recs


def run(args):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True)


def check_png(path):
    check(os.path.isfile(path), f"{os.path.basename(path)} exists")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        head = f.read(8)
    check(head == PNG_SIGNATURE, f"{os.path.basename(path)} has the PNG signature")
    size = os.path.getsize(path)
    check(size > 10_000, f"{os.path.basename(path)} is non-trivial ({size} bytes)")


def main():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("FAIL: matplotlib is not installed for", sys.executable,
              "(tools/setup.sh installs Debian's python3-matplotlib)")
        return 1

    with tempfile.TemporaryDirectory() as tmp:
        bench = os.path.join(tmp, "bench.json")
        torch = os.path.join(tmp, "torch_compare.json")
        out = os.path.join(tmp, "figures")
        with open(bench, "w") as f:
            json.dump(bench_records(), f)
        with open(torch, "w") as f:
            json.dump(torch_records(), f)

        r = run([bench, "--torch", torch, "--out", out])
        check(r.returncode == 0, f"plot exits 0 (rc {r.returncode}; stderr: {r.stderr.strip()})")
        printed = [line.strip() for line in r.stdout.splitlines() if line.strip()]
        expected = ["dtensor_local4_busbw.png", "dtensor_local4_overhead.png", "dtensor_local4_host.png",
                    "dtensor_local_host.png", "dtensor_local4_overlap.png", "torch_compare.png",
                    "torch_compare_host.png"]
        for name in expected:
            path = os.path.join(out, name)
            check(path in printed, f"{name} printed")
            check_png(path)

        # Malformed: a transition record without busbw_gbps.
        bad_recs = bench_records()
        del bad_recs[2]["busbw_gbps"]
        bad = os.path.join(tmp, "bad.json")
        with open(bad, "w") as f:
            json.dump(bad_recs, f)
        r = run([bad, "--out", os.path.join(tmp, "bad_figures")])
        check(r.returncode != 0, f"malformed file exits non-zero (rc {r.returncode})")
        check("busbw_gbps" in r.stderr and "bad.json" in r.stderr,
              f"the message names the file and the missing key ({r.stderr.strip()!r})")

        # Malformed torch file: a record without torch_overhead.
        bad_torch = torch_records()
        del bad_torch[0]["torch_overhead"]
        badt = os.path.join(tmp, "bad_torch.json")
        with open(badt, "w") as f:
            json.dump(bad_torch, f)
        r = run([bench, "--torch", badt, "--out", os.path.join(tmp, "bad_figures")])
        check(r.returncode != 0 and "torch_overhead" in r.stderr,
              f"malformed torch file exits non-zero naming the key ({r.stderr.strip()!r})")

        # Not a list (e.g. a collectives-bench JSON object).
        obj = os.path.join(tmp, "object.json")
        with open(obj, "w") as f:
            json.dump({"header": {}, "rows": []}, f)
        r = run([obj, "--out", os.path.join(tmp, "bad_figures")])
        check(r.returncode != 0 and "list of records" in r.stderr,
              f"a JSON object at the top level is refused ({r.stderr.strip()!r})")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
