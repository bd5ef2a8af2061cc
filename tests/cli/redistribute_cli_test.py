#!/usr/bin/env python3
"""The `dtensor-check redistribute` and `fuzz` contracts: exact plan line, one ok line per rank in
rank order, PyTorch's collective counts (docs/pytorch-semantics.md 6.2, greedy planner), exit 2 with
one line on stderr for invalid input or an unsupported transition."""
import itertools
import json
import re
import subprocess
import sys

from sanitizer_env import child_env

PROG = sys.argv[1]
failures = []


def run(*args):
    return subprocess.run([PROG, *args], capture_output=True, text=True, timeout=120, env=child_env(args))


def check(cond, what):
    if not cond:
        failures.append(what)


def redistribute(mesh, shape, src, dst, *extra):
    return run("redistribute", "--mesh", mesh, "--shape", shape, "--from", src, "--to", dst, *extra)


PLAN_LINE = re.compile(r'^\{"plan":"[^"]*","collectives":\d+,"bytes_per_rank":\d+\}$')
RANK_LINE = re.compile(r'^\{"rank":\d+,"local_shape":\[[0-9,]*\],"ok":(true|false)\}$')


def parsed(r, nranks):
    """(plan, [rank lines]) when the output has the contract's form, else None."""
    lines = r.stdout.splitlines()
    if len(lines) != nranks + 1 or not PLAN_LINE.match(lines[0]):
        return None
    if not all(RANK_LINE.match(l) for l in lines[1:]):
        return None
    return json.loads(lines[0]), [json.loads(l) for l in lines[1:]]


def check_ok(r, nranks, what, collectives=None, shapes=None):
    p = parsed(r, nranks)
    check(r.returncode == 0 and r.stderr == "" and p is not None,
          f"{what}: rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}")
    if p is None:
        return None
    plan, ranks = p
    check(list(plan.keys()) == ["plan", "collectives", "bytes_per_rank"], f"{what}: plan keys {plan}")
    check([l["rank"] for l in ranks] == list(range(nranks)), f"{what}: rank order {ranks}")
    check(all(l["ok"] is True for l in ranks), f"{what}: not every rank ok: {ranks}")
    check(all(list(l.keys()) == ["rank", "local_shape", "ok"] for l in ranks), f"{what}: rank keys")
    if collectives is not None:
        check(plan["collectives"] == collectives,
              f"{what}: {plan['collectives']} collectives, PyTorch issues {collectives}: {plan['plan']}")
    if shapes is not None:
        check([l["local_shape"] for l in ranks] == shapes, f"{what}: local shapes {ranks}")
    return plan


# --- The contract example, byte for byte (greedy = PyTorch's plan; search is the default). ---
EXAMPLE = """\
{"plan":"[S(0),R] -chunk(1->S(1))-> [S(0),S(1)] -AG(0)-> [R,S(1)]","collectives":1,"bytes_per_rank":48}
{"rank":0,"local_shape":[7,3],"ok":true}
{"rank":1,"local_shape":[7,2],"ok":true}
{"rank":2,"local_shape":[7,3],"ok":true}
{"rank":3,"local_shape":[7,2],"ok":true}
"""
r = redistribute("2x2", "7,5", "S(0),R", "R,S(1)", "--planner", "greedy")
check(r.returncode == 0 and r.stdout == EXAMPLE and r.stderr == "", f"contract example (greedy): {r}")
r = redistribute("2x2", "7,5", "S(0),R", "R,S(1)")
check_ok(r, 4, "contract example (default planner)", shapes=[[7, 3], [7, 2], [7, 3], [7, 2]])
# Explicit defaults give the same output.
r2 = redistribute("2x2", "7,5", "S(0),R", "R,S(1)", "--dtype", "f32", "--backend", "local", "--planner", "search")
check(r2.returncode == 0 and r2.stdout == r.stdout, f"explicit defaults: {r2}")

r = redistribute("4", "12,3", "S(0)", "R", "--planner", "greedy")
check(r.stdout.splitlines()[:1] == ['{"plan":"[S(0)] -AG(0)-> [R]","collectives":1,"bytes_per_rank":108}'],
      f"1-D all-gather plan line: {r.stdout!r}")
r = redistribute("4", "12,3", "R", "S(0)", "--planner", "greedy")
check(r.stdout.splitlines()[:1] == ['{"plan":"[R] -chunk(0->S(0))-> [S(0)]","collectives":0,"bytes_per_rank":0}'],
      f"1-D chunk plan line: {r.stdout!r}")
r = redistribute("2x2", "7,5", "S(0),R", "S(0),R")
check(r.stdout.splitlines()[:1] == ['{"plan":"[S(0),R]","collectives":0,"bytes_per_rank":0}'],
      f"no-op plan line: {r.stdout!r}")
