#!/usr/bin/env python3
"""Side-by-side comparison of this runtime's redistribute with PyTorch DTensor's.

Both runtimes move the same global tensors through the same placement transitions on the same
meshes. Their engines differ (ours: OpenMPI or the thread-based local backend; torch: gloo on
CPU), so raw speed is not compared directly. What is compared is the *framework overhead*: for
each runtime, the time of a redistribute divided by the time of the bare collectives that the
redistribute needs, run by the same engine on preallocated buffers (the "raw" time):

    ratio = redistribute time / raw-collective time      (1.00 = no overhead; lower is better)

The raw collectives are the `raw_ops` that `dtensor-bench` records for each plan (op, mesh dim,
bytes in and out per rank); torch runs the very same sequence with torch.distributed on the
process group of that mesh dim. A second comparison measures the host-side cost of one
redistribute call on a tiny tensor on a mesh of one rank (plan cached, no data to move).

Usage (from the repository root; `python` must have torch for `run` and `torch`):

    # the whole comparison: ours first (its JSON fixes the transitions and the tensor shapes),
    # then torch (4 processes, gloo), then the host cost of both; prints one table per transition
    python bench/torch_compare.py run --sizes 1K:16M --ours-backend mpi --out build/torch_compare

    # only the torch side, for records of ours saved earlier
    python bench/torch_compare.py torch --ours OURS.json OURS_HOST.json --out TORCH.json

    # re-print the comparison from saved files (no torch needed)
    python bench/torch_compare.py table --ours OURS.json OURS_HOST.json --torch TORCH.json

    # overlap instead: dtensor-bench --overlap, then torch's redistribute(async_op=True) the same way
    python bench/torch_compare.py run --overlap --sizes 4M:32M --ours-backend local --np 2 --out OUT

`run` writes into --out: ours.json and ours_host.json (dtensor-bench --json; its console tables
in ours.txt), torch.json (the torch side, same record layout), torch_compare.json (the merged
records), torch_compare.md (Markdown tables ready to paste into bench/RESULTS.md) and, under
torch_work/, the torch workers' plans, results and logs.

Getting torch: any Python with torch (CPU is enough) and numpy works, e.g.

    python3 -m venv V && V/bin/pip install torch numpy
    V/bin/python bench/torch_compare.py run ...

or reuse tests/conformance/.venv, which tests/conformance/gen_layout_vectors.py creates. The
orchestrating Python need not have torch if --torch-python names one that has:

    python3 bench/torch_compare.py run --torch-python tests/conformance/.venv/bin/python ...

How torch is measured (mirrors dtensor-bench, see bench/README.md):
  * N processes (--np, default 4), gloo backend on 127.0.0.1, one intra-op thread each,
    init_device_mesh("cpu", mesh_shape) with the mesh shape of our record;
  * the source DTensor holds the same global shape and dtype as ours. A Partial source is built
    with DTensor.from_local of a full-size local per rank whose reduction is the global tensor;
    _S(d,sf) is torch's _StridedShard(d, split_factor=sf);
  * once per case, before timing: the redistribute runs under CommDebugMode (the collectives
    torch issues are recorded) and full_tensor() of its result must equal the source's full
    tensor, so a wrong path is never timed; a transition torch rejects is recorded as
    unsupported with torch's message;
  * per iteration: barrier, then the timed call (redistribute, including the wait on an async
    collective result); the per-iteration times are reduced with all_reduce(MAX) over the ranks
    once, after the loop; median, min and max over the iterations (the same warm-up and
    iteration counts as our record, unless --torch-iters / --torch-warmup);
  * raw: our record's raw_ops run back to back with all_gather_into_tensor, reduce_scatter_tensor,
    all_reduce (in place: torch has no out-of-place all_reduce) and all_to_all_single on
    buffers allocated once, on mesh.get_group(mesh_dim);
  * host cost: one process, a mesh of ones (1 or 1x1, as our host record), the tiny tensor of
    our one-rank host records (`--host-cost --world 1`: 8x4 f32 S(0)->R; the records of larger
    worlds have no torch counterpart and are left out); per call = the time of `calls`
    consecutive redistributes / calls,
    after one untimed batch; median, min and max over the repeats. `calls` and the repeats are
    those of our record unless --host-calls / --host-repeats say otherwise (2000 and 20 if
    neither does).
  * overlap (`run --overlap`): ours is `dtensor-bench --overlap`; torch repeats its procedure
    (bench/README.md, "Overlap") with `redistribute(..., async_op=True)` and a wait on the result's
    local tensor: the transition back to back (the first guess of the compute's length), after
    idle spells of that length, then `iters` times the compute stand-in alone (a sleep of the
    median of the latest `iters` after-idle transitions, max over ranks), the transition alone and
    both (issue, sleep, wait), each after a barrier; the sleeps run with a timer slack of 1 ns as
    ours do; exposed = (overlapped - compute) / comm on medians, max over ranks. Python's host
    cost and gloo's threads are what a torch user overlaps with, so they count, as ours do.

Nothing in this module imports torch at import time: the torch worker imports it lazily, so the
`table` path (and bench/test_torch_compare.py) run with a plain python3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_BENCH = os.path.join(REPO, "build", "bench", "dtensor-bench")
DEFAULT_OUT = os.path.join(REPO, "build", "torch_compare")

DTYPE_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "u8": 1}

# Used for the host-cost comparison when no host records of ours are available.
DEFAULT_HOST_CASES = [
    {"transition": "S(0)->R", "shape": [4, 4]},
    {"transition": "R->S(0)", "shape": [4, 4]},
    {"transition": "P->R", "shape": [4, 4]},
]


# ================================================================================================
# Shared helpers (no torch)
# ================================================================================================


def fmt_bytes(n):
    """1024 -> '1K', 3 * 2**20 -> '3M', 1000 -> '1000'."""
    if n is None:
        return "-"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def fmt_us(x):
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}"


def fmt_shape(shape):
    return "-" if shape is None else "x".join(str(s) for s in shape)


def ratio(num, den):
    """num / den, or None when either is missing or den is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def split_transition(transition):
    """'S(0),R->R,S(0)' -> ('S(0),R', 'R,S(0)')."""
    src, sep, dst = transition.partition("->")
    if not sep:
        raise ValueError(f"bad transition {transition!r} (expected SRC->DST)")
    return src.strip(), dst.strip()


def load_records(paths):
    """Concatenate the JSON record lists of several files (a lone object counts as a list of one)."""
    records = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict):
            data = data.get("records", [data])
        records.extend(data)
    return records


def record_kind(rec):
    return rec.get("kind", "transition")


def transition_key(rec):
    return (rec["transition"], str(rec.get("mesh")), int(rec["bytes"]))


def host_key(rec):
    return (rec["transition"], str(rec.get("mesh", "1")), fmt_shape(rec.get("shape")))


# One placement of a comma-separated list, and the comma after it (if any).
_PLACEMENT_RE = re.compile(r"""\s*(?:
      _S\((?P<sdim>-?\d+),\s*(?P<sf>\d+)\)   # _S(d,sf): StridedShard
    | S\((?P<dim>-?\d+)\)                     # S(d): Shard
    | (?P<rep>R)                               # Replicate
    | P(?:\((?P<op>\w+)\))?                   # P or P(op): Partial, sum by default
    )\s*(?:,|$)""", re.VERBOSE)


