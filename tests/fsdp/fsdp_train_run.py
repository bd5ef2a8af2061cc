"""Runs fsdp-train for the Python tests beside it (fsdp_train_layout_test.py,
fsdp_train_reduce_wire_test.py) and reads what it prints: the progress lines, matched against the
test's pattern, and the last line's JSON summary. Failures are collected, never raised, so one
run reports every check; finish() lists them (exit 1) or prints the test's summary line.

The tests import it as a sibling module: meson runs them as `python3 <source dir>/x_test.py`, and
Python puts the script's directory first on sys.path.

Example:
    t = FsdpTrain(sys.argv[1], ["--dim", "32", "--log-every", "1"], re.compile(r"^step (\\d+)/\\d+ loss (\\S+)"))
    r = t.run("--dp-shard", "4", steps=5)   # checks exit 0 and 5 progress lines matching the pattern
    t.check(r.last.get("parity") == "ok", "parity")
    t.finish(f"ok: {t.runs} runs")         # exits 1 naming each failure, else prints the line
"""
import json
import subprocess
import sys
from typing import NamedTuple


class Run(NamedTuple):
    returncode: int
    stderr: str
    last: dict  # the last line's JSON ({} without output)
    steps: list  # one re.Match per progress line ("step ..."), None where the pattern failed


class FsdpTrain:
    def __init__(self, exe, model, step_pattern, timeout=280):
        self.exe, self.model, self.step, self.timeout = exe, list(model), step_pattern, timeout
        self.failures = []
        self.runs = 0

    def check(self, ok, what):
        if not ok:
            self.failures.append(what)

    def run(self, *args, steps, progress=None):
        """fsdp-train MODEL --steps steps ARGS; checks exit 0 and `progress` (default: steps)
        progress lines, all matching the pattern."""
        self.runs += 1
        r = subprocess.run([self.exe, *self.model, "--steps", str(steps), *args], capture_output=True, text=True,
                           timeout=self.timeout)
        lines = r.stdout.strip().splitlines()
        matched = [self.step.match(line) for line in lines if line.startswith("step ")]
        self.check(r.returncode == 0, f"{args}: exit {r.returncode}: {r.stderr.strip()}")
        expected = steps if progress is None else progress
        self.check(len(matched) == expected and all(matched), f"{args}: progress lines {lines[:1]}")
        return Run(r.returncode, r.stderr, json.loads(lines[-1]) if lines else {}, matched)

    def finish(self, summary):
        if self.failures:
            for f in self.failures:
                print("FAIL:", f)
            sys.exit(1)
        print(summary)