check_ok(redistribute("2x2", "7,5", "S(0),R", "R,S(1)", "--planner", "greedy", "--dtype", "bf16"), 4,
         "bf16 example")
# bytes_per_rank counts the element size.
r = redistribute("4", "12,3", "S(0)", "R", "--planner", "greedy", "--dtype", "f64")
check(r.stdout.startswith('{"plan":"[S(0)] -AG(0)-> [R]","collectives":1,"bytes_per_rank":216}'), f"f64 bytes: {r.stdout!r}")

# --- PyTorch's redistribute cases (docs/pytorch-semantics.md 6.2), greedy planner: counts, data ---
G = ("--planner", "greedy")
for shape in ["12,3", "13,3", "14,3", "3,12", "3,13", "3,14"]:
    for d in ["0", "1"]:
        check_ok(redistribute("4", shape, f"S({d})", "R", *G), 4, f"1-D {shape} S({d})->R", collectives=1)
        check_ok(redistribute("4", shape, "R", f"S({d})", *G), 4, f"1-D {shape} R->S({d})", collectives=0)
        check_ok(redistribute("4", shape, "P", f"S({d})", *G), 4, f"1-D {shape} P->S({d})", collectives=1)
    check_ok(redistribute("4", shape, "P", "R", *G), 4, f"1-D {shape} P->R", collectives=1)
check_ok(redistribute("4", "2,8", "S(0)", "R", *G), 4, "zero-size S0->R", collectives=1, shapes=[[2, 8]] * 4)
check_ok(redistribute("4", "2,8", "S(0)", "S(1)", *G), 4, "zero-size S0->S1", collectives=1, shapes=[[2, 2]] * 4)
check_ok(redistribute("4", "2,8", "R", "S(0)", *G), 4, "zero-size R->S0", collectives=0,
         shapes=[[1, 8], [1, 8], [0, 8], [0, 8]])
for shape in ["10,5", "9,5", "3,5", "1,3"]:
    for src in ["S(0),S(0)", "S(0),S(1)"]:
        check_ok(redistribute("2x2", shape, src, "R,R", *G), 4, f"uneven (2,2) {shape} {src}->RR")
for shape in ["8,8", "8,8,8", "8,5", "5,8", "5,5"]:
    check_ok(redistribute("4", shape, "S(0)", "S(1)", *G), 4, f"1-D {shape} S0->S1", collectives=1)
    check_ok(redistribute("4", shape, "S(1)", "S(0)", *G), 4, f"1-D {shape} S1->S0", collectives=1)
    for src, dst, n in [("S(0),S(1)", "S(0),S(0)", 1), ("S(0),S(1)", "S(1),S(0)", 2), ("S(0),S(0)", "S(1),S(1)", 2)]:
        check_ok(redistribute("2x2", shape, src, dst, *G), 4, f"(2,2) {shape} {src}->{dst}", collectives=n)
    if shape.count(",") == 2:
        check_ok(redistribute("2x2", shape, "S(0),S(2)", "S(1),S(0)", *G), 4, f"(2,2) {shape} (S0,S2)->(S1,S0)", collectives=2)
        check_ok(redistribute("2x2", shape, "S(1),S(1)", "S(1),S(2)", *G), 4, f"(2,2) {shape} (S1,S1)->(S1,S2)", collectives=1)
for src, dst, n in [("S(0),S(0),S(0)", "S(1),S(1),S(1)", 3), ("S(0),S(1),S(0)", "S(1),S(0),S(0)", 3),
                    ("S(0),S(1),S(2)", "S(2),S(1),S(0)", 2), ("S(1),S(0),S(0)", "R,S(0),S(0)", 1),
                    ("S(1),R,S(0)", "R,S(0),S(0)", 2), ("S(0),S(0),S(1)", "S(0),S(1),S(2)", 2)]:
    check_ok(redistribute("2x2x2", "8,8,8", src, dst, *G), 8, f"(2,2,2) {src}->{dst}", collectives=n)
for x in ["S(1)", "R", "P"]:
    for y in ["S(0)", "S(1)", "R"]:
        check_ok(redistribute("4x1", "8,8", f"S(0),{x}", f"S(0),{y}", *G), 4, f"(4,1) (S0,{x})->(S0,{y})", collectives=0)
# Every input over {R,S0,S1,P}^2 to every output over {R,S0,S1}^2 on (4,2), both planners.
for src in itertools.product(["R", "S(0)", "S(1)", "P"], repeat=2):
    for dst in itertools.product(["R", "S(0)", "S(1)"], repeat=2):
        for planner in ["greedy", "search"]:
            check_ok(redistribute("4x2", "16,24", ",".join(src), ",".join(dst), "--planner", planner), 8,
                     f"(4,2) 16x24 {src}->{dst} {planner}")