def parse_placements(text):
    """'S(0),_S(1,2),R,P(max)' -> [('S', 0), ('_S', 1, 2), ('R',), ('P', 'max')]."""
    out, pos = [], 0
    while pos < len(text):
        m = _PLACEMENT_RE.match(text, pos)
        if not m:
            raise ValueError(f"bad placement list {text!r} at {text[pos:]!r}")
        if m.group("sdim") is not None:
            out.append(("_S", int(m.group("sdim")), int(m.group("sf"))))
        elif m.group("dim") is not None:
            out.append(("S", int(m.group("dim"))))
        elif m.group("rep"):
            out.append(("R",))
        else:
            out.append(("P", m.group("op") or "sum"))
        pos = m.end()
    return out


def mesh_shape_of(mesh):
    """'2x2' -> [2, 2], '4' -> [4]."""
    return [int(d) for d in str(mesh).split("x")]


# ================================================================================================
# Merge and render (no torch)
# ================================================================================================


def _pair_notes(o, t):
    """The notes of one paired row: a side that did not run, torch's own note, ours' wrong elements."""
    notes = []
    if not t:
        notes.append("torch: not run")
    elif t.get("note"):
        notes.append("torch: " + t["note"])
    if not o:
        notes.append("ours: not run")
    elif o.get("wrong"):
        notes.append(f"ours: {o['wrong']} wrong elements")
    return notes


def merge(ours_records, torch_records):
    """Pair ours and torch's records; returns (transition rows, host rows), each a list of dicts.

    Transition rows are keyed by (transition, mesh, bytes) and keep ours' order (torch-only rows
    come after). Ratios are recomputed from the times, so both sides use the same definition;
    *_overhead_min (fastest redistribute / fastest raw) is kept in the JSON for noisy machines.
    """
    ours_t = {transition_key(r): r for r in ours_records if record_kind(r) == "transition"}
    torch_t = {transition_key(r): r for r in torch_records if record_kind(r) == "transition"}
    # Host cost: torch runs on one process, so only our one-rank records (--host-cost --world 1)
    # have a counterpart.
    ours_h = {host_key(r): r for r in ours_records if record_kind(r) == "host" and int(r.get("world", 1)) == 1}
    torch_h = {host_key(r): r for r in torch_records if record_kind(r) == "host"}

    torch_version = next((r.get("torch_version") for r in torch_records if r.get("torch_version")), None)
    ours_backend = next((r.get("backend") for r in ours_records if record_kind(r) == "transition"), None)

    rows = []
    for key in list(ours_t) + [k for k in torch_t if k not in ours_t]:
        o, t = ours_t.get(key, {}), torch_t.get(key, {})
        src = o or t
        supported = bool(t.get("supported", False)) if t else False
        notes = _pair_notes(o, t)
        torch_time = t.get("time_us") if supported else None
        torch_raw = t.get("raw_time_us") if supported else None
        torch_ratio = ratio(torch_time, torch_raw)
        ours_ratio = ratio(o.get("time_us"), o.get("raw_time_us"))
        rows.append({
            "kind": "transition",
            "transition": key[0],
            "mesh": key[1],
            "bytes": key[2],
            "shape": src.get("shape"),
            "dtype": src.get("dtype", "f32"),
            "torch_time_us": torch_time,
            "torch_raw_time_us": torch_raw,
            "torch_overhead": torch_ratio,
            "torch_overhead_min": ratio(t.get("time_min_us"), t.get("raw_min_us")) if supported else None,
            "torch_collectives": t.get("collectives_issued"),
            "ours_time_us": o.get("time_us"),
            "ours_raw_time_us": o.get("raw_time_us"),
            "ours_overhead": ours_ratio,
            "ours_overhead_min": ratio(o.get("time_min_us"), o.get("raw_min_us")),
            "ours_route": o.get("route"),
            "ours_better": None if ours_ratio is None or torch_ratio is None else ours_ratio < torch_ratio,
            "ours_backend": o.get("backend", ours_backend),
            "torch_version": t.get("torch_version", torch_version),
            "torch_supported": supported,
            "note": "; ".join(notes),
        })

    host_rows = []
    for key in list(ours_h) + [k for k in torch_h if k not in ours_h]:
        o, t = ours_h.get(key, {}), torch_h.get(key, {})
        supported = bool(t.get("supported", False)) if t else False
        torch_time = t.get("time_us") if supported else None
        host_rows.append({
            "kind": "host",
            "transition": key[0],
            "mesh": key[1],
            "bytes": (o or t).get("bytes"),
            "shape": (o or t).get("shape"),
            "torch_time_us": torch_time,
            "torch_time_min_us": t.get("time_min_us") if supported else None,
            "ours_time_us": o.get("time_us"),
            "ours_time_min_us": o.get("time_min_us"),
            "torch_over_ours": ratio(torch_time, o.get("time_us")),
            "torch_collectives": t.get("collectives_issued"),
            "ours_backend": o.get("backend", "local"),
            "torch_version": t.get("torch_version", torch_version),
            "torch_supported": supported,
            "note": "torch: " + t["note"] if t.get("note") else ("torch: not run" if not t else ""),
        })
    return rows, host_rows


OVERLAP_TARGET = 0.10        # issue 9: exposed <= 0.10 ...
OVERLAP_MIN_LOCAL = 4 << 20  # ... at a local shard of at least 4 MiB


def merge_overlap(ours_records, torch_records):
    """Pair ours' and torch's overlap records by (transition, mesh, bytes), ours' order first.

    exposed is recomputed from the medians on both sides (the same definition). A row counts
    towards the target (`counted`) when ours' local shard is >= 4 MiB and ours' plan has a
    collective (dtensor-bench's own summary rule).
    """
    ours_o = {transition_key(r): r for r in ours_records if record_kind(r) == "overlap"}
    torch_o = {transition_key(r): r for r in torch_records if record_kind(r) == "overlap"}
    torch_version = next((r.get("torch_version") for r in torch_records if r.get("torch_version")), None)
    rows = []
    for key in list(ours_o) + [k for k in torch_o if k not in ours_o]:
        o, t = ours_o.get(key, {}), torch_o.get(key, {})
        supported = bool(t.get("supported", False)) if t else False

        def lost(r):  # what the overlapped step took beyond the compute alone (us)
            if r.get("overlapped_us") is None or r.get("compute_us") is None:
                return None
            return r["overlapped_us"] - r["compute_us"]

        ours_lost = lost(o) if o else None
        torch_lost = lost(t) if supported else None
        ours_exposed = ratio(ours_lost, o.get("comm_us"))
        torch_exposed = ratio(torch_lost, t.get("comm_us")) if supported else None
        notes = _pair_notes(o, t)
        row = {"kind": "overlap", "transition": key[0], "mesh": key[1], "bytes": key[2],
               "shape": (o or t).get("shape"), "local_bytes": o.get("local_bytes", t.get("local_bytes")),
               "counted": bool(o) and (o.get("local_bytes") or 0) >= OVERLAP_MIN_LOCAL
               and (o.get("collectives") or 0) > 0,
               "ours_backend": o.get("backend"), "torch_version": t.get("torch_version", torch_version),
               "torch_run": bool(t), "torch_supported": supported, "torch_collectives": t.get("collectives_issued"),
               "ours_route": o.get("route"), "ours_exposed": ours_exposed, "torch_exposed": torch_exposed,
               "ours_lost_us": ours_lost, "torch_lost_us": torch_lost,
               "ours_better": None if ours_lost is None or torch_lost is None else ours_lost <= torch_lost}
        for side, r in (("ours", o), ("torch", t if supported else {})):
            for field in ("comm_us", "compute_us", "overlapped_us", "issue_us"):
                row[f"{side}_{field}"] = r.get(field)
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


