#!/usr/bin/env python3
"""Plot dtensor-bench results: busbw vs size and framework overhead vs size, per transition.

Usage:
  python3 bench/plot_dtensor_bench.py FILE.json [FILE2.json ...] [--torch torch_compare.json] [--out DIR]

Each FILE.json is what `dtensor-bench --json FILE` writes: a JSON list of records. Records with
"kind": "transition" are plotted, grouped by (backend, world) into
  dtensor_<backend><world>_busbw.png     busbw (GB/s) vs global tensor size, one line per transition
  dtensor_<backend><world>_overhead.png  time / raw collective time vs size (1.0 and 1.10 target lines)
with one axes per mesh shape. Records with "kind": "host" (host-side costs) are kept out of those
and drawn, when present: those of `--host-cost` (redistribute_us, raw_us and framework_us per
world) as dtensor_<backend>_host.png, bars per world with the 2 us framework target; older ones
(time_us only) as dtensor_<backend><world>_host.png. Records with "kind": "overlap"
(`--overlap`) give dtensor_<backend><world>_overlap.png: exposed vs the local shard size, one line
per transition, the 0.10 target marked. With --torch, the
transition records of bench/torch_compare.py (torch_compare.json) give torch_compare.png: overhead
vs size, ours vs torch, one subplot per transition; its "kind": "host" records, if any, give
torch_compare_host.png (host time per call, ours vs torch). The paths written are printed, one a
line; the default folder is bench/figures/.

Exit status: 0 on success, 2 on a bad argument or a malformed input file (the message names the
file, the record and the missing keys).
"""

import argparse
import json
import math
import os
import sys
from collections import OrderedDict

try:
    import matplotlib
except ImportError:
    print(f"error: matplotlib is not installed for {sys.executable} "
          "(Debian: apt-get install python3-matplotlib, then run /usr/bin/python3)", file=sys.stderr)
    sys.exit(2)

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

OVERHEAD_TARGET = 1.10

# Keys each record kind must carry (values may be null where noted in the plots: busbw <= 0 or
# null and overhead null are skipped point by point).
TRANSITION_KEYS = ("transition", "mesh", "backend", "world", "dtype", "bytes", "busbw_gbps", "overhead")
TORCH_KEYS = ("transition", "mesh", "bytes", "ours_overhead", "torch_overhead", "torch_supported")
TORCH_HOST_KEYS = ("transition", "mesh", "ours_time_us", "torch_time_us", "torch_supported")
OVERLAP_KEYS = ("transition", "mesh", "backend", "world", "local_bytes", "exposed")
FRAMEWORK_TARGET_US = 2.0
EXPOSED_TARGET = 0.10

BUSBW_NOTE = ("busbw = lower-bound bytes per rank / time; the lower bound is what the busiest rank must receive:\n"
              "the elements it needs and does not hold, or for a reduction over k ranks (k-1)/k of its data "
              "(twice that to replicate)")
OVERHEAD_NOTE = "overhead = redistribute time / time of the same raw collective calls alone (1.0 = no framework cost)"


class InputError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Loading and validation


def _load_list(path):
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}")
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON: {e}")
    if not isinstance(data, list):
        raise InputError(f"{path}: the top level is a JSON {type(data).__name__}, expected a list of records "
                         f"(the output of `dtensor-bench --json FILE`)")
    return data


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_record(path, i, rec, keys, numeric, nullable):
    if not isinstance(rec, dict):
        raise InputError(f"{path}: record {i} is a JSON {type(rec).__name__}, expected an object")
    missing = [k for k in keys if k not in rec]
    if missing:
        what = f" (kind '{rec['kind']}')" if "kind" in rec else ""
        raise InputError(f"{path}: record {i}{what}: missing key(s): {', '.join(missing)}")
    for k in numeric:
        v = rec[k]
        if v is None and k in nullable:
            continue
        if not _is_number(v):
            raise InputError(f"{path}: record {i}: key '{k}' is {json.dumps(v)}, expected a number")


