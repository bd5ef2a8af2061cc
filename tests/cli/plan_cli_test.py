#!/usr/bin/env python3
"""The `dtensor-check plan` contract: one JSON object (keys in order), no communication, meshes up
to 2^20 ranks, the lower-bound plan on the FSDP x TP unshard at scale, exit 2 on invalid input."""
import json
import subprocess
import sys

PROG = sys.argv[1]
KEYS = ["steps", "collectives", "bytes_per_rank", "lower_bound_bytes", "plan_us", "rank", "schedule_us",
        "schedule_bytes"]
failures = []
ran = 0


def check(cond, what):
    if not cond:
        failures.append(what)


def plan(*args):
    global ran
    ran += 1
    r = subprocess.run([PROG, "plan", *args], capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and r.stderr == "", f"{args}: exit {r.returncode}, stderr {r.stderr!r}")
    lines = r.stdout.splitlines()
    check(len(lines) == 1, f"{args}: {len(lines)} lines")
    j = json.loads(lines[0]) if lines else {}
    check(list(j.keys()) == KEYS, f"{args}: keys {list(j.keys())}")
    return j


# 13 rows of 4 f32 on 4 ranks: chunks of 4,4,4,1 rows; the rank holding 1 row receives 12.
j = plan("--mesh", "4", "--shape", "13,4", "--from", "S(0)", "--to", "R")
check(j["steps"] == "[S(0)] -AG(0)-> [R]", f"steps {j}")
check(j["collectives"] == 1 and j["bytes_per_rank"] == 12 * 4 * 4 and j["lower_bound_bytes"] == 12 * 4 * 4, f"{j}")
check(j["rank"] == 0 and j["plan_us"] >= 0 and j["schedule_us"] >= 0 and j["schedule_bytes"] > 0, f"{j}")

# Greedy goes through Replicate where search regroups; --rank picks the schedule's rank.
g = plan("--mesh", "2x2", "--shape", "8,6", "--from", "_S(0,2),S(0)", "--to", "S(0),S(0)", "--planner", "greedy",
         "--rank", "3")
s = plan("--mesh", "2x2", "--shape", "8,6", "--from", "_S(0,2),S(0)", "--to", "S(0),S(0)", "--rank", "3")
check(g["rank"] == 3 and s["rank"] == 3, f"rank: {g} {s}")
check(s["bytes_per_rank"] <= g["bytes_per_rank"] and s["bytes_per_rank"] >= s["lower_bound_bytes"], f"{g} / {s}")

# RaggedShard (NOTE [ragged plans]): S(0) -> Rg of [9,4] on 4 ranks is one exchange of the
# overlaps on the flattened view, at the lower bound; a ragged all-gather at scale too.
j = plan("--mesh", "4", "--shape", "9,4", "--from", "S(0)", "--to", "Rg(0,[1,2,0,1],1)")
check(j["steps"] == "[S(0)] as [Rg(0,[3,3,3,0],4)] -regroup(0:Rg(0,[3,3,3,0],4)->Rg(0,[1,2,0,1],1))-> "
      "[Rg(0,[1,2,0,1],1)]", f"ragged steps {j}")
check(j["collectives"] == 1 and j["bytes_per_rank"] == j["lower_bound_bytes"] == 36, f"ragged {j}")
units = ",".join(str(i % 7) for i in range(4096))
j = plan("--mesh", "4096", "--shape", "1048576", "--from", f"Rg(0,[{units}],4)", "--to", "R", "--rank", "4095")
check(j["steps"].endswith("-AG(0)-> [R]") and j["bytes_per_rank"] == j["lower_bound_bytes"] > 0, f"ragged AG {j}")

# An explicit rank array: the default rank is the mesh's first.
j = plan("--mesh", "[3,1,2]", "--shape", "11,4", "--from", "P(avg)", "--to", "S(0)", "--dtype", "bf16")
check(j["rank"] == 3 and j["steps"] == "[P(avg)] -RS(0:0,avg)-> [S(0)]", f"explicit mesh: {j}")

# The table: the FSDP x TP unshard at 256 x 8 and beyond is one all-gather at the lower
# bound (before: greedy's 3 steps, 8x the bytes, or refused).
for mesh in ["256x8", "2048x8", "16384x8"]:
    j = plan("--mesh", mesh, "--shape", "65536,4096", "--from", "_S(0,8),S(0)", "--to", "R,S(0)", "--dtype", "bf16")
    check(j["steps"] == "[_S(0,8),S(0)] -_AG(0,sf=8)-> [R,S(0)]", f"{mesh}: {j}")
    check(j["bytes_per_rank"] == j["lower_bound_bytes"], f"{mesh}: {j}")

# 1-D meshes of 16,384 and 2^20 ranks plan (before: refused).
for mesh in ["16384", "1048576"]:
    for src, dst, colls in [("S(0)", "R", 1), ("R", "S(0)", 0), ("S(0)", "S(1)", 1)]:
        j = plan("--mesh", mesh, "--shape", "65536,4096", "--from", src, "--to", dst, "--dtype", "bf16")
        check(j["collectives"] == colls and j["bytes_per_rank"] == j["lower_bound_bytes"], f"{mesh} {src}->{dst}: {j}")

# --wire-dtype: the reductions print and count their wire (NOTE [wire dtype]): bf16 halves f32's
# bytes, f8e5m2 quarters them plus 4 bytes of scale per peer and exchange (3 peers in the
# reduce-scatter, 1 peer twice in the all-reduce); the lower bound stays f32's.
for wire, factor, scales in [("bf16", 2, 0), ("f8e5m2", 4, 4 * 3 + 8 * 1)]:
    f32 = plan("--mesh", "2x4", "--shape", "16,4", "--from", "P,P", "--to", "R,S(0)")
    w = plan("--mesh", "2x4", "--shape", "16,4", "--from", "P,P", "--to", "R,S(0)", "--wire-dtype", wire)
    check(w["steps"] == f"[P,P] -RS(1:0,sum,wire={wire})-> [P,S(0)] -AR(0,sum,wire={wire})-> [R,S(0)]", f"{w}")
    check((w["bytes_per_rank"] - scales) * factor == f32["bytes_per_rank"] and
          w["lower_bound_bytes"] == f32["lower_bound_bytes"],
          f"wire {wire}: {w} vs {f32}")

# Invalid input: exit 2, nothing on stdout, one stderr line naming the value.
bad = [
    (["--mesh", "1048577", "--shape", "4", "--from", "S(0)", "--to", "R"], "1048577"),
    (["--mesh", "4", "--shape", "8", "--from", "S(0)", "--to", "R", "--rank", "4"], "--rank 4"),
    (["--mesh", "4", "--shape", "8", "--from", "S(0)", "--to", "R", "--planner", "x"], "'x'"),
    (["--mesh", "4", "--shape", "8", "--from", "S(0)", "--to", "S(1)"], "S(1)"),
    (["--mesh", "4", "--shape", "8", "--from", "P", "--to", "R", "--wire-dtype", "f64"], "wire dtype f64"),
    (["--mesh", "4", "--shape", "8", "--from", "P(max)", "--to", "R", "--wire-dtype", "bf16"], "not max"),
]
for args, needle in bad:
    ran += 1
    r = subprocess.run([PROG, "plan", *args], capture_output=True, text=True, timeout=60)
    check(r.returncode == 2 and r.stdout == "" and needle in r.stderr and r.stderr.count("\n") == 1,
          f"{args}: exit {r.returncode}, stdout {r.stdout!r}, stderr {r.stderr!r}")

check(ran == 25, f"{ran} runs, expected 25")
if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"ok: {ran} runs")