OVERLAP_HEADER = ["bytes", "local", "torch comm us", "torch issue us", "torch lost us", "torch exposed",
                  "ours comm us", "ours issue us", "ours lost us", "ours exposed", "ours loses less"]


def _overlap_cells(r):
    if r["torch_supported"]:
        torch_cells = [fmt_us(r["torch_comm_us"]), fmt_us(r["torch_issue_us"]), fmt_us(r["torch_lost_us"]),
                       fmt_ratio(r["torch_exposed"])]
    else:
        torch_cells = ["unsupported" if r["torch_run"] else "not run", "-", "-", "-"]
    return ([fmt_bytes(r["bytes"]), fmt_bytes(r["local_bytes"])] + torch_cells
            + [fmt_us(r["ours_comm_us"]), fmt_us(r["ours_issue_us"]), fmt_us(r["ours_lost_us"]),
               fmt_ratio(r["ours_exposed"]), _yes_no(r["ours_better"])])


def overlap_summary(rows):
    """'rows with a local shard >= 4M within 0.10: ours 11 of 14, torch 3 of 14; ...' (or '')."""
    counted = [r for r in rows if r["counted"]]
    if not counted:
        return ""

    def within(side):
        vals = [r[f"{side}_exposed"] for r in counted]
        return sum(1 for v in vals if v is not None and v <= OVERLAP_TARGET), sum(1 for v in vals if v is not None)

    (ours_ok, ours_n), (torch_ok, torch_n) = within("ours"), within("torch")
    wins = [r["ours_better"] for r in counted if r["ours_better"] is not None]
    return (f"rows with a local shard >= {fmt_bytes(OVERLAP_MIN_LOCAL)} within exposed {OVERLAP_TARGET:.2f}: "
            f"ours {ours_ok} of {ours_n}, torch {torch_ok} of {torch_n}; "
            f"ours loses no more time than torch on {sum(wins)} of {len(wins)}")


def _group_heading(title, group):
    """The console lines that open one (transition, mesh) table: its title, ours' routes, torch's collectives."""
    lines = ["", f"== {title}"]
    for label, route in _runs(group, "ours_route"):
        lines.append(f"   ours route{' ' + label if label else ''}:  {route}")
    for label, issued in _runs(group, "torch_collectives"):
        lines.append(f"   torch issues{' ' + label if label else ''}: {issued or 'no collective'}")
    return lines


def render_overlap_text(rows):
    lines = ["", "== overlap: lost = overlapped - compute (the time the step loses), exposed = lost / comm "
             "(0 = hidden, 1 = not at all); medians, max over ranks"]
    groups = {}
    for r in rows:
        groups.setdefault((r["transition"], r["mesh"]), []).append(r)
    for (transition, mesh), group in groups.items():
        lines += _group_heading(f"{transition}   mesh {mesh}   (overlap)", group)
        lines.extend("   " + line for line in _text_table(OVERLAP_HEADER, [_overlap_cells(r) for r in group],
                                                           left={0, 1, 10}))
        for note in dict.fromkeys(r["note"] for r in group if r["note"]):
            lines.append(f"   note: {note}")
    summary = overlap_summary(rows)
    if summary:
        lines += ["", summary]
    return lines


def render_overlap_markdown(rows):
    def md_row(cells):
        return "| " + " | ".join(str(c) for c in cells) + " |"

    out = ["", "Overlap (`--overlap`; lost = overlapped - compute, exposed = lost / comm, medians in us, max over "
           "ranks; torch: `redistribute(..., async_op=True)`, the same procedure):", "",
           md_row(["transition", "mesh"] + OVERLAP_HEADER),
           md_row(["---", "---", "---:", "---:"] + ["---:"] * (len(OVERLAP_HEADER) - 3) + ["---"])]
    for r in rows:
        out.append(md_row([f"`{r['transition']}`", r["mesh"]] + _overlap_cells(r)))
    summary = overlap_summary(rows)
    if summary:
        out += ["", summary[0].upper() + summary[1:] + "."]
    return out


def _yes_no(b):
    return "-" if b is None else ("yes" if b else "no")


def _torch_cells(row):
    if row["torch_supported"]:
        return [fmt_us(row["torch_time_us"]), fmt_us(row["torch_raw_time_us"]), fmt_ratio(row["torch_overhead"])]
    return ["unsupported", "-", "-"]


TRANSITION_HEADER = ["bytes", "shape", "torch us", "torch raw us", "torch ratio",
                     "ours us", "ours raw us", "ours ratio", "ours ratio < torch"]