def load_bench(path):
    """Returns (transition records, host records, overlap records) of one dtensor-bench JSON file."""
    transitions, hosts, overlaps = [], [], []
    for i, rec in enumerate(_load_list(path)):
        if not isinstance(rec, dict):
            raise InputError(f"{path}: record {i} is a JSON {type(rec).__name__}, expected an object")
        if "kind" not in rec:
            raise InputError(f"{path}: record {i}: missing key(s): kind")
        kind = rec["kind"]
        if kind == "transition":
            _check_record(path, i, rec, TRANSITION_KEYS, ("bytes", "world", "busbw_gbps", "overhead"),
                          nullable=("busbw_gbps", "overhead"))
            if rec["bytes"] <= 0:
                raise InputError(f"{path}: record {i}: key 'bytes' is {rec['bytes']}, expected > 0")
            r = dict(rec)
            r["_file"] = path
            transitions.append(r)
        elif kind == "host":
            r = dict(rec)
            r["_file"] = path
            hosts.append(r)
        elif kind == "overlap":
            _check_record(path, i, rec, OVERLAP_KEYS, ("local_bytes", "exposed"), nullable=())
            overlaps.append(dict(rec))
        # other kinds (headers, summaries) are not plotted
    return transitions, hosts, overlaps


def load_torch(path):
    """Returns (transition rows, host rows) of a torch_compare.json. A record without "kind"
    is a transition row; "host" rows (host cost, torch vs ours) are checked for their own keys."""
    rows, hosts = [], []
    for i, rec in enumerate(_load_list(path)):
        if isinstance(rec, dict) and rec.get("kind") == "host":
            _check_record(path, i, rec, TORCH_HOST_KEYS, ("ours_time_us", "torch_time_us"),
                          nullable=("ours_time_us", "torch_time_us"))
            hosts.append(rec)
        elif isinstance(rec, dict) and rec.get("kind", "transition") != "transition":
            continue  # other kinds are not plotted
        else:
            _check_record(path, i, rec, TORCH_KEYS, ("bytes", "ours_overhead", "torch_overhead"),
                          nullable=("ours_overhead", "torch_overhead"))
            rows.append(rec)
    return rows, hosts


# --------------------------------------------------------------------------------------------
# Axes helpers