# --- Partial targets: PyTorch's allowed and rejected cases. ---
for src, dst in [("P,S(0)", "P,S(0)"), ("P,S(0)", "P,S(1)"), ("S(0),P", "R,P"), ("S(0),P(prod)", "R,P(prod)"),
                 ("P(avg),P(avg)", "P(avg),S(0)"), ("P(max),S(1)", "P(max),R")]:
    for planner in ["greedy", "search"]:
        check_ok(redistribute("2x2", "7,5", src, dst, "--planner", planner), 4, f"kept Partial {src}->{dst} {planner}")
# PyTorch 2.15: a plain Shard may become P(sum) (a local zero-fill); the result reduces to the tensor.
for src, dst in [("S(0),S(1)", "R,P"), ("S(0),R", "P,R"), ("S(0),S(1)", "P,P")]:
    for planner in ["greedy", "search"]:
        check_ok(redistribute("2x2", "7,5", src, dst, "--planner", planner), 4, f"S -> P(sum) {src}->{dst} {planner}")
for src, dst, needle in [("S(0),R", "S(0),P", "P"), ("S(0),R", "R,P", "P"), ("S(0),S(1)", "R,P(avg)", "P(avg)"),
                         ("S(0),P(prod)", "R,P(sum)", "P(prod)"), ("P,R", "P(avg),R", "P(avg)"),
                         ("S(0),R", "P(max),R", "P(max)"), ("_S(0,2),R", "P,R", "_S(0,2)")]:
    r = redistribute("2x2", "7,5", src, dst)
    err = r.stderr.strip().splitlines()
    check(r.returncode == 2 and r.stdout == "" and len(err) == 1 and needle in err[0],
          f"rejected {src}->{dst}: rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}")

# --- Every dtype, with Partial sources of every op (values exact in the dtype). ---
for dtype in ["f32", "f64", "bf16", "f16", "i32", "i64", "u8"]:
    for src in ["P,P", "P(avg),P", "P(min),S(1)", "P(max),P(max)", "P(prod),R", "_S(0,2),P"]:
        for dst in ["R,R", "S(1),S(0)"]:
            check_ok(redistribute("2x3", "11,7", src, dst, "--dtype", dtype), 6, f"{dtype} {src}->{dst}")
    check_ok(redistribute("2x2x2", "40,30", "P,P,P", "S(0),S(1),R", "--dtype", dtype), 8, f"{dtype} 8-way sum")
    check_ok(redistribute("2x2x2", "40,30", "P(avg),P(avg),P(avg)", "R,S(0),R", "--dtype", dtype), 8, f"{dtype} 8-way avg")

# --- Meshes: explicit rank arrays (lines in rank order), names, 1-D and 3-D. ---
r = redistribute("[[0,2],[1,3]]", "8,6", "S(0),S(1)", "S(1),R", "--names", "dp,tp")
check_ok(r, 4, "explicit mesh")
r = redistribute("[[3,1,2],[0,5,4]]", "7,9,2", "_S(1,2),S(1)", "S(0),_S(1,3)")
check_ok(r, 6, "explicit 2x3 mesh with strided shards")
check_ok(redistribute("3x2", "7,2", "_S(0,2),S(0)", "R,R"), 6, "uneven strided, first mesh dim 3")

