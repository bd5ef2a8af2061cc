#!/usr/bin/env python3
"""The `dtensor-check layout` contract: exact output, rank order, and exit 2 on invalid input."""
import json
import subprocess
import sys

PROG = sys.argv[1]
failures = []


def run(*args):
    return subprocess.run([PROG, *args], capture_output=True, text=True, timeout=60)


def check(cond, what):
    if not cond:
        failures.append(what)


# The contract example, byte for byte.
r = run("layout", "--mesh", "4x2", "--shape", "13,2", "--placements", "S(0),S(0)")
expected = """\
{"rank":0,"coord":[0,0],"local_shape":[2,2],"global_offset":[0,0],"indices":[[0,1],[0,1]]}
{"rank":1,"coord":[0,1],"local_shape":[2,2],"global_offset":[2,0],"indices":[[2,3],[0,1]]}
{"rank":2,"coord":[1,0],"local_shape":[2,2],"global_offset":[4,0],"indices":[[4,5],[0,1]]}
{"rank":3,"coord":[1,1],"local_shape":[2,2],"global_offset":[6,0],"indices":[[6,7],[0,1]]}
{"rank":4,"coord":[2,0],"local_shape":[2,2],"global_offset":[8,0],"indices":[[8,9],[0,1]]}
{"rank":5,"coord":[2,1],"local_shape":[2,2],"global_offset":[10,0],"indices":[[10,11],[0,1]]}
{"rank":6,"coord":[3,0],"local_shape":[1,2],"global_offset":[12,0],"indices":[[12],[0,1]]}
{"rank":7,"coord":[3,1],"local_shape":[0,2],"global_offset":[13,0],"indices":[[],[0,1]]}
"""
check(r.returncode == 0 and r.stdout == expected and r.stderr == "", f"contract example: {r}")

# Explicit rank array and names: lines in rank order, coords from the array.
r = run("layout", "--mesh", "[[0,2],[1,3]]", "--names", "dp,tp", "--shape", "8,2",
        "--placements", "_S(0,2),S(0)")
lines = [json.loads(l) for l in r.stdout.splitlines()]
check(r.returncode == 0, f"explicit mesh exit: {r}")
check([l["rank"] for l in lines] == [0, 1, 2, 3], f"rank order: {lines}")
check([l["coord"] for l in lines] == [[0, 0], [1, 0], [0, 1], [1, 1]], f"coords: {lines}")
check([l["indices"][0] for l in lines] == [[0, 1], [2, 3], [4, 5], [6, 7]], f"strided: {lines}")
check(list(lines[0].keys()) == ["rank", "coord", "local_shape", "global_offset", "indices"],
      "key order")

# Uneven StridedShard with non-contiguous indices, Partial and negative dims.
r = run("layout", "--mesh", "4", "--shape", "9", "--placements", "_S(-1,2)")
lines = [json.loads(l) for l in r.stdout.splitlines()]
check([l["indices"][0] for l in lines] == [[0, 1, 5], [2, 3, 6], [4, 7], [8]], f"9/sf2/4: {lines}")
check([l["global_offset"] for l in lines] == [[0], [2], [4], [8]], f"offsets: {lines}")
r = run("layout", "--mesh", "2x2", "--shape", "3,0", "--placements", "P(avg),S(1)")
lines = [json.loads(l) for l in r.stdout.splitlines()]
check([l["local_shape"] for l in lines] == [[3, 0]] * 4, f"partial/empty: {lines}")
check([l["global_offset"] for l in lines] == [[0, 0]] * 4, f"empty dim offset sentinel: {lines}")

# RaggedShard: layouts of the flattened view, uneven and empty ranges (sentinel offset).
r = run("layout", "--mesh", "4", "--shape", "5,2", "--placements", "Rg(0,[1,2,0,1],4)")
lines = [json.loads(l) for l in r.stdout.splitlines()]
check(r.returncode == 0, f"ragged exit: {r}")
check([l["indices"][0] for l in lines] == [[], [0, 1, 2, 3], [], [4, 5, 6, 7, 8, 9]], f"ragged: {lines}")
check([l["local_shape"] for l in lines] == [[0], [4], [0], [6]], f"ragged 1-d local shapes: {lines}")
check([l["global_offset"] for l in lines] == [[10], [0], [10], [4]], f"ragged offsets: {lines}")

# Invalid input: exit 2, nothing on stdout, one line on stderr naming the bad value.
bad = [
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "S(0)"], "1 placements"),
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "S(0),S(0),R"], "3 placements"),
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "S(2),R"], "shard dim 2"),
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "S(-3),R"], "shard dim -3"),
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "_S(0,0),R"], "split factor 0"),
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "X(0),R"], "'X(0)'"),
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "S(0,R"], "S(0"),
    (["--mesh", "4x2", "--shape", "13,2", "--placements", "P(mean),R"], "mean"),
    (["--mesh", "4y2", "--shape", "13,2", "--placements", "R,R"], "'4y2'"),
    (["--mesh", "4x0", "--shape", "13,2", "--placements", "R,R"], "'4x0'"),
    (["--mesh", "[[0,1],[2]]", "--shape", "4", "--placements", "R,R"], "ragged"),
    (["--mesh", "[[0,1],[1,2]]", "--shape", "4", "--placements", "R,R"], "rank 1 appears more than once"),
    (["--mesh", "[[0,1],[2,3]", "--shape", "4", "--placements", "R,R"], "[[0,1],[2,3]"),
    (["--mesh", "2x2", "--names", "dp", "--shape", "4", "--placements", "R,R"], "1 mesh dim names"),
    (["--mesh", "2x2", "--names", "dp,dp", "--shape", "4", "--placements", "R,R"], "duplicate mesh dim name 'dp'"),
    (["--mesh", "2x2", "--shape", "4,-1", "--placements", "R,R"], "'-1'"),
    (["--mesh", "2x2", "--shape", "4", "--placements", "P(max),P(sum)"], "mix Partial ops"),
    (["--mesh", "2x2", "--shape", "4"], "--placements"),
    (["--mesh", "2", "--shape", "4", "--placements", "Rg(0,[0,0],1)"], "sum to 0"),
    (["--mesh", "2", "--shape", "4", "--placements", "Rg(0,[1,1,1],1)"], "3 units for 2 ranks"),
    (["--mesh", "2x2", "--shape", "4,4", "--placements", "Rg(0,[1,1],1),S(1)"], "does not compose"),
]
for args, needle in bad:
    r = run("layout", *args)
    err = r.stderr.strip().splitlines()
    check(r.returncode == 2 and r.stdout == "" and len(err) == 1 and needle in err[0],
          f"invalid {args}: rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r} (want '{needle}')")

r = run("--help")
check(r.returncode == 0 and "layout" in r.stdout, "help")
r = run()
check(r.returncode == 2, "no subcommand")
r = run("demo")
check(r.returncode == 0 and "3,3,3,0" in r.stdout, "demo")

for f in failures:
    print("FAIL:", f)
print(f"layout_cli_test: {len(failures)} failures")
sys.exit(1 if failures else 0)