def size_label(b):
    """1024 -> '1K', 3 * 2**20 -> '3M', 100 -> '100'."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale:
            v = b / scale
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}{unit}"
    return f"{b:.0f}"


def set_size_axis(ax, sizes):
    """log2 x-axis with ticks at powers of two (every 2nd/4th... when the range is wide)."""
    ax.set_xscale("log", base=2)
    lo, hi = min(sizes), max(sizes)
    e_lo, e_hi = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    step = 1
    while (e_hi - e_lo) / step > 11:
        step *= 2
    first = e_lo - (e_lo % step) if e_lo >= 0 else e_lo
    ticks = [2.0 ** e for e in range(first, e_hi + 1, step) if lo / 1.01 <= 2.0 ** e <= hi * 1.01]
    if not ticks:
        ticks = [lo, hi]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
    ax.xaxis.set_minor_locator(NullLocator())
    pad = 2 ** 0.3
    ax.set_xlim(lo / pad, hi * pad)


def _nice_ratio_ticks(lo, hi):
    """Ticks of a log overhead axis (a log axis spans > 3x; 1.1 is too close to 1 to label there:
    its dashed line and legend entry stay)."""
    if hi / lo > 8:
        cands = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
    else:
        cands = [0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 6, 8]
    return [c for c in cands if lo <= c <= hi]


def set_ratio_axis(ax, values):
    """Overhead y axis: linear when the data stay within ~3x, log otherwise; always shows 1.0 and 1.1."""
    lo = min(min(values), 1.0)
    hi = max(max(values), OVERHEAD_TARGET)
    if hi / lo > 3.0:
        ax.set_yscale("log")
        ax.set_ylim(lo / 1.06, hi * 1.25)
        ax.yaxis.set_major_locator(FixedLocator(_nice_ratio_ticks(lo / 1.06, hi * 1.25)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
    else:
        span = hi - lo
        ax.set_ylim(max(0.0, lo - 0.08 * span), hi + 0.08 * span)


def set_bw_axis(ax, values):
    """busbw y axis: log when the values span more than 30x (small sizes stay visible)."""
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > 30:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        ax.set_ylim(0, hi * 1.08 if hi > 0 else 1)


def ref_lines(ax):
    ax.axhline(1.0, color="0.35", lw=1.0, zorder=1)
    ax.axhline(OVERHEAD_TARGET, color="tab:red", lw=1.2, ls="--", zorder=1)


def ref_handles():
    return [Line2D([], [], color="0.35", lw=1.0, label="1.0 (raw collectives)"),
            Line2D([], [], color="tab:red", lw=1.2, ls="--", label=f"{OVERHEAD_TARGET:.2f} target")]


def legend_label(label):
    """matplotlib leaves out of a legend any label starting with '_', as a strided shard's
    "_S(0,2)" does: a leading space keeps it."""
    return " " + label if label.startswith("_") else label


_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p"]


def style(i, n):
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return dict(color=cmap(i % cmap.N), marker=_MARKERS[i % len(_MARKERS)], markersize=4.5, lw=1.6)


def savefig(fig, out_dir, name, written):
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    written.append(path)


# --------------------------------------------------------------------------------------------
# dtensor-bench figures


def _uniq(values):
    return list(OrderedDict.fromkeys(values))


def _mesh_sort_key(mesh):
    parts = str(mesh).replace("x", " ").split()
    try:
        return (len(parts), [int(p) for p in parts])
    except ValueError:
        return (len(parts), [0], str(mesh))


def series_of(recs):
    """OrderedDict label -> records sorted by bytes. A series is one transition; planner and
    dtype (and input file) join the label only when they vary within the group."""
    vary = {k: len(_uniq(r.get(k) for r in recs)) > 1 for k in ("planner", "dtype", "_file")}
    out = OrderedDict()
    for r in recs:
        label = str(r["transition"])
        extra = []
        if vary["planner"]:
            extra.append(str(r.get("planner")))
        if vary["dtype"]:
            extra.append(str(r.get("dtype")))
        if vary["_file"]:
            extra.append(os.path.splitext(os.path.basename(r["_file"]))[0])
        if extra:
            label += "  [" + ", ".join(extra) + "]"
        out.setdefault(label, []).append(r)
    for label in out:
        out[label].sort(key=lambda r: r["bytes"])
    return out


def group_title(recs, what):
    backend = recs[0]["backend"]
    world = recs[0]["world"]
    dtypes = ", ".join(str(d) for d in _uniq(r["dtype"] for r in recs))
    planners = ", ".join(str(p) for p in _uniq(r.get("planner") for r in recs) if p is not None)
    s = f"dtensor-bench {what}: backend {backend}, world {world}, dtype {dtypes}"
    if planners:
        s += f", planner {planners}"
    return s


def plot_metric(recs, metric, out_dir, name, written):
    """One figure, one axes per mesh, one line per transition. metric: 'busbw' or 'overhead'.
    A transition keeps its colour and marker in both figures (assigned over all its records)."""
    meshes = sorted(_uniq(str(r["mesh"]) for r in recs), key=_mesh_sort_key)
    key = "busbw_gbps" if metric == "busbw" else "overhead"

    def keep(r):
        v = r[key]
        return v is not None and (v > 0)

    panels = []  # (mesh, all series labels, kept records, labels with no kept point)
    for m in meshes:
        mesh_recs = [r for r in recs if str(r["mesh"]) == m]
        all_labels = list(series_of(mesh_recs).keys())
        kept = [r for r in mesh_recs if keep(r)]
        if not kept:
            continue
        kept_labels = set(series_of(kept).keys())
        panels.append((m, all_labels, kept, [lb for lb in all_labels if lb not in kept_labels]))
    if not panels:
        return False

    heights = [max(3.4, 0.22 * len(labels) + 1.4) for _, labels, _, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights) + 0.8),
                             gridspec_kw=dict(height_ratios=heights), squeeze=False, layout="constrained")
    for ax, (mesh, all_labels, rs, absent) in zip(axes[:, 0], panels):
        shape = rs[0].get("mesh_shape")
        series = series_of(rs)
        wrong_x, wrong_y = [], []
        handles, labels = [], []
        for label, pts in series.items():
            xs = [p["bytes"] for p in pts]
            ys = [p[key] for p in pts]
            (line,) = ax.plot(xs, ys, **style(all_labels.index(label), len(all_labels)))
            handles.append(line)
            labels.append(legend_label(label))
            for p in pts:
                if _is_number(p.get("wrong")) and p["wrong"] > 0:
                    wrong_x.append(p["bytes"])
                    wrong_y.append(p[key])
        if wrong_x:
            h = ax.scatter(wrong_x, wrong_y, s=110, marker="x", color="red", lw=2.2, zorder=5)
            handles.append(h)
            labels.append("wrong output (#wrong > 0)")
        set_size_axis(ax, [r["bytes"] for r in rs])
        values = [r[key] for r in rs]
        if metric == "busbw":
            set_bw_axis(ax, values)
            ax.set_ylabel("busbw (GB/s)")
        else:
            ref_lines(ax)
            set_ratio_axis(ax, values)
            ax.set_ylabel("time / raw collective time")
            for h in ref_handles():
                handles.append(h)
                labels.append(h.get_label())
        ax.grid(True, which="major", alpha=0.35)
        mesh_desc = f"mesh {mesh}"
        if isinstance(shape, list) and len(shape) > 1:
            mesh_desc += f" ({len(shape)}-D)"
        ax.set_title(mesh_desc, fontsize=10, loc="left", fontweight="bold")
        if absent:
            why = "no data to move" if metric == "busbw" else "no collective"
            ax.set_title(f"not shown ({why}): " + ", ".join(absent), fontsize=8.5, loc="right", color="0.4")
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5,
                  frameon=False, title="transition", title_fontsize=9)
    axes[-1, 0].set_xlabel("global tensor size (bytes, log2)")
    what = "busbw vs size" if metric == "busbw" else "framework overhead vs size"
    note = BUSBW_NOTE if metric == "busbw" else OVERHEAD_NOTE
    fig.suptitle(group_title(recs, what) + "\n" + note, fontsize=10.5, x=0.0, ha="left")
    savefig(fig, out_dir, name, written)
    return True


HOST_TARGET_US = 5.0


def plot_host(hosts, title, out_dir, name, written):
    """Host-cost records (redistribute with a cached plan on a tiny tensor, one rank): horizontal
    bars of the median time_us per call, min..max as error bars, the 5 us target as a dashed line.
    Records without a numeric time_us are skipped (host records are optional)."""
    rows = [r for r in hosts if _is_number(r.get("time_us"))]
    if not rows:
        return False
    multi_mesh = len(_uniq(str(r.get("mesh")) for r in rows)) > 1
    labels, vals, lo_err, hi_err = [], [], [], []
    for r in rows:
        label = str(r.get("transition") or r.get("name") or r.get("what") or "?")
        extra = [str(r[k]) for k in ("what", "name") if k in r and str(r[k]) not in label]
        if "mesh" in r and (multi_mesh or "[" in label or "," in label):
            extra.append(f"mesh {r['mesh']}")
        if extra:
            label += "  (" + ", ".join(extra) + ")"
        t = r["time_us"]
        tmin, tmax = r.get("time_min_us"), r.get("time_max_us")
        labels.append(label)
        vals.append(t)
        lo_err.append(t - tmin if _is_number(tmin) and tmin <= t else 0.0)
        hi_err.append(tmax - t if _is_number(tmax) and tmax >= t else 0.0)
    fig, ax = plt.subplots(figsize=(9, 1.3 + 0.45 * len(labels)), layout="constrained")
    y = list(range(len(labels)))[::-1]
    ax.barh(y, vals, color="tab:blue", height=0.6, xerr=[lo_err, hi_err],
            error_kw=dict(ecolor="0.3", capsize=3, lw=1))
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=9)
    ax.set_ylim(-0.6, len(labels) - 0.2)
    span = max(max(v + e for v, e in zip(vals, hi_err)), HOST_TARGET_US)
    for yi, v in zip(y, vals):  # above the bar's end, clear of its whisker
        ax.text(v + span * 0.005, yi + 0.31, f"{v:.2f}", ha="left", va="bottom", fontsize=8)
    ax.axvline(HOST_TARGET_US, color="tab:red", ls="--", lw=1.2, label=f"target < {HOST_TARGET_US:g} us")
    ax.set_xlim(0, span * 1.12)
    ax.set_xlabel("host time per redistribute call (us): median, whiskers min..max")
    ax.grid(True, axis="x", alpha=0.35)
    ax.legend(loc="lower right", fontsize=8.5, frameon=True)
    ax.set_title(title, fontsize=10.5, loc="left")
    savefig(fig, out_dir, name, written)
    return True


def plot_host_cost(hosts, title, out_dir, name, written):
    """`--host-cost` records: per world, the redistribute and the raw all_gather (us per call) as
    bars side by side, framework_us = their difference written above, the 2 us target in the
    title's note."""
    rows = sorted((r for r in hosts if _is_number(r.get("redistribute_us")) and _is_number(r.get("raw_us"))),
                  key=lambda r: int(r.get("world", 0)))
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    x = list(range(len(rows)))
    red = [r["redistribute_us"] for r in rows]
    raw = [r["raw_us"] for r in rows]
    ax.bar([i - 0.2 for i in x], red, width=0.4, color="tab:blue", label="cached-plan S(0)->R redistribute")
    ax.bar([i + 0.2 for i in x], raw, width=0.4, color="tab:gray", label="raw all_gather, same bytes")
    top = max(red + raw)
    for i, r in zip(x, rows):
        fw = r.get("framework_us", r["redistribute_us"] - r["raw_us"])
        ok = fw <= FRAMEWORK_TARGET_US
        ax.text(i, max(r["redistribute_us"], r["raw_us"]) + top * 0.02, f"framework {fw:+.2f} us",
                ha="center", va="bottom", fontsize=8.5, color="tab:green" if ok else "tab:red")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r.get('world')} ranks" for r in rows])
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel("us per call (median over repeats)")
    ax.grid(True, axis="y", alpha=0.35)
    ax.legend(loc="upper left", fontsize=8.5)
    ax.set_title(title + f"\nframework = redistribute - raw (target <= {FRAMEWORK_TARGET_US:g} us at 2 and 4 ranks)",
                 fontsize=10, loc="left")
    savefig(fig, out_dir, name, written)
    return True


