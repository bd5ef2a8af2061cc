#!/usr/bin/env python3
"""fsdp-train --reduce-wire (issue 27, item 4): FSDP's gradient reductions move bf16 (or e5m2)
and sum in f32. Under --mp bf16 the gradients are bf16 values, so a bf16 wire carries them
exactly: every loss equals the f32-reduced run's (within 1e-6 relative; the local sum runs in
member order, as the f32 reduce-scatter does) while the plans move half the bytes; e5m2 a
quarter. bf16 passes --check-parity at --mp bf16's limits; HSDP's all-reduce takes the wire too.
e5m2 (3 significant bits) passes at its own limits (2^-3 on losses and parameters, fsdp-train's
parity_limits): after 30 steps under FSDP 2 its loss differs from one rank's by more than bf16's
2e-2 (6.7e-2), so that run can only pass at the e5m2 limit.

usage: fsdp_train_reduce_wire_test.py path/to/fsdp-train
"""
import re
import sys

from fsdp_train_run import FsdpTrain

MODEL = ["--mp", "bf16", "--dim", "256", "--layers", "2", "--vocab", "64", "--log-every", "1"]
STEP = re.compile(r"^step (\d+)/\d+ loss (\S+) .* reduce_bytes (\d+) fsdp_copy_bytes \d+$")
t = FsdpTrain(sys.argv[1], MODEL, STEP)
check = t.check


def run(*args, steps=8):
    """The run, its summary, the losses and reduce_bytes of each progress line."""
    r = t.run(*args, steps=steps)
    return r, r.last, [float(m.group(2)) for m in r.steps if m], [int(m.group(3)) for m in r.steps if m]


base_r, base, base_losses, base_steps = run("--dp-shard", "4", "--check-parity")
check(base_r.returncode == 0 and base.get("parity") == "ok", f"f32 reduce: exit {base_r.returncode} {base_r.stderr}")
check(base.get("reduce_bytes", 0) > 0 and set(base_steps) == {base["reduce_bytes"]},
      f"f32 reduce: reduce_bytes {base.get('reduce_bytes')} per step {base_steps}")

wire_r, wire, wire_losses, wire_steps = run("--dp-shard", "4", "--check-parity", "--reduce-wire", "bf16")
check(wire_r.returncode == 0 and wire.get("parity") == "ok", f"bf16 wire: exit {wire_r.returncode} {wire_r.stderr}")
check(2 * wire.get("reduce_bytes", 0) == base.get("reduce_bytes"),
      f"bf16 wire moves {wire.get('reduce_bytes')} bytes, f32 {base.get('reduce_bytes')}: not half")
check(len(wire_losses) == len(base_losses) == 8, f"losses: {len(wire_losses)} / {len(base_losses)}")
worst = max((abs(a - b) / abs(b) for a, b in zip(wire_losses, base_losses)), default=1.0)
check(worst <= 1e-6, f"bf16 wire losses differ from the f32-reduced run's by {worst} relative (limit 1e-6)")

e5_r, e5, e5_losses, _ = run("--dp-shard", "4", "--reduce-wire", "e5m2", "--check-parity")
check(e5.get("parity") == "ok", f"e5m2 wire parity: {e5.get('parity')} {e5_r.stderr.strip()}")
# A quarter of the payload, plus each fp8 sender's 4-byte scale per peer (3 peers, 3 groups).
check(e5_r.returncode == 0 and 4 * (e5.get("reduce_bytes", 0) - 3 * 3 * 4) == base.get("reduce_bytes"),
      f"e5m2 wire: exit {e5_r.returncode}, {e5.get('reduce_bytes')} bytes vs f32 {base.get('reduce_bytes')}")
check(len(e5_losses) == 8 and e5_losses[-1] < e5_losses[0], f"e5m2 wire does not train: {e5_losses}")

# HSDP 2x2: the reduce-scatter and the replicate all-reduce both move bf16 (the all-reduce's
# result is rounded to bf16 once), within --mp bf16's parity limits.
h_r, h, _, _ = run("--dp-replicate", "2", "--dp-shard", "2", "--check-parity")
hw_r, hw, _, _ = run("--dp-replicate", "2", "--dp-shard", "2", "--check-parity", "--reduce-wire", "bf16")
check(h_r.returncode == 0 and hw_r.returncode == 0 and hw.get("parity") == "ok",
      f"HSDP: exit {h_r.returncode} / {hw_r.returncode} {hw_r.stderr}")
check(2 * hw.get("reduce_bytes", 0) == h.get("reduce_bytes"), f"HSDP bytes {hw.get('reduce_bytes')} vs {h.get('reduce_bytes')}")

# e5m2 at its limit: FSDP 2, 30 steps (deterministic: the local backend and fixed data).
e30_r, e30, _, _ = run("--dp-shard", "2", "--reduce-wire", "e5m2", "--check-parity", steps=30)
e30_diff = e30.get("max_rel_loss_diff") or 0.0
check(e30_r.returncode == 0 and e30.get("parity") == "ok" and e30_diff <= 0.125 and e30.get("max_param_diff", 1) <= 0.125,
      f"e5m2 wire, FSDP 2, 30 steps: exit {e30_r.returncode} {e30_r.stderr.strip()} {e30}")
check(e30_diff > 2e-2, f"e5m2 wire, FSDP 2, 30 steps: loss difference {e30_diff} is within bf16's 2e-2 (the test "
      "no longer shows that the e5m2 limit is needed)")

check(t.runs == 6, f"{t.runs} runs, expected 6")
t.finish(f"ok: {t.runs} runs; reduce bytes per step f32 {base['reduce_bytes']}, bf16 wire {wire['reduce_bytes']}, "
         f"e5m2 wire {e5['reduce_bytes']}; largest relative loss difference {worst:g}; e5m2 parity (FSDP 2, 30 steps) "
         f"loss {e30_diff:g} params {e30.get('max_param_diff')}")
