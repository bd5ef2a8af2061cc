#!/usr/bin/env python3
"""Every reference into bench/results/ and bench/figures/ names a file or folder that exists.

Scans the sources and documents of the tree (not the raw outputs under bench/results, whose
recorded command lines name paths of the machine they ran on) for `bench/results/...` and
`bench/figures/...`, and bench/*.md also for the relative `results/...` and `figures/...`.
Brace lists (`host{2,4}_batch_*.txt`) and globs are expanded; each must match something.
Usage: results_refs_test.py SOURCE_ROOT"""
import glob
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
suffixes = {".md", ".py", ".cpp", ".h", ".cu", ".cuh", ".sh", ".build", ".txt", ".cmake", ".in"}
skip_dirs = {".git", "bench/results"}
path_chars = r"[A-Za-z0-9_.{},*/\-]+"
prefixed = re.compile(r"(?<![\w/.-])bench/(?:results|figures)/" + path_chars)
relative = re.compile(r"(?<![\w/.-])(?:results|figures)/" + path_chars)


def expand(pattern):
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    out = []
    for alt in m.group(1).split(","):
        out += expand(pattern[:m.start()] + alt + pattern[m.end():])
    return out


def sources():
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if any(rel == d or rel.startswith(d + "/") for d in skip_dirs):
            continue
        if rel.startswith("build") or "/." in "/" + rel:
            continue
        if path.is_file() and (path.suffix in suffixes or path.name == "meson.build"):
            yield path, rel


failures = []
checked = 0
for path, rel in sources():
    text = path.read_text(errors="replace")
    found = [(m.group(0), root) for m in prefixed.finditer(text)]
    if rel.startswith("bench/") and rel.count("/") == 1 and path.suffix == ".md":
        found += [(m.group(0), root / "bench") for m in relative.finditer(text)]
    for ref, base in found:
        ref = ref.rstrip(".,")
        for pattern in expand(ref):
            checked += 1
            if not glob.glob(str(base / pattern)):
                failures.append(f"{rel}: {ref} ({pattern} matches nothing)")
for f in failures:
    print("FAIL:", f)
print(f"results_refs_test: {checked} references checked, {len(failures)} failures")
# The tree cites its results in many places: finding none means the scan itself is broken.
if checked < 20:
    print(f"FAIL: only {checked} references found; expected the RESULTS.md and README citations")
    sys.exit(1)
sys.exit(1 if failures else 0)