def plot_overlap(recs, title, out_dir, name, written):
    """`--overlap` records: exposed = (overlapped - compute) / comm vs the local shard size, one
    line per transition (transitions without a collective are left out)."""
    series = OrderedDict()
    for r in recs:
        if r.get("collectives") == 0:
            continue
        series.setdefault(f"{r['transition']} ({r['mesh']})", []).append(r)
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
    sizes = []
    for i, (label, rows) in enumerate(series.items()):
        rows = sorted(rows, key=lambda r: r["local_bytes"])
        xs = [r["local_bytes"] for r in rows]
        sizes += xs
        ax.plot(xs, [r["exposed"] for r in rows], label=label, **style(i, len(series)))
    ax.set_xscale("log", base=2)
    set_size_axis(ax, sorted(set(sizes)))
    ax.axhline(EXPOSED_TARGET, color="tab:red", ls="--", lw=1.2)
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_xlabel("local shard (bytes per rank)")
    ax.set_ylabel("exposed = (overlapped - compute) / comm")
    ax.grid(True, alpha=0.35)
    ax.legend(fontsize=7.5, loc="upper right", ncol=2)
    ax.set_title(title + f"\n0 = the transition fully hidden behind the compute; target <= {EXPOSED_TARGET:g} (dashed)",
                 fontsize=10, loc="left")
    savefig(fig, out_dir, name, written)
    return True


