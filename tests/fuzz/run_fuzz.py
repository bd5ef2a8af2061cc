#!/usr/bin/env python3
"""Runs a libFuzzer target for a bounded time: first every seed of the committed corpus (a
regression run), then mutations for --seconds. New inputs go to a corpus directory next to the
binary (never into the source tree), findings to its artifacts directory; any finding, crash,
sanitizer report, leak, per-input timeout or out-of-memory fails the test.

  run_fuzz.py BUILD/tests/fuzz/layout_fuzz tests/fuzz/corpus --seconds 30"""
import argparse
import pathlib
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("binary")
ap.add_argument("seeds")
ap.add_argument("--seconds", type=int, default=30)
args = ap.parse_args()
binary = pathlib.Path(args.binary)
work = binary.parent / f"{binary.name}_work"
corpus, artifacts = work / "corpus", work / "artifacts"
corpus.mkdir(parents=True, exist_ok=True)
artifacts.mkdir(parents=True, exist_ok=True)
seeds = sorted(pathlib.Path(args.seeds).iterdir())
if len(seeds) < 10:
    sys.exit(f"run_fuzz: only {len(seeds)} seeds in {args.seeds}")
cmd = [str(binary), str(corpus), args.seeds,
       f"-max_total_time={args.seconds}", "-timeout=20", "-rss_limit_mb=2048", "-max_len=512",
       f"-dict={pathlib.Path(args.seeds).parent / 'layout_fuzz.dict'}",
       f"-artifact_prefix={artifacts}/", "-print_final_stats=1"]
print("run_fuzz:", " ".join(cmd), flush=True)
r = subprocess.run(cmd, env={"ASAN_OPTIONS": "detect_leaks=1:allocator_may_return_null=1",
                             "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"})
found = sorted(artifacts.iterdir())
for f in found:
    print(f"run_fuzz: finding {f} ({f.stat().st_size} bytes): {f.read_bytes()[:300]!r}")
ok = r.returncode == 0 and not found
print(f"run_fuzz: {len(seeds)} seeds, {args.seconds} s of mutations: {'ok' if ok else 'FAILED'} (exit {r.returncode})")
sys.exit(0 if ok else 1)