# --- Invalid input: exit 2, nothing on stdout, one line on stderr naming the bad value. ---
bad = [
    (["--mesh", "2y2", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)"], "'2y2'"),
    (["--mesh", "2x2", "--shape", "7,-5", "--from", "S(0),R", "--to", "R,S(1)"], "'-5'"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0)", "--to", "R,S(1)"], "1 placements"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(2)"], "shard dim 2"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "X(0),R", "--to", "R,S(1)"], "'X(0)'"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0),R", "--to", "R,_S(1,0)"], "split factor 0"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "P(max),P(sum)", "--to", "R,R"], "mix Partial ops"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)", "--dtype", "f8e4m3"], "'f8e4m3'"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)", "--dtype", "float"], "'float'"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)", "--backend", "gloo"], "'gloo'"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)", "--planner", "dijkstra"], "'dijkstra'"),
    (["--mesh", "2x2", "--names", "dp", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)"], "1 mesh dim names"),
    (["--mesh", "[[0,1],[2,5]]", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)"], "ranks 0..3"),
    (["--mesh", "[[0,1],[1,2]]", "--shape", "7,5", "--from", "S(0),R", "--to", "R,S(1)"], "rank 1 appears more than once"),
    (["--mesh", "2x2", "--shape", "7,5", "--from", "S(0),R"], "--to"),
]
for args, needle in bad:
    r = run("redistribute", *args)
    err = r.stderr.strip().splitlines()
    check(r.returncode == 2 and r.stdout == "" and len(err) == 1 and needle in err[0],
          f"invalid {args}: rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r} (want '{needle}')")

# nccl: one GPU per mesh rank; without them a clean refusal.
r = redistribute("2x2", "7,5", "S(0),R", "R,S(1)", "--backend", "nccl")
err = r.stderr.strip().splitlines()
if r.returncode == 2:
    check(r.stdout == "" and len(err) == 1 and re.search(r"nccl backend needs 4 GPUs, found \d+", err[0]) or
          (len(err) == 1 and "nccl" in err[0] and "not built" in err[0]), f"nccl refusal: {r}")
else:
    check_ok(r, 4, "nccl backend on GPUs")
# mpi outside mpirun: a 1-process world (or no mpi in the build): a 2x2 mesh does not fit.
r = redistribute("2x2", "7,5", "S(0),R", "R,S(1)", "--backend", "mpi")
err = r.stderr.strip().splitlines()
check(r.returncode == 2 and r.stdout == "" and len(err) == 1 and ("outside the mpi world" in err[0] or "MPI" in err[0]),
      f"mpi without mpirun: {r}")

# RaggedShard (NOTE [ragged plans]): every rank checked on the flattened view; refusals name both.
ragged_ok = 0
for src, dst, shapes in [("Rg(0,[1,2,0,1],4)", "R", [[9, 4]] * 4),
                         ("S(0)", "Rg(0,[1,2,0,1],1)", [[9], [18], [0], [9]]),
                         ("P", "Rg(0,[0,3,1,1],2)", [[0], [20], [8], [8]])]:
    plan = check_ok(redistribute("4", "9,4", src, dst, "--dtype", "bf16"), 4, f"ragged {src} -> {dst}",
                    collectives=1, shapes=shapes)
    ragged_ok += plan is not None
check(ragged_ok == 3, f"{ragged_ok} ragged redistributes ran, expected 3")
# HSDP on (dp_replicate 2, dp_shard 2): the gradient reduce is a reduce-scatter + an all-reduce.
plan = check_ok(redistribute("2x2", "9,4", "P,P", "R,Rg(0,[1,2],2)", "--dtype", "bf16"), 4, "ragged HSDP reduce",
                collectives=2, shapes=[[12], [24], [12], [24]])
check(plan is not None and plan["plan"].endswith("-AR(0,sum)-> [R,Rg(0,[1,2],2)]"), f"ragged HSDP plan {plan}")
for src, dst, needle in [("Rg(0,[1,1,1,1],1)", "P", "never becomes Partial"),
                         ("Rg(0,[1,1,1,1],1)", "S(1)", "[Rg(0,[1,1,1,1],1)] -> [S(1)]")]:
    r = redistribute("4", "8,4", src, dst)
    err = r.stderr.strip().splitlines()
    check(r.returncode == 2 and r.stdout == "" and len(err) == 1 and needle in err[0], f"ragged refusal {src} -> {dst}: {r}")

# --- fuzz: the summary line, exit status and reproducers. ---
r = run("fuzz", "--cases", "60", "--seed", "3")
lines = r.stdout.splitlines()
m = re.match(r"^fuzz: (\d+) cases, (\d+) passed, (\d+) failed$", lines[-1] if lines else "")
check(m is not None and int(m.group(1)) == 60 and int(m.group(2)) + int(m.group(3)) == 60,
      f"fuzz summary: {r.stdout!r}")
if m:
    check(r.returncode == (0 if int(m.group(3)) == 0 else 1), f"fuzz exit status {r.returncode}: {lines[-1]}")
    if int(m.group(3)):
        check("dtensor-check redistribute --mesh" in r.stdout, f"fuzz reproducer: {r.stdout!r}")
r2 = run("fuzz", "--cases", "60", "--seed", "3")
check(r2.stdout.splitlines()[1:] == lines[1:], "fuzz is deterministic for a seed")
for args, needle in [(["--planner", "best"], "'best'"), (["--backend", "nccl"], "'nccl'"),
                     (["--cases", "-1"], "-1"), (["--max-ranks", "0"], "0")]:
    r = run("fuzz", *args)
    err = r.stderr.strip().splitlines()
    check(r.returncode == 2 and r.stdout == "" and len(err) == 1 and needle in err[0], f"fuzz {args}: {r}")

# The layout subcommand is unchanged.
r = run("layout", "--mesh", "4", "--shape", "9", "--placements", "S(0)")
check(r.returncode == 0 and len(r.stdout.splitlines()) == 4, f"layout still works: {r}")

for f in failures:
    print("FAIL:", f)
print(f"redistribute_cli_test: {len(failures)} failures")
sys.exit(1 if failures else 0)