def group_key(r):
    return (str(r["backend"]), str(r["world"]))


def plot_bench(files, out_dir, written):
    transitions, hosts, overlaps = [], [], []
    for path in files:
        t, h, o = load_bench(path)
        if not t and not h and not o:
            print(f"warning: {path}: no transition, host or overlap records", file=sys.stderr)
        transitions += t
        hosts += h
        overlaps += o

    groups = OrderedDict()
    for r in transitions:
        groups.setdefault(group_key(r), []).append(r)
    host_groups, host_cost_groups, overlap_groups = OrderedDict(), OrderedDict(), OrderedDict()
    for r in hosts:
        if "framework_us" in r:
            host_cost_groups.setdefault(str(r.get("backend", "")), []).append(r)
            continue
        k = (str(r.get("backend", "")), str(r.get("world", "")))
        host_groups.setdefault(k, []).append(r)
    for r in overlaps:
        overlap_groups.setdefault(group_key(r), []).append(r)

    for (backend, world), recs in groups.items():
        stem = f"dtensor_{backend}{world}"
        plot_metric(recs, "busbw", out_dir, stem + "_busbw.png", written)
        if not plot_metric(recs, "overhead", out_dir, stem + "_overhead.png", written):
            print(f"warning: {backend} world {world}: no overhead values, no overhead plot", file=sys.stderr)
    for (backend, world), recs in host_groups.items():
        stem = f"dtensor_{backend}{world}" if backend or world else "dtensor"
        title = (f"dtensor-bench host cost: backend {backend or '?'}, world {world or '?'}\n"
                 "redistribute with a cached plan on a tiny tensor, one rank (no data moves between ranks)")
        plot_host(recs, title, out_dir, stem + "_host.png", written)
    for backend, recs in host_cost_groups.items():
        title = f"dtensor-bench --host-cost: backend {backend or '?'}, tiny tensor (8x4 f32), plan cached"
        plot_host_cost(recs, title, out_dir, f"dtensor_{backend or 'local'}_host.png", written)
    for (backend, world), recs in overlap_groups.items():
        title = f"dtensor-bench --overlap: backend {backend}, world {world}"
        plot_overlap(recs, title, out_dir, f"dtensor_{backend}{world}_overlap.png", written)


