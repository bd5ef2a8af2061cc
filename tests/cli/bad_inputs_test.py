#!/usr/bin/env python3
"""Runs every bad input of bad_inputs.txt against its program and checks the promise of the
exit-status contract (program/main.h): the documented status, exactly one line on stderr that
names the value (the case's needle), no signal, and an end within --case-timeout seconds (a hang
fails the case). The last line is 'summary: N passed, N failed' (tools/test_summary.py counts it).

  bad_inputs_test.py --program dtensor-check=build/tools/dtensor-check --program ... \\
                     [--cases bad_inputs.txt] [--case-timeout S] [--jobs 2] [--rlimit-gib 8]

--rlimit-gib caps each process's address space so a case that would allocate without checking
fails fast instead of taking the machine's memory (0: no cap). Under a sanitizer (ASAN_OPTIONS
set, tools/sanitizers.sh) there is no cap: ASan reserves terabytes of address space, and its
allocator_may_return_null makes an impossible allocation fail cleanly instead."""
import os
import argparse
import concurrent.futures
import pathlib
import resource
import shlex
import subprocess
import sys
import time

from sanitizer_env import child_env

ap = argparse.ArgumentParser()
ap.add_argument("--program", action="append", default=[], help="NAME=PATH")
ap.add_argument("--cases", default=str(pathlib.Path(__file__).with_name("bad_inputs.txt")))
ap.add_argument("--case-timeout", type=float, default=None,
                help="seconds; default 60, 240 under a sanitizer (up to 20x slower)")
ap.add_argument("--jobs", type=int, default=2)
ap.add_argument("--rlimit-gib", type=float, default=8)
args = ap.parse_args()
programs = dict(p.split("=", 1) for p in args.program)
sanitized = any(os.environ.get(v) for v in ("ASAN_OPTIONS", "TSAN_OPTIONS", "UBSAN_OPTIONS"))
if args.case_timeout is None:
    args.case_timeout = 240.0 if sanitized else 60.0


def expand(token):
    if token.startswith("@rep:"):
        _, n, text = token.split(":", 2)
        return text * int(n)
    if "@rep:" in token:  # inside a larger token: prefix@rep:N:TEXTsuffix with TEXT up to ']'
        head, rest = token.split("@rep:", 1)
        n, rest = rest.split(":", 1)
        text, tail = rest[:-1], rest[-1:]
        return head + text * int(n) + tail
    return token


cases = []
left_out = 0  # cases marked "unsanitized" when running under a sanitizer
for lineno, line in enumerate(pathlib.Path(args.cases).read_text().splitlines(), 1):
    if not line.strip() or line.lstrip().startswith("#"):
        continue
    status, needle, command = (part.strip() for part in line.split(" | ", 2))
    status, *marks = status.split()
    if marks not in ([], ["unsanitized"]):
        sys.exit(f"bad_inputs_test: line {lineno}: status {' '.join([status] + marks)!r}: expected N or 'N unsanitized'")
    if marks and sanitized:
        left_out += 1
        continue
    argv = [expand(t) for t in shlex.split(command)]
    cases.append((lineno, int(status), [n.strip() for n in needle.split(" || ")], argv))

missing = sorted({argv[0] for _, _, _, argv in cases} - programs.keys())
if missing:
    sys.exit(f"bad_inputs_test: no --program given for {', '.join(missing)}")


def limit():
    if args.rlimit_gib > 0 and "ASAN_OPTIONS" not in os.environ:
        cap = int(args.rlimit_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


took_by_line = {}


def run(case):
    lineno, want, needles, argv = case
    cmd = [programs[argv[0]]] + argv[1:]
    shown = " ".join(shlex.quote(a if len(a) < 60 else a[:40] + f"...({len(a)} chars)") for a in argv)
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=args.case_timeout,
                           preexec_fn=limit, stdin=subprocess.DEVNULL, env=child_env(argv))
    except subprocess.TimeoutExpired:
        return f"line {lineno}: {shown}: still running after {args.case_timeout:.0f} s (a hang)"
    took = time.monotonic() - start
    took_by_line[lineno] = took
    # ASan's note on an allocation it refused (allocator_may_return_null) is not the program's.
    err = [l for l in r.stderr.strip().splitlines() if "WARNING: AddressSanitizer failed to allocate" not in l]
    problems = []
    if r.returncode < 0:
        problems.append(f"killed by signal {-r.returncode}")
    elif r.returncode != want:
        problems.append(f"exit {r.returncode}, want {want}")
    if len(err) != 1:
        problems.append(f"{len(err)} stderr lines, want 1")
    elif not any(n in err[0] for n in needles):
        problems.append(f"stderr does not name {' or '.join(repr(n) for n in needles)}")
    if err and len(err[0]) > 1000:
        problems.append(f"a {len(err[0])}-character message (long inputs must be cut)")
    if not problems:
        return None
    return f"line {lineno}: {shown}: {'; '.join(problems)} ({took:.1f} s)\n    stderr: {r.stderr.strip()[:600]!r}"


start = time.monotonic()
with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
    results = list(pool.map(run, cases))
failures = [f for f in results if f]
for f in failures:
    print("FAIL", f)
print(f"bad_inputs_test: {len(cases)} cases against {len(programs)} programs in {time.monotonic() - start:.1f} s"
      + (f" ({left_out} 'unsanitized' cases left out: the main tree runs them)" if left_out else ""))
slowest = sorted(took_by_line.items(), key=lambda kv: -kv[1])[:5]
print("slowest: " + ", ".join(f"line {n} {t:.1f} s" for n, t in slowest))
print(f"summary: {len(cases) - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures or len(cases) < 100 else 0)
