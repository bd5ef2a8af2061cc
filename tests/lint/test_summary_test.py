#!/usr/bin/env python3
"""tools/test_summary.py on synthetic meson logs: Catch2 programs count their test cases, a
skipped program (exit 77) counts as neither passed nor failed and is reported on a line of its
own before the closing line, which stays 'N passed, N failed' and the last line; a failure makes
the exit status non-zero."""
import json
import pathlib
import subprocess
import sys
import tempfile

script = pathlib.Path(sys.argv[1])
failures = []


def check(ok, what):
    print(("ok:   " if ok else "FAIL: ") + what)
    if not ok:
        failures.append(what)


def summarize(entries):
    with tempfile.TemporaryDirectory() as tmp:
        logs = pathlib.Path(tmp) / "build" / "meson-logs"
        logs.mkdir(parents=True)
        (logs / "testlog.json").write_text("\n".join(json.dumps(e) for e in entries) + "\n")
        proc = subprocess.run([sys.executable, str(script), str(pathlib.Path(tmp) / "build")],
                              capture_output=True, text=True)
        return proc.returncode, proc.stdout.strip().splitlines()


catch_ok = "===\nAll tests passed (12 assertions in 3 test cases)\n"
rc, lines = summarize([
    {"name": "kernels", "result": "OK", "stdout": catch_ok},
    {"name": "kernels-gpu", "result": "SKIP", "stdout": "skipped: no usable GPU\n"},
    {"name": "lint", "result": "OK", "stdout": "0 failures\n"},
])
check(rc == 0, f"all passed or skipped: exit 0 (got {rc})")
check(lines[-1] == "4 passed, 0 failed", f"closing line '{lines[-1]}' (3 Catch2 cases + 1 test; the skip not counted)")
check(lines[-2] == "1 skipped", f"the skip count on the line before: '{lines[-2]}'")
check(any("kernels-gpu" in l for l in lines[:-1]), "the skipped test is named")

rc, lines = summarize([
    {"name": "dtensor", "result": "FAIL", "stdout": "test cases: 5 | 4 passed | 1 failed\n"},
    {"name": "crash", "result": "TIMEOUT", "stdout": ""},
    {"name": "kernels-gpu", "result": "SKIP", "stdout": ""},
    {"name": "collectives-nccl-gpu", "result": "SKIP", "stdout": ""},
])
check(rc == 1, f"a failure: exit 1 (got {rc})")
check(lines[-1] == "4 passed, 2 failed", f"closing line '{lines[-1]}'")
check(lines[-2] == "2 skipped", f"skip count '{lines[-2]}'")

rc, lines = summarize([{"name": "a", "result": "OK", "stdout": catch_ok}])
check(lines[-2:] == ["0 skipped", "3 passed, 0 failed"], f"no skip: '{lines[-2:]}'")

print(f"{len(failures)} failures")
sys.exit(1 if failures else 0)