# --------------------------------------------------------------------------------------------
# torch comparison


def plot_torch(path, out_dir, written):
    recs, hosts = load_torch(path)
    if hosts:
        plot_torch_host(hosts, out_dir, written)
    if not recs:
        print(f"warning: {path}: no transition records, no torch_compare.png", file=sys.stderr)
        return
    panels = OrderedDict()
    meshes = _uniq(str(r["mesh"]) for r in recs)
    for r in recs:
        panels.setdefault((str(r["mesh"]), str(r["transition"])), []).append(r)
    n = len(panels)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.3 * nrows + 0.9), squeeze=False,
                             layout="constrained")
    backend = ", ".join(str(b) for b in _uniq(r.get("ours_backend", "?") for r in recs))
    for idx, ((mesh, transition), rs) in enumerate(panels.items()):
        ax = axes[idx // ncols, idx % ncols]
        rs = sorted(rs, key=lambda r: r["bytes"])
        vals = []
        ours = [(r["bytes"], r["ours_overhead"]) for r in rs if r["ours_overhead"] is not None]
        theirs = [(r["bytes"], r["torch_overhead"]) for r in rs
                  if r["torch_supported"] and r["torch_overhead"] is not None]
        if ours:
            ax.plot(*zip(*ours), color="tab:blue", marker="o", ms=4.5, lw=1.6, label=f"ours ({backend})")
            vals += [v for _, v in ours]
        if theirs:
            ax.plot(*zip(*theirs), color="tab:orange", marker="s", ms=4.5, lw=1.6, label="torch DTensor")
            vals += [v for _, v in theirs]
        ref_lines(ax)
        notes = []
        if not any(r["torch_supported"] for r in rs):
            notes.append("torch: not supported")
        if not vals:
            notes.append("no collective: overhead undefined")
        if notes:
            ax.text(0.97, 0.95, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=8.5,
                    color="tab:orange" if vals else "0.3",
                    bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="0.8", alpha=0.9))
        set_size_axis(ax, [r["bytes"] for r in rs])
        if vals:
            set_ratio_axis(ax, vals)
        ax.grid(True, alpha=0.35)
        ax.set_title(transition + (f"   (mesh {mesh})" if len(meshes) > 1 or mesh else ""), fontsize=10)
        if idx % ncols == 0:
            ax.set_ylabel("time / raw collective time")
        if idx // ncols == nrows - 1 or idx + ncols >= n:
            ax.set_xlabel("global tensor size (bytes)")
    for idx in range(n, nrows * ncols):
        axes[idx // ncols, idx % ncols].set_visible(False)
    handles = [Line2D([], [], color="tab:blue", marker="o", ms=4.5, lw=1.6, label=f"ours ({backend})"),
               Line2D([], [], color="tab:orange", marker="s", ms=4.5, lw=1.6, label="torch DTensor")]
    handles += ref_handles()
    fig.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
               fontsize=9, frameon=False)
    fig.suptitle("Framework overhead vs size, ours vs torch DTensor\n"
                 "overhead = redistribute time / time of the same raw collective calls alone",
                 fontsize=10.5, x=0.0, ha="left")
    savefig(fig, out_dir, "torch_compare.png", written)


