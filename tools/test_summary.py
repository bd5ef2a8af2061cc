#!/usr/bin/env python3
"""Prints the closing line CI reads, 'N passed, N failed', from meson's testlog.json files.

A Catch2 executable counts as its number of test cases (from its own summary line); a test whose
output ends with a line 'summary: N passed, N failed' (the bad-input runner, the sanitizer and
fuzz wrappers) counts as those cases; any other test counts as one. A test that crashed or timed
out before its summary counts as one failure.
A test that reported itself skipped (exit status 77: the [gpu] programs without a GPU) counts as
neither passed nor failed: the number skipped, and their names, are printed on lines before the
closing line, which stays the last line."""
import json
import pathlib
import re
import sys

passed = failed = 0
skipped = []
for build in sys.argv[1:]:
    # testlog.json, or testlog-<setup>.json and those of further runs (--setup, --logbase).
    logs = sorted((pathlib.Path(build) / "meson-logs").glob("testlog*.json"))
    if not logs:
        print(f"test_summary: no {build}/meson-logs/testlog*.json")
        failed += 1
        continue
    lines = []
    for log in logs:
        lines += log.read_text().splitlines()
    for line in lines:
        t = json.loads(line)
        if t["result"] == "SKIP":
            skipped.append(f"{build}: {t['name']}")
            continue
        ok = t["result"] in ("OK", "EXPECTEDFAIL")
        out = t.get("stdout") or ""
        m = re.search(r"All tests passed \(\d+ assertions? in (\d+) test cases?\)", out)
        f = re.search(r"test cases:\s*(\d+)(?:\s*\|\s*(\d+) passed)?(?:\s*\|\s*(\d+) failed)?", out)
        c = re.findall(r"^summary: (\d+) passed, (\d+) failed$", out, re.M)
        if c:
            p, f_ = (int(x) for x in c[-1])
            passed += p
            failed += max(f_, 0 if ok else 1)
            if f_ or not ok:
                print(f"test_summary: {build}: {t['name']} {t['result']}")
        elif m and ok:
            passed += int(m.group(1))
        elif f:
            passed += int(f.group(2) or 0)
            failed += max(int(f.group(3) or 0), 0 if ok else 1)
        elif ok:
            passed += 1
        else:
            failed += 1
            print(f"test_summary: {build}: {t['name']} {t['result']}")
if skipped:
    print(f"test_summary: skipped: {', '.join(skipped)}")
print(f"{len(skipped)} skipped")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
