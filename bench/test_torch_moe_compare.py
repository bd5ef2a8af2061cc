#!/usr/bin/env python3
"""Offline test of bench/torch_moe_compare.py and the bench/torch_common.py pieces it uses. No torch
and no C++ build needed.

Run:  python3 bench/test_torch_moe_compare.py        (from anywhere; exit status 0 = pass)

Ours is played by a fake `fsdp-train` (a small Python program in a temporary build directory that
prints fsdp-train's progress lines with aux_loss and its last-line JSON, and logs its command line).
Checks: the flags run_ours passes (--ep, --threads cores / ep, --dump-init), the losses, step times
and aux losses read back; the loss report (compared_losses, finish: exit 1 over the tolerance, a
missing step refused naming the config); an unknown config refused naming it; mix64 against
splitmix64's published outputs (the generator fsdp-train's batches come from, as
tests/kernels/misc_test.cpp pins the C++ one); and that importing the scripts does not import torch.
"""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_moe_compare.py")
sys.path.insert(0, HERE)
import torch_common as tc  # noqa: E402
import torch_moe_compare as tmc  # noqa: E402
from fake_programs import Checks, imports_torch, install_fake, read_calls  # noqa: E402

check = Checks()
STEPS = 3


# Step s (from 0): loss 4 - 0.5 s, ms 10 + s, aux_loss 0.01 + 0.001 s; then a "step" line without
# loss and ms, which is not a progress line.
FAKE = r'''steps = int(args[args.index("--steps") + 1])
for s in range(steps):
    print(f"step {s + 1}/{steps} loss {4 - 0.5 * s} ms {10 + s:.3f} tokens/s 1000 peak_bytes 4000 "
          f"aux_loss {0.01 + 0.001 * s:.9g} imbalance 1.5")
print("step 0/0 total")
print(json.dumps({"steps": steps, "tokens_per_s": 1000}))
'''


def main() -> int:
    golden = 0x9E3779B97F4A7C15
    check([tc.mix64(k * golden & tc.M64) for k in range(3)] ==
          [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F], "mix64: splitmix64's first three outputs")
    ids, targets = tc.make_batch(7, 2, 5, 2, 4, 16)
    first = [tc.mix64((7 * 0x100000001B3 + 2 * golden + g) & tc.M64) % 16 for g in (5, 6)]
    check([row[0] for row in ids] == first and all(
        t[i] == (5 * r[i] + 3) % 16 for r, t in zip(ids, targets) for i in range(4)), "make_batch: rows from mix64")

    with tempfile.TemporaryDirectory() as tmp:
        build = os.path.join(tmp, "build")
        install_fake(build, "examples/fsdp-train", FAKE)
        log = os.path.join(tmp, "log")
        os.environ["FAKE_LOG"] = log
        args = argparse.Namespace(build_dir=build, cores=4)
        model_args = ["--steps", str(STEPS)]
        out = tmc.run_ours(args, 2, model_args, os.path.join(tmp, "init.safetensors"))
        out1 = tmc.run_ours(args, 1, model_args, None)
        calls = read_calls(log)
        check(len(calls) == 2, f"fsdp-train ran once per run_ours ({len(calls)})")
        if len(calls) == 2:
            c, c1 = calls
            check(c[c.index("--ep") + 1] == "2" and c[c.index("--threads") + 1] == "2" and "--dump-init" in c,
                  f"ep 2: --ep 2, --threads 4 / 2, --dump-init: {c}")
            check("--ep" not in c1 and c1[c1.index("--threads") + 1] == "4" and "--dump-init" not in c1,
                  f"ep 1: no --ep, --threads 4, no --dump-init: {c1}")
        for o in (out, out1):
            check(o["losses"] == [4 - 0.5 * s for s in range(STEPS)] and o["ms"] == [10.0 + s for s in range(STEPS)],
                  f"losses and step times read back: {o['losses']} {o['ms']}")
            check(o["aux"] == [0.01 + 0.001 * s for s in range(STEPS)], f"aux losses read back: {o['aux']}")

    # The loss report.
    check(tc.compared_losses("ep2", 2, [1.0, 2.2], [1.0, 2.0]) == abs(2.2 - 2.0) / 2.0, "compared_losses")
    try:
        tc.compared_losses("ep4", 3, [1.0, 2.0], [1.0, 2.0, 3.0])
        check(False, "compared_losses refuses a missing step")
    except SystemExit as e:
        check("ep4" in str(e) and "expected 3 losses" in str(e), f"compared_losses names the config: {e}")
    for rel, want in ((1e-5, 0), (1e-3, 1)):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = tc.finish([{"config": "ep1", "max_rel_loss_diff": rel}], 1e-4)
        record = json.loads(buf.getvalue().strip().splitlines()[-1])
        check(rc == want and record["max_rel_loss_diff"] == rel and record["configs"][0]["config"] == "ep1",
              f"finish: rel {rel} against 1e-4 exits {want} with the JSON record")

    # An unknown config: refused naming it, before anything runs (the interpreter is never used).
    proc = subprocess.run([sys.executable, SCRIPT, "--python", "/nonexistent/python", "--configs", "ep1,ep0x"],
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    check(proc.returncode != 0 and "ep0x" in proc.stderr, f"unknown config refused naming it: {proc.stderr!r}")

    check(not imports_torch(HERE, "torch_common", "torch_moe_compare"), "importing the scripts does not import torch")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