def plot_torch_host(hosts, out_dir, written):
    """torch_compare_host.png: host time per redistribute call, ours vs torch, grouped bars."""
    rows = [r for r in hosts if _is_number(r["ours_time_us"]) or _is_number(r["torch_time_us"])]
    if not rows:
        return False
    labels = []
    for r in rows:
        label = str(r["transition"])
        if "[" in label or "," in label or len(_uniq(str(h["mesh"]) for h in rows)) > 1:
            label += f"  (mesh {r['mesh']})"
        labels.append(label)
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.6 * len(rows)), layout="constrained")
    n = len(rows)
    y = [n - 1 - i for i in range(n)]
    h = 0.38
    ours = [r["ours_time_us"] if _is_number(r["ours_time_us"]) else 0.0 for r in rows]
    theirs = [r["torch_time_us"] if (r["torch_supported"] and _is_number(r["torch_time_us"])) else 0.0 for r in rows]
    backend = ", ".join(str(b) for b in _uniq(r.get("ours_backend", "?") for r in rows))
    ax.barh([v + h / 2 for v in y], ours, height=h, color="tab:blue", label=f"ours ({backend})")
    ax.barh([v - h / 2 for v in y], theirs, height=h, color="tab:orange", label="torch DTensor")
    vmax = max(ours + theirs + [HOST_TARGET_US])
    vmin = min([v for v in ours + theirs if v > 0] or [1.0])
    log = vmax / vmin > 30
    if log:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    for yi, v, t, r in zip(y, ours, theirs, rows):
        if v > 0:
            ax.text(v * (1.03 if log else 1) + (0 if log else vmax * 0.01), yi + h / 2, f"{v:.3g}",
                    va="center", fontsize=8)
        if t > 0:
            ax.text(t * (1.03 if log else 1) + (0 if log else vmax * 0.01), yi - h / 2, f"{t:.3g}",
                    va="center", fontsize=8)
        elif not r["torch_supported"]:
            ax.text(vmin if log else 0, yi - h / 2, " torch: not supported", va="center", fontsize=8,
                    color="tab:orange")
    ax.axvline(HOST_TARGET_US, color="tab:red", ls="--", lw=1.2, label=f"target < {HOST_TARGET_US:g} us")
    if log:
        ax.set_xlim(vmin / 1.5, vmax * 2.0)
    else:
        ax.set_xlim(0, vmax * 1.15)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=9)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlabel("host time per redistribute call (us, median)" + (", log scale" if log else ""))
    ax.grid(True, axis="x", alpha=0.35)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5)
    ax.set_title("Host cost, ours vs torch DTensor: redistribute on a tiny tensor, one rank", fontsize=10.5, loc="left")
    savefig(fig, out_dir, "torch_compare_host.png", written)
    return True


# --------------------------------------------------------------------------------------------


def main(argv=None):
    default_out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
    ap = argparse.ArgumentParser(
        description="Plot dtensor-bench JSON: busbw vs size and overhead vs size per transition (PNG).")
    ap.add_argument("files", nargs="*", metavar="FILE.json", help="output of `dtensor-bench --json FILE`")
    ap.add_argument("--torch", metavar="JSON", help="torch comparison records (bench/torch_compare.py)")
    ap.add_argument("--out", metavar="DIR", default=default_out, help=f"output folder (default {default_out})")
    args = ap.parse_args(argv)
    if not args.files and not args.torch:
        ap.error("give at least one FILE.json or --torch JSON")

    written = []
    try:
        # Validate every input before drawing anything.
        for path in args.files:
            load_bench(path)
        if args.torch:
            load_torch(args.torch)
        os.makedirs(args.out, exist_ok=True)
        if args.files:
            plot_bench(args.files, args.out, written)
        if args.torch:
            plot_torch(args.torch, args.out, written)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    if not written:
        print("error: nothing to plot", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
