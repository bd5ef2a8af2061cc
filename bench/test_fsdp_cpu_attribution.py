#!/usr/bin/env python3
"""Offline test of bench/fsdp_cpu_attribution.py on a made-up trace and perf script (no perf, no
build): the offset between them is found, samples land in their windows, a step's samples minus
compute alone's come out per symbol, kernel symbols are marked, bad input exits 2.

Run:  python3 bench/test_fsdp_cpu_attribution.py        (exit status 0 = pass)
"""
import contextlib
import io
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fsdp_cpu_attribution as fca  # noqa: E402
from fake_programs import Checks  # noqa: E402

check = Checks()
OFFSET = 1234.5  # perf time = trace time + OFFSET
# Rank 0's windows (s): compute alone 1 s, communication alone 0.1 s, FSDP step 1.2 s; a rank-1
# window and another lane's event, which must be ignored.
WINDOWS = [(1.0, 2.0, "compute alone"), (2.1, 2.2, "communication alone, contiguous"),
           (2.3, 3.5, "FSDP step, contiguous, prefetch 1")]


def trace():
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "compute"}},
              {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "waits"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "compute"}}]
    for a, b, n in WINDOWS:
        events.append({"ph": "X", "name": n, "pid": 0, "tid": 0, "ts": a * 1e6, "dur": (b - a) * 1e6})
    events.append({"ph": "X", "name": "compute alone", "pid": 1, "tid": 0, "ts": 5e6, "dur": 1e6})
    events.append({"ph": "X", "name": "FSDP unshard wait", "pid": 0, "tid": 1, "ts": 2.4e6, "dur": 1e3})
    return {"traceEvents": events}


def perf_lines():
    """1 sample per ms (--freq 1000): GEMM through compute alone and the step; memmove through the
    communication window and the step's first 50 ms; a kernel symbol in the step's last 10 ms."""
    lines = []

    def add(t, sym, dso="fsdp-bench"):
        lines.append(f" 4242 {t + OFFSET:.6f}:      7f00deadbeef {sym} ({dso})")
    for k in range(1000):
        add(1.0 + (k + 0.5) / 1e3, "Eigen::internal::gebp_kernel<float>::operator()")
    for k in range(100):
        add(2.1 + (k + 0.5) / 1e3, "__memmove_avx512_unaligned_erms", "/usr/lib/libc.so.6")
    for k in range(1200):
        add(2.3 + (k + 0.5) / 1e3, "Eigen::internal::gebp_kernel<float>::operator()")
    for k in range(50):
        add(2.3 + (k + 0.25) / 1e3, "__memmove_avx512_unaligned_erms", "/usr/lib/libc.so.6")
    for k in range(10):
        add(3.49 + (k + 0.25) / 1e3, "finish_task_switch.isra.0", "[kernel.kallsyms]")
    add(-0.5, "startup")  # before the trace's first event (perf starts first), outside every window
    lines.append(" 4242 99.000000: garbage line")
    return lines


def main():
    wins = fca.windows(trace())
    check(wins == WINDOWS, f"windows: rank 0's lane compute only, in order: {wins}")
    samp = fca.samples(perf_lines())
    check(len(samp) == 1000 + 100 + 1200 + 50 + 10 + 1, f"samples parsed, the garbage line skipped ({len(samp)})")
    check(("[kernel] finish_task_switch.isra.0" in {s for _, s in samp}), "kernel symbols marked [kernel]")
    off, _ = fca.align(wins, samp, "gebp_kernel", step=0.001)
    check(abs(off - OFFSET) <= 0.002, f"offset found: {off} vs {OFFSET}")
    per = fca.attribute(wins, samp, OFFSET)
    n, step = per["FSDP step, contiguous, prefetch 1"]
    check(n == 1 and step["__memmove_avx512_unaligned_erms"] == 50 and step["[kernel] finish_task_switch.isra.0"] == 10
          and step["Eigen::internal::gebp_kernel<float>::operator()"] == 1200, f"step window's samples: {dict(step)}")
    check(per["communication alone, contiguous"][1]["__memmove_avx512_unaligned_erms"] == 100, "comm window's samples")

    with tempfile.TemporaryDirectory() as tmp:
        t, p = os.path.join(tmp, "t.json"), os.path.join(tmp, "perf.txt")
        with open(t, "w") as f:
            json.dump(trace(), f)
        with open(p, "w") as f:
            f.write("\n".join(perf_lines()) + "\n")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = fca.main([t, p, "--freq", "1000"])
        text = out.getvalue()
        check(rc == 0 and "FSDP step, contiguous, prefetch 1 minus compute alone" in text
              and "      200.0  Eigen::internal::gebp_kernel" in text and "       50.0  __memmove" in text
              and "compute alone: 1 windows, 1000.0 CPU ms per window" in text,
              f"report: step minus compute alone per symbol, in CPU ms:\n{text}")
        with open(p, "w") as f:
            f.write("nothing\n")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = fca.main([t, p])
        check(rc == 2 and "no samples" in err.getvalue(), f"no samples: exit 2 naming it ({rc}, {err.getvalue()!r})")
        with contextlib.redirect_stderr(err):
            rc = fca.main([t, p, "--freq", "0"])
        check(rc == 2, "--freq 0: exit 2")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
