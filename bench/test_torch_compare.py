#!/usr/bin/env python3
"""Test of bench/torch_compare.py's `table` path on the fixtures in bench/testdata/ (no torch needed).

Run:  python3 bench/test_torch_compare.py        (from anywhere; exit status 0 = pass)

It runs `torch_compare.py table` as a user would, then checks the console table, the merged JSON
and the Markdown: ratios recomputed from the times, the "ours ratio < torch" column, a transition
without collectives, a transition torch rejected, the host-cost row; the same for the --overlap
comparison (lost and exposed recomputed, the rows the summary counts); and that importing the
module does not import torch.
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_compare.py")
OURS = os.path.join(HERE, "testdata", "torch_compare_ours.json")
TORCH = os.path.join(HERE, "testdata", "torch_compare_torch.json")
OURS_OVERLAP = os.path.join(HERE, "testdata", "torch_compare_ours_overlap.json")
TORCH_OVERLAP = os.path.join(HERE, "testdata", "torch_compare_torch_overlap.json")

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def line_with(text, *needles):
    """The first line of `text` containing every needle, split into whitespace-separated cells."""
    for line in text.splitlines():
        if all(n in line for n in needles):
            return line.split()
    return None


def run_table(ours, torch, what):
    """`torch_compare.py table` on two fixtures: (console text, merged JSON records, Markdown)."""
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, SCRIPT, "table", "--ours", ours, "--torch", torch, "--out", out_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        check(proc.returncode == 0, f"{what} exits 0 (stderr: {proc.stderr.strip()[-300:]})")
        with open(os.path.join(out_dir, "torch_compare.json")) as f:
            merged = json.load(f)
        with open(os.path.join(out_dir, "torch_compare.md")) as f:
            md = f.read()
    return proc.stdout, merged, md


def check_overlap():
    """The --overlap comparison (records of kind "overlap" on both sides)."""
    text, merged, md = run_table(OURS_OVERLAP, TORCH_OVERLAP, "overlap table")
    # S(0)->R 8M (local 4M): torch lost 1220 - 820 = 400 us, exposed 400 / 800 = 0.50; ours 20 us, 0.05.
    row = line_with(text, "8M", "4M", "800.0")
    check(row == ["8M", "4M", "800.0", "300.0", "400.0", "0.50", "400.0", "6.00", "20.0", "0.05", "yes"],
          f"overlap S(0)->R 8M row: {row}")
    # 4M (local 2M): torch 10 us (0.03), ours 30 us (0.30): ours loses more.
    row = line_with(text, "4M", "2M", "400.0")
    check(row == ["4M", "2M", "400.0", "280.0", "10.0", "0.03", "100.0", "4.00", "30.0", "0.30", "no"],
          f"overlap S(0)->R 4M row: {row}")
    row = line_with(text, "8M", "unsupported")
    check(row == ["8M", "8M", "unsupported", "-", "-", "-", "500.0", "8.00", "100.0", "0.20", "-"],
          f"overlap unsupported row: {row}")
    row = line_with(text, "not run")
    check(row == ["8M", "8M", "not", "run", "-", "-", "-", "100.0", "50.0", "2.00", "0.02", "-"],
          f"overlap row torch did not run: {row}")
    # Counted: local >= 4M with a collective (S(0)->R 8M, P->S(0) 8M; not the 2M row, not R->S(0)).
    check("within exposed 0.10: ours 1 of 2, torch 0 of 1; ours loses no more time than torch on 1 of 1" in text,
          "overlap summary line")
    check("ratio = redistribute time" not in text, "no transition-ratio legend without transition rows")
    by_key = {(r["transition"], r["bytes"]): r for r in merged}
    check(len(merged) == 4 and all(r["kind"] == "overlap" for r in merged), f"4 overlap records (got {len(merged)})")
    big = by_key.get(("S(0)->R", 8388608), {})
    check(abs(big.get("torch_exposed", 0) - 0.5) < 1e-12 and abs(big.get("ours_exposed", 0) - 0.05) < 1e-12
          and big.get("counted") is True and big.get("ours_better") is True, f"merged S(0)->R 8M: {big}")
    small = by_key.get(("S(0)->R", 4194304), {})
    check(small.get("counted") is False and small.get("ours_better") is False, "merged S(0)->R 4M not counted")
    check(by_key.get(("R->S(0)", 8388608), {}).get("counted") is False, "a transition without collectives not counted")
    check("| `S(0)->R` | 2 | 8M | 4M | 800.0 | 300.0 | 400.0 | 0.50 | 400.0 | 6.00 | 20.0 | 0.05 | yes |" in md,
          "overlap markdown row")
    check("| transition | mesh | bytes | shape | torch us |" not in md, "no empty transition table in the markdown")


def main():
    text, merged, md = run_table(OURS, TORCH, "table")

    # Console: S(0)->R 1K: torch 300/100 = 3.00, ours 20/10 = 2.00 -> yes.
    row = line_with(text, "1K", "16x16", "300.0")
    check(row == ["1K", "16x16", "300.0", "100.0", "3.00", "20.0", "10.0", "2.00", "yes"],
          f"S(0)->R 1K row: {row}")
    # S(0)->R 1M: torch 2200/2000 = 1.10, ours 1200/1000 = 1.20 -> no.
    row = line_with(text, "1M", "512x512")
    check(row == ["1M", "512x512", "2200.0", "2000.0", "1.10", "1200.0", "1000.0", "1.20", "no"],
          f"S(0)->R 1M row: {row}")
    # R->S(0): no collective on either side, so no ratio and no verdict.
    row = line_with(text, "1K", "45.0")
    check(row == ["1K", "16x16", "45.0", "-", "-", "3.00", "-", "-", "-"], f"R->S(0) row: {row}")
    check("torch issues: no collective" in text, "R->S(0): torch issues no collective")
    # The 2-D transition torch rejected: shown as unsupported, with torch's message.
    row = line_with(text, "unsupported")
    check(row == ["1K", "16x16", "unsupported", "-", "-", "50.0", "40.0", "1.25", "-"], f"unsupported row: {row}")
    check("NotImplementedError: synthetic rejection for the test" in text, "unsupported note printed")
    # Host cost: torch 30 us, ours 1.5 us -> 20.00.
    row = line_with(text, "S(0)->R", "4x4", "30.0")
    check(row is not None and row[3:6] == ["30.0", "1.50", "20.00"] and row[6:] == ["no", "collective"],
          f"host row: {row}")
    check("ours ratio < torch ratio on 1 of 2 comparable rows" in text, "summary line counts 1 of 2")

    # Merged JSON: one record per (transition, mesh, bytes) plus the host record.
    by_key = {(r["kind"], r["transition"], r["bytes"]): r for r in merged}
    check(len(merged) == 5, f"merged JSON has 5 records (got {len(merged)})")
    small = by_key.get(("transition", "S(0)->R", 1024), {})
    check(abs(small.get("ours_overhead", 0) - 2.0) < 1e-12 and abs(small.get("torch_overhead", 0) - 3.0) < 1e-12,
          "S(0)->R 1K overheads 2.0 and 3.0")
    check(small.get("ours_better") is True, "S(0)->R 1K ours_better")
    big = by_key.get(("transition", "S(0)->R", 1048576), {})
    check(abs(big.get("ours_overhead", 0) - 1.2) < 1e-12 and abs(big.get("torch_overhead", 0) - 1.1) < 1e-12,
          "S(0)->R 1M overheads 1.2 and 1.1")
    check(big.get("ours_better") is False, "S(0)->R 1M not ours_better")
    rejected = by_key.get(("transition", "S(0),S(1)->S(1),S(0)", 1024), {})
    check(rejected.get("torch_supported") is False and rejected.get("torch_time_us") is None
          and "NotImplementedError" in rejected.get("note", ""), "rejected transition recorded as unsupported")
    for field in ("transition", "mesh", "bytes", "shape", "torch_time_us", "torch_raw_time_us", "torch_overhead",
                  "ours_time_us", "ours_raw_time_us", "ours_overhead", "ours_backend", "torch_version",
                  "torch_supported", "note"):
        check(all(field in r for r in merged if r["kind"] == "transition"), f"every merged record has {field}")
    check(small.get("ours_backend") == "mpi" and small.get("torch_version") == "2.15.0", "backend and version")

    # Markdown.
    check("| transition | mesh | bytes | shape | torch us |" in md, "markdown header")
    check("| `S(0)->R` | 4 | 1K | 16x16 | 300.0 | 100.0 | 3.00 | 20.0 | 10.0 | 2.00 | yes |" in md,
          "markdown S(0)->R 1K")
    check("| `S(0),S(1)->S(1),S(0)` | 2x2 | 1K | 16x16 | unsupported | - | - | 50.0 | 40.0 | 1.25 | - |" in md,
          "markdown unsupported row")
    check("| `S(0)->R` | 1 | 4x4 | 30.0 | 1.50 | 20.00 |" in md, "markdown host row")

    check_overlap()

    # The table path must not need torch.
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import torch_compare; "
             "sys.exit(1 if 'torch' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", probe, HERE])
    check(proc.returncode == 0, "importing torch_compare does not import torch")

    print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
