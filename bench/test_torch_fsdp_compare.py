#!/usr/bin/env python3
"""Offline test of bench/torch_fsdp_compare.py (and the pieces it shares with torch_train_compare.py).
No torch and no C++ build needed.

Run:  python3 bench/test_torch_fsdp_compare.py        (from anywhere; exit status 0 = pass)

It runs the script as a user would, with ours played by a fake `fsdp-train` (a small Python program
in a temporary build directory that prints fsdp-train's progress lines and last-line JSON, and logs
its command line) and torch's side taken from a recorded --torch-only JSON (--torch-json), then
checks: the flags each config passes to fsdp-train (and to a fake `fsdp-bench` for exposed
communication), the merged record (exposed communication ours vs torch, wall and CPU time, and its
targets; no verdict where the step beat compute alone) (max relative loss
difference, step-time ratio from the medians without the first step, ours' peak bytes from the
JSON and the per-kind peaks from the progress line, null when fsdp-train reports none), exit 1
when the losses differ beyond the tolerance, exit 2 on a bad config; the config names, the data
split over dp ranks, the progress-line parser on today's fsdp-train format; and that importing
either script does not import torch.
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_fsdp_compare.py")
sys.path.insert(0, HERE)
import torch_fsdp_compare as tfc  # noqa: E402
import torch_train_compare as ttc  # noqa: E402
from fake_programs import Checks, imports_torch, install_fake, read_calls  # noqa: E402

check = Checks()
STEPS = 4


def close(a, b, tol=1e-9):
    return a is not None and b is not None and abs(a - b) <= tol * max(1.0, abs(b))


# The fake fsdp-train: loss of step s = 4 - 0.25 s (times 1 + FAKE_PERTURB), step ms 10 + s
# (the first step 100), peak_bytes 5000 + world in the JSON unless FAKE_NO_PEAK is set; with
# FAKE_DETAIL the progress line also carries peak_param_bytes 111 and peak_grad_bytes 222.
FAKE = r'''def opt(name, default):
    return int(args[args.index(name) + 1]) if name in args else default
steps = opt("--steps", 20)
world = opt("--dp-shard", 1) * opt("--dp-replicate", 1) * opt("--tp", 1)
perturb = float(os.environ.get("FAKE_PERTURB", "0"))
losses = []
for s in range(steps):
    loss = (4 - 0.25 * s) * (1 + perturb)
    losses.append(loss)
    ms = 100.0 if s == 0 else 10.0 + s
    extra = " peak_param_bytes 111 peak_grad_bytes 222" if os.environ.get("FAKE_DETAIL") else ""
    print(f"step {s + 1}/{steps} loss {loss:.9g} ms {ms:.3f} tokens/s 1000 peak_bytes 4000{extra}")
summary = {"steps": steps, "first_loss": losses[0], "last_loss": losses[-1], "parity": "skipped",
           "max_rel_loss_diff": None, "max_param_diff": None, "tokens_per_s": 1000}
if not os.environ.get("FAKE_NO_PEAK"):
    summary["peak_bytes"] = 5000 + world
print(json.dumps(summary))
'''


# The fake fsdp-bench: writes its --json with one padded prefetch 1 row, step FAKE_BENCH_STEP ms
# (default 30), compute 20 ms, comm FAKE_BENCH_COMM ms (default 50): exposed (30 - 20) / 50 = 0.2;
# CPU time step 60, compute 40, comm 25 ms: exposed_cpu 0.8; logs its command line.
FAKE_BENCH = r'''comm = float(os.environ.get("FAKE_BENCH_COMM", "50"))
step = float(os.environ.get("FAKE_BENCH_STEP", "30"))
rows = [{"layout": "padded", "prefetch": 1, "step_ms": step, "compute_ms": 20.0, "comm_ms": comm,
         "exposed": (step - 20.0) / comm, "step_cpu_ms": 60.0, "compute_cpu_ms": 40.0, "comm_cpu_ms": 25.0,
         "exposed_cpu": 0.8, "peak_bytes": 1, "copy_bytes_per_step": 0}]
with open(args[args.index("--json") + 1], "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
'''

# torch's exposed parts in the record (fsdp4, hsdp2x2): step 60 ms, compute 20, comm 80 -> 0.5;
# CPU time 70, 30, 40 -> 1.0.
TORCH_EXPOSED = {"step_ms": 60.0, "compute_ms": 20.0, "lost_ms": 40.0, "comm_ms": 80.0, "exposed": 0.5,
                 "collective_ms": 8.889, "step_cpu_ms": 70.0, "compute_cpu_ms": 30.0, "comm_cpu_ms": 40.0,
                 "exposed_cpu": 1.0}


def torch_record():
    """What a --torch-only run prints last: torch losses 4 - 0.25 s exactly, step 20 ms, peak 8000."""
    configs = []
    for name in ("fsdp4", "hsdp2x2", "fsdp2xtp2"):
        configs.append({"config": name, "torch_losses": [4 - 0.25 * s for s in range(STEPS)], "torch_step_ms": 20.0,
                        "torch_peak_bytes": 8000, "torch_peak_breakdown": {"Total": 8000},
                        "torch_peak_rss_delta_bytes": 123456, "torch_ref_max_rel_diff": 2e-7, "world": 4,
                        "torch_exposed_parts": None if name == "fsdp2xtp2" else TORCH_EXPOSED})
    return json.dumps({"max_rel_loss_diff": None, "torch_only": True, "configs": configs})


def run(build, torch_json, log, configs="fsdp4,hsdp2x2,fsdp2xtp2", env_extra=None, extra=()):
    env = dict(os.environ, FAKE_LOG=log, FAKE_BENCH_LOG=log + ".bench", **(env_extra or {}))
    for k in ("FAKE_PERTURB", "FAKE_NO_PEAK", "FAKE_DETAIL", "FAKE_BENCH_COMM", "FAKE_BENCH_STEP"):
        if k not in (env_extra or {}):
            env.pop(k, None)
    cmd = [sys.executable, SCRIPT, "--build-dir", build, "--torch-json", torch_json, "--configs", configs,
           "--steps", str(STEPS), "--cores", "4"] + list(extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
    try:
        data = json.loads(last)
    except json.JSONDecodeError:
        data = {}
    return proc, data


def main():
    # Pure pieces.
    c = tfc.parse_config("fsdp4")
    check(c["ours"] == ["--dp-shard", "4"] and c["world"] == 4 and c["dp"] == 4 and c["kind"] == "fsdp", "fsdp4")
    c = tfc.parse_config("hsdp2x2")
    check(c["ours"] == ["--dp-replicate", "2", "--dp-shard", "2"] and c["world"] == 4 and c["mesh"] == [2, 2]
          and c["dp"] == 4, "hsdp2x2")
    c = tfc.parse_config("fsdp2xtp2")
    check(c["ours"] == ["--dp-shard", "2", "--tp", "2"] and c["world"] == 4 and c["dp"] == 2 and c["tp"] == 2,
          "fsdp2xtp2")
    c = tfc.parse_config("fsdp3-mpi")
    check(c["backend"] == "mpi" and c["world"] == 3, "fsdp3-mpi")
    for bad in ("fsdp", "tp2", "hsdp2", "fsdp0", "fsdp2xtp2x2"):
        try:
            tfc.parse_config(bad)
            check(False, f"parse_config({bad!r}) raises")
        except ValueError as e:
            check(bad in str(e), f"parse_config({bad!r}) raises naming it")
    cases = 0
    for batch, accum, dp in ((8, 1, 4), (8, 2, 2), (12, 3, 4), (8, 1, 1), (16, 2, 8)):
        for step in (0, 3):
            for m in range(accum):
                micro = batch // accum
                got = []
                for d in range(dp):
                    first, count = tfc.dp_rows(step, m, batch, accum, d, dp)
                    got.extend(range(first, first + count))
                check(got == list(range(step * batch + m * micro, step * batch + (m + 1) * micro)),
                      f"dp_rows batch {batch} accum {accum} dp {dp} step {step} micro {m}: the microbatch, in order")
                cases += 1
    check(cases == 18, f"dp_rows: 18 cases ran ({cases})")
    today = ("step 1/2 loss 4.15 ms 6.5 tokens/s 41234 peak_bytes 1234567\n"
             "step 2/2 loss 3.9 ms 5.5 tokens/s 41234 peak_bytes 1234567\n"
             '{"steps":2,"first_loss":4.15,"last_loss":3.9,"parity":"skipped","max_rel_loss_diff":null,'
             '"max_param_diff":null,"tokens_per_s":41234,"peak_bytes":1234567}\n')
    p = ttc.parse_progress(today)
    check(p["losses"] == [4.15, 3.9] and p["ms"] == [6.5, 5.5] and p["summary"]["peak_bytes"] == 1234567
          and p["last_progress"]["peak_bytes"] == 1234567.0, "parse_progress on today's fsdp-train output")
    p = ttc.parse_progress("step 1/1 loss 2.5 ms 3 tokens/s 9 peak_bytes 7 peak param 1 grad\nstep 1/1 total\n{}\n")
    check(p["losses"] == [2.5] and p["ms"] == [3.0] and p["summary"] == {},
          "parse_progress: loss and ms survive an odd tail; a line without them is skipped")
    check(ttc.max_rel_diff([1.0, 2.2], [1.0, 2.0]) == abs(2.2 - 2.0) / 2.0, "max_rel_diff")
    parts = [{"step_s": 0.030, "compute_s": 0.020, "comm_s": 0.010, "collectives": 4},
             {"step_s": 0.050, "compute_s": 0.021, "comm_s": 0.020, "collectives": 4},
             {"step_s": 0.031, "compute_s": 0.019, "comm_s": 0.012, "collectives": 4}, None]
    e = tfc.exposed_summary(parts)
    check(e == {"step_ms": 31.0, "compute_ms": 20.0, "comm_ms": 12.0, "lost_ms": 11.0, "exposed": 0.917,
               "collective_ms": 3.0, "step_cpu_ms": None, "compute_cpu_ms": None, "comm_cpu_ms": None,
               "exposed_cpu": None},
          f"exposed_summary: per-part medians over repeats, then (31 - 20) / 12; no CPU figures: {e}")
    cpu_parts = [dict(p, step_cpu_s=0.06 + i / 1e3, compute_cpu_s=0.04, comm_cpu_s=0.02 + i / 1e3)
                 for i, p in enumerate(parts[:3])]
    e = tfc.exposed_summary(cpu_parts + [dict(parts[0])])
    check(e["exposed_cpu"] is None, f"exposed_summary: a part without CPU figures -> none: {e}")
    e = tfc.exposed_summary(cpu_parts)
    check(e["step_cpu_ms"] == 61.0 and e["compute_cpu_ms"] == 40.0 and e["comm_cpu_ms"] == 21.0
          and e["exposed_cpu"] == 1.0, f"exposed_summary: CPU medians 61, 40, 21 -> (61 - 40) / 21: {e}")
    check(tfc.exposed_summary([None]) is None, "exposed_summary: nothing measured -> None")

    class P:  # a parameter's shape, as flat_reduce_numel reads it
        def __init__(self, *shape):
            self.shape = shape

        def numel(self):
            n = 1
            for d in self.shape:
                n *= d
            return n
    check(tfc.flat_reduce_numel([P(10, 3), P(4), P(1, 5)], 4) == 12 * 3 + 4 + 4 * 5,
          "flat_reduce_numel: dim 0 padded to whole shards (10x3 -> 12x3, 4, 1x5 -> 4x5)")

    with tempfile.TemporaryDirectory() as tmp:
        build = os.path.join(tmp, "build")
        install_fake(build, "examples/fsdp-train", FAKE)
        install_fake(build, "bench/fsdp-bench", FAKE_BENCH, log_env="FAKE_BENCH_LOG")
        torch_json = os.path.join(tmp, "torch.json")
        with open(torch_json, "w") as f:
            f.write("torch_fsdp_compare noise line\n" + torch_record() + "\n")
        log = os.path.join(tmp, "log")

        # Agreement: losses equal, ratio (11, 12, 13 -> median 12) / 20 = 0.6, peaks 5004 / 8000.
        proc, data = run(build, torch_json, log, env_extra={"FAKE_DETAIL": "1"})
        check(proc.returncode == 0, f"agreeing run exits 0 (stderr: {proc.stderr.strip()[-300:]!r})")
        calls = read_calls(log)
        check(len(calls) == 3, f"fsdp-train ran once per config ({len(calls)})")
        flags = [" ".join(c[:c.index("--log-every")]) for c in calls]
        check(flags == ["--backend local --dp-shard 4", "--backend local --dp-replicate 2 --dp-shard 2",
                        "--backend local --dp-shard 2 --tp 2"], f"ours' layout flags: {flags}")
        check(all("--threads" in c and c[c.index("--threads") + 1] == "1" for c in calls), "--threads cores / world")
        check(all("--steps" in c and c[c.index("--steps") + 1] == str(STEPS) and "--mp" not in c for c in calls),
              "--steps passed, no --mp for fp32")
        by = {r["config"]: r for r in data.get("configs", [])}
        check(sorted(by) == ["fsdp2xtp2", "fsdp4", "hsdp2x2"], f"one record per config: {sorted(by)}")
        r = by.get("fsdp4", {})
        check(close(r.get("max_rel_loss_diff"), 0.0, 1e-12), "fsdp4 max_rel_loss_diff 0")
        check(close(r.get("ours_step_ms"), 12.0) and close(r.get("torch_step_ms"), 20.0) and close(r.get("ratio"), 0.6),
              f"fsdp4 step ms 12 / 20 = 0.6: {r.get('ours_step_ms')} {r.get('torch_step_ms')} {r.get('ratio')}")
        check(r.get("ours_peak_bytes") == 5004 and r.get("torch_peak_bytes") == 8000 and close(r.get("peak_ratio"), 0.6255, 1e-3),
              f"fsdp4 peaks 5004 / 8000: {r.get('ours_peak_bytes')} {r.get('torch_peak_bytes')} {r.get('peak_ratio')}")
        check(r.get("ours_peak_detail") == {"peak_param_bytes": 111, "peak_grad_bytes": 222},
              f"fsdp4 per-kind peaks from the progress line: {r.get('ours_peak_detail')}")
        for key in ("config", "max_rel_loss_diff", "ours_step_ms", "torch_step_ms", "ratio", "ours_peak_bytes",
                    "torch_peak_bytes", "torch_ref_max_rel_diff", "ours_losses", "torch_losses"):
            check(all(key in rec for rec in by.values()), f"every record has {key}")
        check(close(data.get("max_rel_loss_diff"), 0.0, 1e-12) and data.get("tolerance") == 1e-4, "top-level JSON")

        # Exposed communication: fsdp-bench once per FSDP / HSDP config (no TP), FSDP2's defaults.
        bench_calls = read_calls(log + ".bench")
        check(len(bench_calls) == 2, f"fsdp-bench ran for fsdp4 and hsdp2x2 only ({len(bench_calls)})")
        if len(bench_calls) == 2:
            flags = [" ".join(c[:c.index("--layers")]) for c in bench_calls]
            check(flags == ["--backend local --dp-shard 4", "--backend local --dp-replicate 2 --dp-shard 2"],
                  f"fsdp-bench layout flags: {flags}")
            c = bench_calls[0]
            got = {k: c[c.index(k) + 1] for k in ("--layers", "--dim", "--heads", "--vocab", "--seq", "--batch",
                                                   "--threads", "--prefetch", "--layouts", "--iters")}
            check(got == {"--layers": "2", "--dim": "64", "--heads": "4", "--vocab": "64", "--seq": "32", "--batch": "8",
                          "--threads": "1", "--prefetch": "1", "--layouts": "padded", "--iters": "5"},
                  f"fsdp-bench: the same model, prefetch 1, padded, 5 rounds: {got}")
        # fsdp4: ours (30 - 20) / 50 = 0.2 over 3 x 3 collectives (5.556 ms each: the absolute
        # target applies and is missed), torch 0.5: ours <= torch.
        o = r.get("ours_exposed_parts") or {}
        check(close(o.get("exposed"), 0.2) and close(o.get("collective_ms"), 5.5556, 1e-4) and close(o.get("comm_ms"), 50.0)
              and close(o.get("exposed_cpu"), 0.8) and close(o.get("comm_cpu_ms"), 25.0),
              f"fsdp4 ours exposed parts (CPU from fsdp-bench's JSON): {o}")
        check(close(r.get("ours_exposed"), 0.2) and close(r.get("torch_exposed"), 0.5)
              and r.get("exposed_vs_torch_ok") is True and r.get("exposed_absolute_applies") is True
              and r.get("exposed_absolute_ok") is False,
              f"fsdp4 exposed verdict: {[r.get(k) for k in ('ours_exposed', 'torch_exposed', 'exposed_vs_torch_ok', 'exposed_absolute_applies', 'exposed_absolute_ok')]}")
        h = by.get("hsdp2x2", {}).get("ours_exposed_parts") or {}
        check(close(h.get("collective_ms"), 50.0 / 12, 1e-3), f"hsdp2x2: 3 groups x 4 collectives: {h}")
        t = by.get("fsdp2xtp2", {})
        check(t.get("ours_exposed_parts") is None and t.get("exposed_vs_torch_ok") is None
              and t.get("exposed_absolute_applies") is False, "fsdp2xtp2: no exposed figures (fsdp-bench has no TP)")
        check("| fsdp4 | ours | 30.00 | 20.00 | 10.00 | 50.00 | 5.556 | 0.200 | 0.800 | ours <= torch: yes; <= 0.1: no |"
              in proc.stdout
              and "| fsdp4 | torch | 60.00 | 20.00 | 40.00 | 80.00 | 8.889 | 0.500 | 1.000 |" in proc.stdout
              and "| fsdp2xtp2 |" not in proc.stdout, "the exposed table: ours and torch side by side")

        # Collectives under 1 ms each: the absolute target does not apply; ours > torch is reported.
        proc, data = run(build, torch_json, log, configs="fsdp4", env_extra={"FAKE_BENCH_COMM": "5"})
        r = (data.get("configs") or [{}])[0]
        check(proc.returncode == 0 and close(r.get("ours_exposed"), 2.0) and r.get("exposed_absolute_applies") is False
              and r.get("exposed_absolute_ok") is None and r.get("exposed_vs_torch_ok") is False,
              f"collectives of 0.56 ms: only ours <= torch applies, and fails: {r.get('exposed_vs_torch_ok')}")
        # A step faster than compute alone (load): no verdict, a note, the figures still shown.
        proc, data = run(build, torch_json, log, configs="fsdp4", env_extra={"FAKE_BENCH_STEP": "15"})
        r = (data.get("configs") or [{}])[0]
        check(proc.returncode == 0 and close(r.get("ours_exposed"), -0.1) and r.get("exposed_vs_torch_ok") is None
              and r.get("exposed_absolute_ok") is None and "ours" in (r.get("exposed_note") or "")
              and "not a figure" in proc.stdout,
              f"step 15 ms < compute 20 ms: no verdict, noted: {[r.get(k) for k in ('ours_exposed', 'exposed_note')]}")
        # --exposed-iters 0: no fsdp-bench run, null figures; a negative count is refused.
        open(log + ".bench", "w").close()
        proc, data = run(build, torch_json, log, configs="fsdp4", extra=["--exposed-iters", "0"])
        r = (data.get("configs") or [{}])[0]
        with open(log + ".bench") as f:
            check(proc.returncode == 0 and not f.read() and r.get("ours_exposed_parts") is None
                  and r.get("exposed_vs_torch_ok") is None, "--exposed-iters 0: no fsdp-bench, no exposed figures")
        proc, _ = run(build, torch_json, log, configs="fsdp4", extra=["--exposed-iters", "-1"])
        check(proc.returncode == 2 and "--exposed-iters -1" in proc.stderr, "--exposed-iters -1: exit 2 naming it")

        # No peak_bytes in fsdp-train's JSON: null, not a made-up number.
        proc, data = run(build, torch_json, log, configs="hsdp2x2", env_extra={"FAKE_NO_PEAK": "1"})
        r = (data.get("configs") or [{}])[0]
        check(proc.returncode == 0 and "ours_peak_bytes" in r and r["ours_peak_bytes"] is None
              and r.get("peak_ratio") is None, "ours_peak_bytes null when fsdp-train reports none")

        # Losses 1e-3 apart: exit 1, the difference reported.
        proc, data = run(build, torch_json, log, configs="fsdp2xtp2", env_extra={"FAKE_PERTURB": "1e-3"})
        check(proc.returncode == 1, f"1e-3 relative loss difference exits 1 (got {proc.returncode})")
        check(close(data.get("max_rel_loss_diff"), 1e-3, 1e-6), f"reported {data.get('max_rel_loss_diff')}")
        # ... within a looser tolerance it passes; --mp bf16 reaches fsdp-train.
        open(log, "w").close()
        proc, data = run(build, torch_json, log, configs="fsdp2xtp2", env_extra={"FAKE_PERTURB": "1e-3"},
                         extra=["--mp", "bf16"])
        with open(log) as f:
            call = json.loads(f.readline())
        check(proc.returncode == 0 and data.get("tolerance") == 2e-2 and call[call.index("--mp") + 1] == "bf16",
              "--mp bf16: fsdp-train gets --mp bf16, tolerance 2e-2")

        # Bad input: exit 2 naming it.
        proc, _ = run(build, torch_json, log, configs="fsdp4,zero3")
        check(proc.returncode == 2 and "zero3" in proc.stderr, "unknown config: exit 2 naming it")
        proc, _ = run(build, torch_json, log, configs="fsdp4", extra=["--batch", "6"])
        check(proc.returncode == 2 and "--batch 6" in proc.stderr, "batch not divisible over dp: exit 2")
        # A torch record of another model: refused.
        other = json.loads(torch_record())
        other.update(model_args=["--layers", "3"], mp="fp32", no_sync=False)
        with open(torch_json, "w") as f:
            f.write(json.dumps(other) + "\n")
        proc, _ = run(build, torch_json, log, configs="fsdp4")
        check(proc.returncode == 2 and "--layers 3" in proc.stderr, "torch record of another model: exit 2")

    check(not imports_torch(HERE, "torch_fsdp_compare", "torch_train_compare"),
          "importing the scripts does not import torch")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
