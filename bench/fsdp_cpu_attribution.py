#!/usr/bin/env python3
"""Where an FSDP step's extra CPU time goes: perf samples of an fsdp-bench run, split by the
measured windows of its --trace (rank 0's `compute alone`, `communication alone, <layout>`,
`FSDP step, <layout>, prefetch K`), per symbol, and each step's samples minus compute alone's.

    perf record -k CLOCK_MONOTONIC -F 999 -o perf.data -- \\
        build/bench/fsdp-bench --dp-shard 4 --dim 512 --layers 8 --prefetch 1 --iters 3 --trace t.json
    perf script -i perf.data -F tid,time,ip,sym,dso > perf.txt
    python3 bench/fsdp_cpu_attribution.py t.json perf.txt [--freq 999] [--top 25]

The trace's times start at its first event, perf's at boot: the offset between them is the one
(searched in 5 ms steps over the recording) that puts the most samples of the compute marker
symbol (--marker, default Eigen's GEMM kernel `gebp_kernel`) inside compute windows and the fewest
inside communication-alone windows (which run no GEMM); the chosen offset and its score are
printed. CPU ms = samples / --freq (perf's sampling rate), all threads of the process.
"""
import argparse
import bisect
import collections
import json
import re
import sys

SAMPLE = re.compile(r"^\s*(\d+)\s+([\d.]+):\s+\S+\s+(.*?)\s+\((.*)\)\s*$")


def windows(trace):
    """Rank 0's measured windows on lane `compute`: [(start s, end s, name)] in time order."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    out = []
    for e in events:
        if e.get("ph") != "X" or e["pid"] != 0 or lanes.get((0, e["tid"])) != "compute":
            continue
        n = e["name"]
        if n == "compute alone" or n.startswith("communication alone") or n.startswith("FSDP step"):
            out.append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, n))
    return sorted(out)


def samples(lines):
    """perf script -F tid,time,ip,sym,dso lines -> [(time s, symbol)] in time order; kernel
    symbols prefixed with [kernel]."""
    out = []
    for line in lines:
        m = SAMPLE.match(line)
        if m:
            sym = m.group(3) or "[unknown]"
            out.append((float(m.group(2)), ("[kernel] " + sym) if m.group(4).startswith("[kernel") else sym))
    return sorted(out)


def align(wins, samp, marker, step=0.005):
    """The offset (s) with perf time = trace time + offset that scores best; (offset, score).
    REQUIRES: perf started before the traced process (offsets from its first sample on)."""
    times = [t for t, _ in samp]
    if not wins or not samp:
        raise ValueError("no measured windows in the trace or no samples in the perf script")
    span = wins[-1][1]
    best = None
    k = 0
    while times[0] + k * step + span <= times[-1] + step:
        off = times[0] + k * step
        score = 0
        for a, b, n in wins:
            i, j = bisect.bisect_left(times, a + off), bisect.bisect_left(times, b + off)
            hits = sum(1 for _, s in samp[i:j] if marker in s)
            score += -10 * hits if n.startswith("communication") else hits
        if best is None or score > best[1]:
            best = (off, score)
        k += 1
    if best is None:
        raise ValueError("the perf recording is shorter than the trace's windows")
    return best


def attribute(wins, samp, off):
    """{window name: (windows, Counter symbol -> samples)}."""
    times = [t for t, _ in samp]
    out = {}
    for a, b, n in wins:
        count, agg = out.get(n, (0, collections.Counter()))
        i, j = bisect.bisect_left(times, a + off), bisect.bisect_left(times, b + off)
        agg.update(s for _, s in samp[i:j])
        out[n] = (count + 1, agg)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("perf_script")
    ap.add_argument("--freq", type=float, default=999.0, help="perf record -F")
    ap.add_argument("--marker", default="gebp_kernel", help="a symbol that runs only in compute")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.freq <= 0 or args.top < 1:
        print(f"fsdp_cpu_attribution: --freq {args.freq} / --top {args.top}: expected > 0", file=sys.stderr)
        return 2
    with open(args.trace) as f:
        wins = windows(json.load(f))
    with open(args.perf_script) as f:
        samp = samples(f)
    try:
        off, score = align(wins, samp, args.marker)
    except ValueError as e:
        print(f"fsdp_cpu_attribution: {e}", file=sys.stderr)
        return 2
    print(f"offset {off:.3f} s (score {score})")
    per = attribute(wins, samp, off)
    ms = 1e3 / args.freq
    for n, (count, agg) in per.items():
        print(f"{n}: {count} windows, {sum(agg.values()) / count * ms:.1f} CPU ms per window (all threads)")
    base_n, base = per.get("compute alone", (0, collections.Counter()))
    for n, (count, agg) in per.items():
        if n == "compute alone":
            continue
        if n.startswith("FSDP step") and base_n:
            diff = {k: agg[k] / count - base[k] / base_n for k in set(agg) | set(base)}
            title = f"{n} minus compute alone"
        else:
            diff = {k: v / count for k, v in agg.items()}
            title = n
        print(f"\n{title}, CPU ms per window (all threads):")
        for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
            print(f"  {v * ms:9.1f}  {k[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