def _text_table(header, body, left):
    """Columns two spaces apart; those whose index is in `left` left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    lines = []
    for cells in [header] + body:
        out = []
        for i, (c, w) in enumerate(zip(cells, widths)):
            out.append(str(c).ljust(w) if i in left else str(c).rjust(w))
        lines.append("  ".join(out).rstrip())
    return lines


def _runs(group, field):
    """[(label, value)] for the runs of consecutive rows sharing row[field], None values skipped.

    label is '' when one value covers the whole group, else the byte range of the run ('1K-1M').
    """
    runs = []  # [first row, last row, value]
    for r in group:
        if r[field] is None:
            continue
        if runs and runs[-1][2] == r[field]:
            runs[-1][1] = r
        else:
            runs.append([r, r, r[field]])
    if len(runs) == 1:
        return [("", runs[0][2])]
    return [(fmt_bytes(a["bytes"]) if a is b else f"{fmt_bytes(a['bytes'])}-{fmt_bytes(b['bytes'])}", v)
            for a, b, v in runs]


def render_text(rows, host_rows, overlap_rows=()):
    """The console report: one table per (transition, mesh), the host-cost table, the overlap tables."""
    lines = []
    every = list(rows) + list(host_rows) + list(overlap_rows)
    versions = sorted({r["torch_version"] for r in every if r.get("torch_version")})
    backends = sorted({r["ours_backend"] for r in list(rows) + list(overlap_rows) if r.get("ours_backend")})
    lines.append(f"ours: backend {', '.join(backends) or '?'};  torch {', '.join(versions) or '?'}: gloo, CPU")
    if rows:
        lines.append("ratio = redistribute time / raw-collective time (median us, max over ranks); lower is better")

    groups = {}
    for r in rows:
        groups.setdefault((r["transition"], r["mesh"]), []).append(r)
    for (transition, mesh), group in groups.items():
        lines += _group_heading(f"{transition}   mesh {mesh}", group)
        body = []
        for r in group:
            body.append([fmt_bytes(r["bytes"]), fmt_shape(r["shape"])] + _torch_cells(r) + [
                fmt_us(r["ours_time_us"]), fmt_us(r["ours_raw_time_us"]), fmt_ratio(r["ours_overhead"]),
                _yes_no(r["ours_better"])])
        lines.extend("   " + line for line in _text_table(TRANSITION_HEADER, body, left={0, 1, 8}))
        for note in dict.fromkeys(r["note"] for r in group if r["note"]):
            lines.append(f"   note: {note}")

    if host_rows:
        lines.append("")
        lines.append("== host cost: one redistribute call, plan cached, mesh of 1 rank (median us per call)")
        header = ["transition", "mesh", "shape", "torch us", "ours us", "torch / ours", "torch issues"]
        body = [[h["transition"], h["mesh"], fmt_shape(h["shape"]),
                 fmt_us(h["torch_time_us"]) if h["torch_supported"] else "unsupported",
                 fmt_us(h["ours_time_us"]), fmt_ratio(h["torch_over_ours"]),
                 "-" if h["torch_collectives"] is None else (h["torch_collectives"] or "no collective")]
                for h in host_rows]
        lines.extend("   " + line for line in _text_table(header, body, left={0, 1, 2, 6}))
        for note in dict.fromkeys(h["note"] for h in host_rows if h["note"]):
            lines.append(f"   note: {note}")

    wins = [r["ours_better"] for r in rows if r["ours_better"] is not None]
    if rows:
        lines.append("")
        lines.append(f"ours ratio < torch ratio on {sum(wins)} of {len(wins)} comparable rows")
    if overlap_rows:
        lines += render_overlap_text(overlap_rows)
    return "\n".join(lines) + "\n"


def render_markdown(rows, host_rows, overlap_rows=()):
    """Markdown tables for bench/RESULTS.md."""
    def md_row(cells):
        return "| " + " | ".join(str(c) for c in cells) + " |"

    every = list(rows) + list(host_rows) + list(overlap_rows)
    versions = sorted({r["torch_version"] for r in every if r.get("torch_version")})
    backends = sorted({r["ours_backend"] for r in list(rows) + list(overlap_rows) if r.get("ours_backend")})
    out = [
        f"ours: `{', '.join(backends) or '?'}` backend; torch {', '.join(versions) or '?'} DTensor on gloo (CPU). "
        "Times are medians in microseconds, max over ranks; ratio = redistribute / raw collectives "
        "(lower is better).",
    ]
    if rows:
        out += ["", md_row(["transition", "mesh"] + TRANSITION_HEADER),
                # text columns left-aligned, numbers right-aligned
                md_row(["---", "---", "---:", "---"] + ["---:"] * (len(TRANSITION_HEADER) - 3) + ["---"])]
    for r in rows:
        out.append(md_row([f"`{r['transition']}`", r["mesh"], fmt_bytes(r["bytes"]), fmt_shape(r["shape"])]
                          + _torch_cells(r)
                          + [fmt_us(r["ours_time_us"]), fmt_us(r["ours_raw_time_us"]),
                             fmt_ratio(r["ours_overhead"]), _yes_no(r["ours_better"])]))
    groups = {}
    for r in rows:
        groups.setdefault((r["transition"], r["mesh"]), []).append(r)
    if groups:
        out += ["", "Collectives per transition (ours: the plan's route; torch: what CommDebugMode saw):", ""]
        for (transition, mesh), group in groups.items():
            parts = [f"ours{' ' + label if label else ''} `{route}`" for label, route in _runs(group, "ours_route")]
            parts += [f"torch{' ' + label if label else ''} {issued or 'no collective'}"
                      for label, issued in _runs(group, "torch_collectives")]
            out.append(f"- `{transition}` (mesh {mesh}): " + "; ".join(parts))
    notes = list(dict.fromkeys(f"`{r['transition']}` (mesh {r['mesh']}): {r['note']}" for r in rows if r["note"]))
    if notes:
        out += ["", "Notes:", ""]
        out.extend(f"- {n}" for n in notes)
    if host_rows:
        out += ["", "Host cost of one redistribute call (plan cached, mesh of 1 rank, median us per call):", "",
                md_row(["transition", "mesh", "shape", "torch us", "ours us", "torch / ours"]),
                md_row(["---", "---", "---", "---:", "---:", "---:"])]
        for h in host_rows:
            out.append(md_row([f"`{h['transition']}`", h["mesh"], fmt_shape(h["shape"]),
                               fmt_us(h["torch_time_us"]) if h["torch_supported"] else "unsupported",
                               fmt_us(h["ours_time_us"]), fmt_ratio(h["torch_over_ours"])]))
    if overlap_rows:
        out += render_overlap_markdown(overlap_rows)
    return "\n".join(out) + "\n"


def write_outputs(rows, host_rows, out_dir, overlap_rows=()):
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "torch_compare.json")
    md_path = os.path.join(out_dir, "torch_compare.md")
    with open(json_path, "w") as f:
        json.dump(rows + host_rows + list(overlap_rows), f, indent=1)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(render_markdown(rows, host_rows, overlap_rows))
    return json_path, md_path


def report(ours_records, torch_records, out_dir):
    rows, host_rows = merge(ours_records, torch_records)
    overlap_rows = merge_overlap(ours_records, torch_records)
    sys.stdout.write(render_text(rows, host_rows, overlap_rows))
    if out_dir:
        paths = write_outputs(rows, host_rows, out_dir, overlap_rows)
        print("wrote " + " and ".join(paths))
    return rows, host_rows


# ================================================================================================
# Running ours (dtensor-bench)
# ================================================================================================


def run_command(cmd, what, log_path, may_reject=False):
    """Run cmd with its output appended to log_path (dtensor-bench's own tables); True if it ran.

    dtensor-bench exits 1 when some element was wrong (its JSON is complete and counts them in
    `wrong`, which the comparison shows): a warning. Exit 2 (bad input or unsupported transition)
    is a warning too with may_reject (the transition is left out), otherwise it stops the
    comparison, as does any other failure.
    """
    print(f"[{what}] " + " ".join(shlex.quote(c) for c in cmd) + f"   (output: {log_path})",
          file=sys.stderr, flush=True)
    with open(log_path, "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode == 0:
        return True
    with open(log_path) as log:
        last = [line for line in log.read().splitlines() if line.strip()][-1:]
    why = f"exit status {proc.returncode}: {last[0] if last else ''} (output in {log_path})"
    if proc.returncode == 1:
        print(f"torch_compare: warning: {what} found wrong elements, {why}", file=sys.stderr)
        return True
    if proc.returncode == 2 and may_reject:
        print(f"torch_compare: warning: {what} rejected the transition, left out; {why}", file=sys.stderr)
        return False
    sys.exit(f"torch_compare: {what} failed, {why}")


def run_ours(args, out_dir):
    """Run dtensor-bench for the transitions and its host cost; returns the two JSON paths."""
    bench = os.path.abspath(args.bench)
    if not os.path.exists(bench):
        sys.exit(f"torch_compare: {bench} not found (build it: ninja -C build bench/dtensor-bench)")
    if args.ours_backend == "mpi":
        launcher = shlex.split(args.mpirun) + ["-np", str(args.np), bench, "--backend", "mpi"]
    else:
        launcher = [bench, "--backend", "local", "--world", str(args.np)]
    common = ["--sizes", args.sizes, "--dtype", args.dtype,
              "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.mesh:
        common += ["--mesh", args.mesh]
    if args.overlap:
        common += ["--overlap"]

    ours_json = os.path.join(out_dir, "ours.json")
    ours_log = os.path.join(out_dir, "ours.txt")
    if os.path.exists(ours_log):
        os.remove(ours_log)
    if args.transition:
        # One run per transition (the bench takes one --from/--to pair), concatenated.
        records = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, transition in enumerate(args.transition):
                src, dst = split_transition(transition)
                part = os.path.join(tmp, f"{i}.json")
                if run_command(launcher + ["--from", src, "--to", dst] + common + ["--json", part],
                               f"ours {transition}", ours_log, may_reject=True):
                    records += load_records([part])
        with open(ours_json, "w") as f:
            json.dump(records, f, indent=1)
    else:
        run_command(launcher + ["--suite", args.suite] + common + ["--json", ours_json], "ours", ours_log)

    host_json = None
    if not args.no_host_cost and not args.overlap:
        host_json = os.path.join(out_dir, "ours_host.json")
        run_command([bench, "--backend", "local", "--world", "1", "--host-cost", "--json", host_json],
                    "ours host cost", ours_log)
    return ours_json, host_json


# ================================================================================================
# Torch side: launcher (no torch in this process)
# ================================================================================================


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(python, plan, world, log_dir, timeout_s):
    """Run `world` torch worker processes on `plan`; returns rank 0's list of records."""
    os.makedirs(log_dir, exist_ok=True)
    plan_path = os.path.join(log_dir, f"torch_plan_{plan['mode']}.json")
    result_path = os.path.join(log_dir, f"torch_result_{plan['mode']}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    plan = dict(plan, result=result_path)
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    env.setdefault("OMP_NUM_THREADS", "1")
    procs, logs = [], []
    for rank in range(world):
        cmd = [python, os.path.abspath(__file__), "_worker", plan_path]
        env_r = dict(env, RANK=str(rank))
        if rank == 0:  # rank 0 reports progress on the console; the others log to files
            procs.append(subprocess.Popen(cmd, env=env_r))
            logs.append(None)
        else:
            log = open(os.path.join(log_dir, f"torch_worker_{plan['mode']}_{rank}.log"), "w")
            procs.append(subprocess.Popen(cmd, env=env_r, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)

    # Wait for all; if one fails, stop the others (they would wait on it until gloo's timeout).
    deadline = time.monotonic() + timeout_s
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad or time.monotonic() > deadline:
            failed = bad[0] if bad else ("all", "timeout")
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
            break
        time.sleep(0.2)
    for log in logs:
        if log:
            log.close()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed or bad:
        failed = failed or bad[0]
        sys.exit(f"torch_compare: torch worker rank {failed[0]} failed ({failed[1]}); "
                 f"logs of ranks >= 1 are in {log_dir}")
    return load_records([result_path])


def torch_cases_from(ours_records):
    """The torch side's work list, taken from ours' records (same transition, mesh, shape)."""
    cases = []
    for r in ours_records:
        if record_kind(r) != "transition":
            continue
        cases.append({k: r.get(k) for k in ("transition", "src", "dst", "mesh", "mesh_shape", "bytes", "shape",
                                             "dtype", "raw_ops", "iters", "warmup")})
    return cases


def overlap_cases_from(ours_records):
    """The torch side's overlap work list, from ours' overlap records (dtensor-bench --overlap)."""
    cases = []
    for r in ours_records:
        if record_kind(r) != "overlap":
            continue
        case = {k: r.get(k) for k in ("transition", "src", "dst", "mesh", "mesh_shape", "bytes", "local_bytes",
                                      "shape", "dtype", "iters", "warmup")}
        case["mesh_shape"] = case["mesh_shape"] or mesh_shape_of(case["mesh"])
        cases.append(case)
    return cases


def host_cases_from(ours_records):
    """The host-cost cases: ours' host records (same mesh of ones, shape, calls and repeats)."""
    cases = [{"transition": r["transition"], "mesh": str(r.get("mesh", "1")), "shape": r["shape"],
              "bytes": r.get("bytes"), "dtype": r.get("dtype", "f32"), "calls": r.get("calls"),
              "repeats": r.get("iters")}
             for r in ours_records if record_kind(r) == "host" and int(r.get("world", 1)) == 1]
    if cases:
        return cases
    return [dict(c, mesh="x".join("1" * len(parse_placements(split_transition(c["transition"])[0]))),
                 dtype="f32", bytes=4 * math.prod(c["shape"])) for c in DEFAULT_HOST_CASES]


def run_torch_side(args, ours_records, out_dir, with_host=True):
    """Both torch measurements: transitions (--np processes) and host cost (1 process).

    The workers' plans, results and logs (ranks >= 1) go to out_dir/torch_work/.
    """
    python = args.torch_python or sys.executable
    work_dir = os.path.join(out_dir, "torch_work")
    cases = torch_cases_from(ours_records)
    overlap_cases = overlap_cases_from(ours_records)
    worlds = {math.prod(c["mesh_shape"]) for c in cases + overlap_cases if c.get("mesh_shape")}
    world = args.np
    if worlds and worlds != {world}:
        if len(worlds) > 1:
            sys.exit(f"torch_compare: ours' records span several world sizes {sorted(worlds)}")
        world = worlds.pop()
        print(f"torch_compare: using world {world} (from ours' mesh shapes)", file=sys.stderr)
    records = []
    for mode, mode_cases in (("transitions", cases), ("overlap", overlap_cases)):
        if not mode_cases:
            continue
        print(f"[torch {mode}] {len(mode_cases)} cases on {world} processes (gloo)", file=sys.stderr, flush=True)
        for case in mode_cases:
            if args.torch_iters is not None:
                case["iters"] = args.torch_iters
            if args.torch_warmup is not None:
                case["warmup"] = args.torch_warmup
        records += launch_workers(python, {"mode": mode, "cases": mode_cases}, world, work_dir, args.timeout)
    if with_host and not any(record_kind(r) == "overlap" for r in ours_records):
        host = {"mode": "host", "cases": host_cases_from(ours_records),
                "calls": args.host_calls, "repeats": args.host_repeats}
        print(f"[torch host cost] {len(host['cases'])} cases on 1 process", file=sys.stderr, flush=True)
        records += launch_workers(python, host, 1, work_dir, args.timeout)
    return records


# ================================================================================================
# Torch side: worker (the only place torch is imported)
# ================================================================================================

def _worker_main(plan_path):
    try:
        import torch  # noqa: F401
    except ImportError as e:
        sys.exit(f"torch_compare: this python ({sys.executable}) cannot import torch ({e}); "
                 "pass --torch-python PATH of one that can")
    with open(plan_path) as f:
        plan = json.load(f)
    worker = _TorchWorker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    try:
        run = {"host": worker.run_host, "overlap": worker.run_overlap}.get(plan["mode"], worker.run_transitions)
        records = run(plan)
        if worker.rank == 0:
            with open(plan["result"], "w") as f:
                json.dump(records, f, indent=1)
    finally:
        worker.close()


class _TimerSlack:
    """The calling thread's timer slack at 1 ns while in the block (Linux; elsewhere nothing), as
    dtensor-bench's TimerSlack: Linux's default 50 us made its compute stand-in's sleeps overrun."""

    PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30

    def __enter__(self):
        self.old = 0
        try:
            import ctypes

            self.libc = ctypes.CDLL(None, use_errno=True)
            old = self.libc.prctl(self.PR_GET_TIMERSLACK, 0, 0, 0, 0)
            if old > 0 and self.libc.prctl(self.PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0:
                self.old = old
        except (OSError, AttributeError):
            pass
        return self

    def __exit__(self, *exc):
        if self.old > 0:
            self.libc.prctl(self.PR_SET_TIMERSLACK, self.old, 0, 0, 0)
        return False


class _TorchWorker:
    """One rank of the torch side. Imports torch on construction."""

    def __init__(self, rank, world):
        import datetime

        import torch
        import torch.distributed as dist

        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        self.torch, self.dist = torch, dist
        self.async_tensor = AsyncCollectiveTensor
        self.rank, self.world = rank, world
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        self.meshes = {}

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def log(self, msg):
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    # --- building blocks -----------------------------------------------------------------------

    def dtype(self, name):
        t = self.torch
        return {"f32": t.float32, "f64": t.float64, "bf16": t.bfloat16, "f16": t.float16,
                "i32": t.int32, "i64": t.int64, "u8": t.uint8}[name or "f32"]

    def mesh(self, shape):
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(shape)
        if shape not in self.meshes:
            self.meshes[shape] = init_device_mesh("cpu", shape)
        return self.meshes[shape]

    def placements(self, text):
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        out = []
        for p in parse_placements(text):
            if p[0] == "S":
                out.append(Shard(p[1]))
            elif p[0] == "_S":
                out.append(_StridedShard(p[1], split_factor=p[2]))
            elif p[0] == "R":
                out.append(Replicate())
            else:
                out.append(Partial({"prod": "product"}.get(p[1], p[1])))
        return out

    def global_tensor(self, shape, dtype):
        """Small integers (exact in every dtype and in any summation order), a function of the index."""
        t = self.torch
        n = math.prod(shape)
        return (t.arange(n, dtype=t.int64) % 251).to(self.dtype(dtype)).reshape(shape)

    def source(self, glob, mesh, placements):
        """A DTensor with `placements` whose full tensor is `glob`.

        The shards come from a replicated DTensor redistributed (locally, no communication) to the
        placements with every Partial replaced by Replicate; on the Partial mesh dims each rank then
        holds a full-size partial whose reduction is its shard: shard / n for sum, the shard itself
        for avg/min/max, the shard on coordinate 0 and ones elsewhere for product.
        """
        from torch.distributed.tensor import DTensor, Partial, Replicate

        no_partial = [Replicate() if isinstance(p, Partial) else p for p in placements]
        full = DTensor.from_local(glob, mesh, [Replicate()] * mesh.ndim, run_check=False)
        local = full.redistribute(mesh, no_partial).to_local().contiguous()
        partial_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
        if partial_dims:
            coord = mesh.get_coordinate()
            k = math.prod(mesh.size(i) for i in partial_dims)
            first = all(coord[i] == 0 for i in partial_dims)
            op = placements[partial_dims[0]].reduce_op
            if op == "sum" and local.is_floating_point():
                local = local / k
            elif op == "sum":  # integers: the whole shard on coordinate 0, zeros elsewhere
                local = local if first else self.torch.zeros_like(local)
            elif op == "product":
                local = local if first else self.torch.ones_like(local)
            local = local.contiguous()
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=glob.shape, stride=glob.stride())

    def wait(self, dt):
        """Block until the local tensor of `dt` holds its data (async functional collectives)."""
        local = dt.to_local()
        if isinstance(local, self.async_tensor):
            local.wait()
        return dt

    def time_loop(self, fn, iters, warmup):
        """Per-iteration times (ns) of fn(), each after a barrier; not yet reduced over ranks."""
        dist = self.dist
        for _ in range(warmup):
            dist.barrier()
            fn()
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        return times

    def max_over_ranks(self, values):
        t = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def all_ok(self, ok):
        t = self.torch.tensor([1 if ok else 0], dtype=self.torch.int32)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return bool(t.item())

    def raw_runner(self, mesh, raw_ops, dtype):
        """A function that runs `raw_ops` back to back on buffers allocated here, and a note."""
        torch, dist = self.torch, self.dist
        dt = self.dtype(dtype)
        esize = torch.empty(0, dtype=dt).element_size()
        steps, notes = [], []
        for op in raw_ops:
            group = mesh.get_group(op["mesh_dim"])
            g = op.get("group_size") or dist.get_world_size(group)
            n_in, n_out = op["bytes_in"] // esize, op["bytes_out"] // esize
            name = op["op"]
            if name == "all_gather":
                inp = torch.zeros(n_in, dtype=dt)
                out = torch.zeros(n_in * g, dtype=dt)
                steps.append(lambda o=out, i=inp, gr=group: dist.all_gather_into_tensor(o, i, group=gr))
            elif name == "reduce_scatter":
                inp = torch.zeros(n_out * g, dtype=dt)
                out = torch.zeros(n_out, dtype=dt)
                steps.append(lambda o=out, i=inp, gr=group: dist.reduce_scatter_tensor(o, i, group=gr))
            elif name == "all_reduce":
                buf = torch.zeros(n_in, dtype=dt)  # zeros: the in-place sum stays finite
                steps.append(lambda b=buf, gr=group: dist.all_reduce(b, group=gr))
            elif name == "all_to_all":
                n = -(-n_in // g) * g  # all_to_all_single with equal splits needs a multiple of g
                if n != n_in:
                    notes.append(f"raw all_to_all padded from {n_in} to {n} elements")
                inp, out = torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)
                steps.append(lambda o=out, i=inp, gr=group: dist.all_to_all_single(o, i, group=gr))
            else:
                raise ValueError(f"unknown raw op {name!r}")

        def run():
            for step in steps:
                step()
        return run, notes

    @staticmethod
    def issued(comm_counts):
        """CommDebugMode counts -> 'all_gather_into_tensor x2, all_reduce' (first-use order)."""
        parts = []
        for op, count in comm_counts.items():
            name = str(op).split(".")[-1]
            parts.append(name if count == 1 else f"{name} x{count}")
        return ", ".join(parts)

    # --- the two modes -------------------------------------------------------------------------

    def run_transitions(self, plan):
        import torch

        records = []
        for i, case in enumerate(plan["cases"]):
            rec = {k: case.get(k)
                   for k in ("transition", "src", "dst", "mesh", "mesh_shape", "bytes", "shape", "dtype")}
            warmup = case.get("warmup")
            rec.update(kind="transition", backend="gloo", world=self.world, torch_version=torch.__version__,
                       iters=case.get("iters") or 20, warmup=3 if warmup is None else warmup,
                       supported=False, note="", collectives_issued=None, correct=None,
                       time_us=None, time_min_us=None, time_max_us=None,
                       raw_time_us=None, raw_min_us=None, raw_max_us=None, overhead=None)
            self.log(f"[torch] {i + 1}/{len(plan['cases'])} {case['transition']} mesh {case['mesh']} "
                     f"{fmt_bytes(case['bytes'])} {fmt_shape(case['shape'])}")
            self.run_transition(case, rec)
            records.append(rec)
        return records

    def prepare(self, case, rec, async_op=False):
        """The case's mesh, destination placements and source DTensor, checked once before timing.

        The redistribute runs under CommDebugMode (rec["collectives_issued"]) and its full tensor
        must equal the source's (rec["correct"]). Returns (mesh, dst, x), or None with rec["note"]
        saying why when torch rejected the transition or got it wrong on any rank.
        """
        import torch
        from torch.distributed.tensor.debug import CommDebugMode

        src_text, dst_text = (case.get("src"), case.get("dst"))
        if not src_text or not dst_text:
            src_text, dst_text = split_transition(case["transition"])
        error = None
        try:
            mesh = self.mesh(case["mesh_shape"])
            src, dst = self.placements(src_text), self.placements(dst_text)
            glob = self.global_tensor(case["shape"], case.get("dtype"))
            x = self.source(glob, mesh, src)
            comm = CommDebugMode()
            with comm:
                y = self.wait(x.redistribute(mesh, dst, async_op=async_op))
            rec["collectives_issued"] = self.issued(comm.get_comm_counts())
            ref = x.full_tensor()
            got = y.full_tensor()
            rec["correct"] = bool(torch.equal(ref, glob) and torch.equal(got, ref))
            if not rec["correct"] and torch.equal(ref, glob) and got.is_floating_point() \
                    and torch.allclose(got, ref, rtol=1e-6, atol=1e-6):
                rec["correct"] = True
                rec["note"] = "result equal up to rounding"
        except Exception as e:  # a transition torch rejects: record it, do not crash
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
        # Everyone must agree before any timed collective, or the ranks would wait on each other.
        if not self.all_ok(error is None):
            rec["note"] = error or "failed on another rank"
            return None
        if not self.all_ok(rec["correct"]):
            rec["note"] = "WRONG RESULT: full_tensor() differs from the source; not timed"
            return None
        rec["supported"] = True
        return mesh, dst, x

    def run_transition(self, case, rec):
        prepared = self.prepare(case, rec)
        if prepared is None:
            return
        mesh, dst, x = prepared
        iters, warmup = rec["iters"], rec["warmup"]
        times = self.time_loop(lambda: self.wait(x.redistribute(mesh, dst)), iters, warmup)
        raw_ops = case.get("raw_ops") or []
        notes = [rec["note"]] if rec["note"] else []
        issued = rec["collectives_issued"] or ""
        if any(op["op"] == "all_to_all" for op in raw_ops) and "all_to_all" not in issued:
            notes.append("no all_to_all on a CPU mesh (all_gather + local chunk instead) where the raw ops "
                         "have one; its ratio includes that choice")
        raw_times = None
        if raw_ops:
            run_raw, raw_notes = self.raw_runner(mesh, raw_ops, case.get("dtype"))
            notes += raw_notes
            raw_times = self.time_loop(run_raw, iters, warmup)
        rec["note"] = "; ".join(notes)

        # Reduce over ranks once, after the loops (so the reduction does not disturb them).
        both = self.max_over_ranks(times + (raw_times or []))
        us = [t / 1e3 for t in both]
        red, raw = us[:iters], us[iters:]
        rec.update(time_us=statistics.median(red), time_min_us=min(red), time_max_us=max(red))
        if raw:
            rec.update(raw_time_us=statistics.median(raw), raw_min_us=min(raw), raw_max_us=max(raw),
                       overhead=statistics.median(red) / statistics.median(raw))

    def run_overlap(self, plan):
        import torch

        records = []
        with _TimerSlack():  # the sleeps last what they are asked, as dtensor-bench's do
            for i, case in enumerate(plan["cases"]):
                warmup = case.get("warmup")
                rec = {k: case.get(k) for k in ("transition", "src", "dst", "mesh", "mesh_shape", "bytes",
                                                 "local_bytes", "shape", "dtype")}
                rec.update(kind="overlap", backend="gloo", world=self.world, torch_version=torch.__version__,
                           iters=case.get("iters") or 20, warmup=3 if warmup is None else warmup,
                           supported=False, note="", collectives_issued=None, correct=None,
                           comm_us=None, comm_warm_us=None, compute_us=None, overlapped_us=None,
                           issue_us=None, exposed=None)
                self.log(f"[torch overlap] {i + 1}/{len(plan['cases'])} {case['transition']} mesh {case['mesh']} "
                         f"{fmt_bytes(case['bytes'])} {fmt_shape(case['shape'])}")
                self.run_overlap_case(case, rec)
                records.append(rec)
        return records

    def run_overlap_case(self, case, rec):
        """dtensor-bench's --overlap procedure (run_overlap_one) with redistribute(async_op=True)."""
        import collections

        prepared = self.prepare(case, rec, async_op=True)
        if prepared is None:
            return
        mesh, dst, x = prepared
        dist = self.dist
        iters, warmup = rec["iters"], rec["warmup"]
        now = time.perf_counter_ns

        def timed(body):
            dist.barrier()
            t0 = now()
            body()
            return (now() - t0) / 1e3

        def transition():
            self.wait(x.redistribute(mesh, dst, async_op=True))

        def sleep_us(us):
            time.sleep(us / 1e6)

        warm = [t / 1e3 for t in self.time_loop(transition, iters, warmup)]
        guess = statistics.median(self.max_over_ranks(warm))  # the same on every rank
        after_idle = []
        for _ in range(iters):
            sleep_us(guess)
            after_idle.append(timed(transition))
        recent = collections.deque(self.max_over_ranks(after_idle))
        target = statistics.median(recent)
        alone, comm_t, both, issue = [], [], [], []

        def overlapped():
            t = now()
            h = x.redistribute(mesh, dst, async_op=True)
            issue.append((now() - t) / 1e3)
            sleep_us(target)
            self.wait(h)

        for _ in range(iters):
            alone.append(timed(lambda: sleep_us(target)))  # also the idle spell before comm
            comm_t.append(timed(transition))
            recent.popleft()
            recent.append(self.max_over_ranks([comm_t[-1]])[0])
            sleep_us(target)
            both.append(timed(overlapped))
            target = statistics.median(recent)
        v = self.max_over_ranks(alone + both + comm_t + issue)
        n = iters
        compute_us, overlapped_us = statistics.median(v[:n]), statistics.median(v[n:2 * n])
        comm_us, issue_us = statistics.median(v[2 * n:3 * n]), statistics.median(v[3 * n:])
        rec.update(comm_us=comm_us, comm_warm_us=guess, compute_us=compute_us, overlapped_us=overlapped_us,
                   issue_us=issue_us, comm_min_us=min(v[2 * n:3 * n]), comm_max_us=max(v[2 * n:3 * n]),
                   overlapped_min_us=min(v[n:2 * n]), overlapped_max_us=max(v[n:2 * n]),
                   exposed=ratio(overlapped_us - compute_us, comm_us))

    def run_host(self, plan):
        import torch
        from torch.distributed.tensor.debug import CommDebugMode

        records = []
        for case in plan["cases"]:
            calls = plan["calls"] or case.get("calls") or 2000
            repeats = plan["repeats"] or case.get("repeats") or 20
            mesh_shape = mesh_shape_of(case.get("mesh", "1"))
            rec = dict(kind="host", transition=case["transition"], mesh=case.get("mesh", "1"),
                       mesh_shape=mesh_shape,
                       bytes=case.get("bytes"), shape=case["shape"], dtype=case.get("dtype", "f32"),
                       backend="gloo", world=1, torch_version=torch.__version__, calls=calls,
                       repeats=repeats, supported=False, note="", time_us=None, time_min_us=None,
                       time_max_us=None, raw_time_us=None, overhead=None)
            self.log(f"[torch host cost] {case['transition']} {fmt_shape(case['shape'])}: "
                     f"{repeats} x {calls} calls")
            try:
                mesh = self.mesh(mesh_shape)
                src_text, dst_text = split_transition(case["transition"])
                src, dst = self.placements(src_text), self.placements(dst_text)
                glob = self.global_tensor(case["shape"], rec["dtype"])
                x = self.source(glob, mesh, src)
                comm = CommDebugMode()
                with comm:
                    y = self.wait(x.redistribute(mesh, dst))
                rec["collectives_issued"] = self.issued(comm.get_comm_counts())
                if not torch.equal(y.full_tensor(), glob):
                    raise RuntimeError("wrong result")

                def batch():
                    t0 = time.perf_counter_ns()
                    for _ in range(calls):
                        self.wait(x.redistribute(mesh, dst))
                    return (time.perf_counter_ns() - t0) / 1e3 / calls

                batch()  # warm-up: plan cache, allocator, first-call paths
                per_call = [batch() for _ in range(repeats)]
                rec.update(supported=True, time_us=statistics.median(per_call),
                           time_min_us=min(per_call), time_max_us=max(per_call))
            except Exception as e:
                rec["note"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
            records.append(rec)
        return records


# ================================================================================================
# Command line
# ================================================================================================


def add_torch_options(p):
    p.add_argument("--np", type=int, default=4, help="processes (ranks) on each side (default 4)")
    p.add_argument("--torch-python", metavar="PY",
                   help="python with torch for the torch workers (default: the one running this script)")
    p.add_argument("--host-calls", type=int,
                   help="torch: redistribute calls per host-cost repeat (default: ours' record's, else 2000)")
    p.add_argument("--host-repeats", type=int,
                   help="torch: host-cost repeats, the median is reported (default: ours' record's, else 20)")
    p.add_argument("--torch-iters", type=int,
                   help="torch: timed iterations per case (default: ours' record's, for equal terms; "
                        "more steadies a noisy machine)")
    p.add_argument("--torch-warmup", type=int, help="torch: warm-up iterations per case (default: ours' record's)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the torch workers are stopped")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Compare redistribute overhead (redistribute / raw collectives) of dtensor-bench "
                    "with PyTorch DTensor on gloo.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (head of this file) for what is measured and how.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run ours, then torch on the same cases, and compare")
    run.add_argument("--bench", default=DEFAULT_BENCH,
                     help="dtensor-bench binary (default build/bench/dtensor-bench)")
    run.add_argument("--ours-backend", choices=["mpi", "local"], default="mpi",
                     help="mpi: mpirun -np NP (default); local: --world NP threads")
    run.add_argument("--mpirun", default="mpirun --allow-run-as-root --oversubscribe",
                     help="launcher for the mpi backend (default: %(default)s)")
    run.add_argument("--sizes", default="1K:16M",
                     help="global tensor bytes, dtensor-bench syntax (default 1K:16M)")
    run.add_argument("--dtype", default="f32", choices=sorted(DTYPE_BYTES))
    run.add_argument("--iters", type=int, default=20)
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--suite", default="default", help="dtensor-bench suite (default: default)")
    run.add_argument("--transition", action="append", metavar="SRC->DST",
                     help="run only these transitions instead of the suite (repeatable)")
    run.add_argument("--mesh", help="mesh for dtensor-bench, e.g. 4 or 2x2")
    run.add_argument("--ours-json", nargs="+", metavar="FILE",
                     help="reuse saved dtensor-bench JSON (transitions and host records) instead of running it")
    run.add_argument("--no-host-cost", action="store_true", help="skip the host-cost comparison")
    run.add_argument("--overlap", action="store_true",
                     help="compare overlap instead (dtensor-bench --overlap; torch: redistribute(async_op=True)); "
                          "no host cost")
    run.add_argument("--out", default=DEFAULT_OUT, help="output directory (default build/torch_compare)")
    add_torch_options(run)

    tor = sub.add_parser("torch", help="run only the torch side for saved records of ours")
    tor.add_argument("--ours", nargs="+", required=True, metavar="FILE", help="dtensor-bench JSON file(s)")
    tor.add_argument("--out", required=True, metavar="FILE", help="where to write the torch records (JSON)")
    tor.add_argument("--no-host-cost", action="store_true")
    add_torch_options(tor)

    tab = sub.add_parser("table", help="re-print the comparison from saved JSON files (no torch needed)")
    tab.add_argument("--ours", nargs="+", required=True, metavar="FILE", help="dtensor-bench JSON file(s)")
    tab.add_argument("--torch", nargs="+", required=True, metavar="FILE", help="torch-side JSON file(s)")
    tab.add_argument("--out", metavar="DIR", help="also write DIR/torch_compare.json and DIR/torch_compare.md")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:  # internal: one torch rank, started by launch_workers
        _worker_main(argv[1])
        return
    args = parser.parse_args(argv)
    if args.command == "table":
        report(load_records(args.ours), load_records(args.torch), args.out)
    elif args.command == "torch":
        out_dir = os.path.dirname(os.path.abspath(args.out))
        records = run_torch_side(args, load_records(args.ours), out_dir, with_host=not args.no_host_cost)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.out}")
    else:
        out_dir = os.path.abspath(args.out)
        os.makedirs(out_dir, exist_ok=True)
        if args.ours_json:
            ours_paths = args.ours_json
        else:
            ours_paths = [p for p in run_ours(args, out_dir) if p]
        ours_records = load_records(ours_paths)
        torch_records = run_torch_side(args, ours_records, out_dir, with_host=not args.no_host_cost)
        torch_json = os.path.join(out_dir, "torch.json")
        with open(torch_json, "w") as f:
            json.dump(torch_records, f, indent=1)
        print(f"wrote {torch_json}")
        report(ours_records, torch_records, out_dir)


if __name__ == "__main__":
    main()
