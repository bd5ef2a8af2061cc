#!/usr/bin/env python3
"""fsdp-train's contract: flags, the progress lines, the last JSON line (exactly its keys), exit
statuses, and the --dump-init safetensors file (parsed here without the safetensors package:
8-byte little-endian header length, JSON header, raw little-endian data).

usage: fsdp_train_cli_test.py path/to/fsdp-train
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

exe = sys.argv[1]
failures = []
checks = 0
SMALL = ["--layers", "1", "--dim", "16", "--heads", "2", "--vocab", "24", "--seq", "8", "--batch", "4"]
KEYS = ["steps", "first_loss", "last_loss", "parity", "max_rel_loss_diff", "max_param_diff", "tokens_per_s",
        "peak_bytes", "peak_block_bytes", "estimated_peak_bytes", "estimated_peak_block_bytes", "all_gather_bytes",
        "reduce_bytes", "fsdp_copy_bytes"]


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def run(args):
    return subprocess.run([exe] + args, capture_output=True, text=True, timeout=120)


# Defaults of the contract: the loss halves in the default run (and it is quick).
r = run([])
check(r.returncode == 0, f"default run exit {r.returncode}: {r.stderr}")
lines = r.stdout.strip().splitlines()
last = json.loads(lines[-1])
check(list(last.keys()) == KEYS, f"JSON keys {list(last.keys())}")
check(last["steps"] == 30 and last["parity"] == "skipped", f"defaults: {last}")
check(last["max_rel_loss_diff"] is None and last["max_param_diff"] is None, "skipped parity diffs are null")
check(last["last_loss"] <= last["first_loss"] / 2, f"the default run does not halve the loss: {last}")
check(last["tokens_per_s"] > 0 and last["peak_bytes"] > 0, "throughput and memory reported")
progress = [l for l in lines[:-1] if l.startswith("step ")]
check(len(progress) == 30, f"{len(progress)} progress lines for 30 steps")
pat = re.compile(r"^step (\d+)/30 loss (\S+) ms (\S+) tokens/s (\S+) peak_bytes (\d+) param_bytes (\d+) "
                 r"grad_bytes (\d+) optim_bytes (\d+) buffer_bytes (\d+) all_gather_bytes (\d+) reduce_bytes (\d+) "
                 r"fsdp_copy_bytes (\d+)$")
check(all(pat.match(l) for l in progress), f"progress line format: {progress[:1]}")
check(abs(float(pat.match(progress[0]).group(2)) - last["first_loss"]) < 1e-6, "first progress loss = first_loss")

# --log-every, --check-parity on tp 2, gradient accumulation.
# FSDP: parity, and the sharded state shrinks with the shard count (parameters, gradients and
# optimizer state on rank 0).
sizes = {}
for dp in ("1", "2"):
    r = run(SMALL + ["--dp-shard", dp, "--steps", "3", "--log-every", "3", "--check-parity"])
    check(r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["parity"] == "ok",
          f"--dp-shard {dp}: exit {r.returncode}, {r.stderr.strip()}")
    m = pat.match(r.stdout.strip().splitlines()[0].replace("/3 ", "/30 "))
    check(m is not None, f"--dp-shard {dp}: progress line {r.stdout.strip().splitlines()[0]}")
    if m:
        sizes[dp] = [int(m.group(i)) for i in (6, 7, 8)]
if len(sizes) == 2:
    check(all(sizes["2"][i] < sizes["1"][i] for i in range(3)), f"sharded bytes per rank: {sizes}")
r = run(SMALL + ["--tp", "2", "--steps", "6", "--log-every", "3", "--check-parity", "--grad-accum", "2"])
check(r.returncode == 0, f"tp 2 parity exit {r.returncode}: {r.stderr}")
out = r.stdout.strip().splitlines()
check(len([l for l in out if l.startswith("step ")]) == 2, "--log-every 3 over 6 steps: 2 lines")
last = json.loads(out[-1])
check(last["parity"] == "ok" and last["max_rel_loss_diff"] <= 1e-5 and last["max_param_diff"] <= 1e-5,
      f"parity: {last}")

# MoE: the progress line gains aux_loss and imbalance (>= 1: max over mean); EP 2 matches one rank;
# combinations not built yet are refused with exit 2 naming them.
r = run(SMALL + ["--moe-experts", "4", "--ep", "2", "--steps", "2", "--log-every", "1", "--check-parity"])
check(r.returncode == 0, f"--ep 2 exit {r.returncode}: {r.stderr}")
moe_pat = re.compile(r" all_gather_bytes \d+ reduce_bytes \d+ fsdp_copy_bytes \d+ aux_loss (\S+) imbalance (\S+)$")
moe_lines = [moe_pat.search(l) for l in r.stdout.splitlines() if l.startswith("step ")]
check(len(moe_lines) == 2 and all(m is not None and float(m.group(1)) > 0 and float(m.group(2)) >= 1
                                  for m in moe_lines), f"MoE progress lines: {r.stdout[:300]}")
moe_refusals = [(["--moe-experts", "4", "--tp", "3"], "--tp 3 does not divide the experts' hidden size 64"),
                (["--moe-experts", "6", "--ep", "4"], "--ep 4 does not divide --moe-experts 6"),
                (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5"),
                (["--ep", "2"], "need --moe-experts"),
                (["--moe-experts", "4", "--estimate"], "does not model MoE"),
                (["--moe-experts", "4", "--ep", "2", "--ep-from-dp"], "--ep-from-dp with --ep 2 and --dp-shard 1"),
                (["--moe-experts", "4", "--dp-shard", "3", "--ep", "2", "--ep-from-dp"], "dividing --dp-shard"),
                (["--moe-experts", "4", "--dp-shard", "2", "--ep", "2", "--ep-from-dp", "--tp", "2"],
                 "--ep-from-dp with --tp 2")]
with tempfile.TemporaryDirectory() as d:  # --dump-init names the MoE weights and describes the blocks
    path = os.path.join(d, "moe.safetensors")
    two_blocks = SMALL[:]
    two_blocks[SMALL.index("--layers") + 1] = "2"
    r = run(two_blocks + ["--moe-experts", "4", "--moe-every", "2", "--moe-shared", "--steps", "1",
                     "--dump-init", path])
    check(r.returncode == 0 and os.path.exists(path), f"MoE dump exit {r.returncode}: {r.stderr}")
    header = {"__metadata__": {"config": "{}"}}
    if os.path.exists(path):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    moe_meta = json.loads(header["__metadata__"]["config"]).get("moe", {})
    check(moe_meta.get("experts") == 4 and moe_meta.get("every") == 2 and moe_meta.get("shared_expert") is True,
          f"MoE metadata {moe_meta}")
    check(header.get("blocks.1.moe.experts.w1", {}).get("shape") == [4, 16, 64] and
          "blocks.1.moe.router.weight" in header and "blocks.0.mlp.fc1.weight" in header and
          "blocks.1.moe.shared.fc1.weight" in header, f"MoE names {sorted(header)}")
for args, text in moe_refusals:
    r = run(SMALL + args + ["--steps", "1"])
    check(r.returncode == 2 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1,
          f"{args}: exit {r.returncode}, stderr {r.stderr.strip()!r} (expected exit 2 naming {text!r})")

# --dump-init: a safetensors file with every parameter.
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "init.safetensors")
    r = run(SMALL + ["--steps", "1", "--dump-init", path])
    check(r.returncode == 0, f"dump exit {r.returncode}: {r.stderr}")
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    check(n % 8 == 0, "header padded to 8 bytes")
    meta = header.pop("__metadata__", {})
    check(json.loads(meta.get("config", "{}")).get("dim") == 16, f"config metadata {meta}")
    check("tok_emb.weight" in header and "blocks.0.attn.wq.weight" in header and "lm_head.weight" in header,
          f"names {sorted(header)}")
    end = 0
    for name, t in header.items():
        b, e = t["data_offsets"]
        count = 1
        for s in t["shape"]:
            count *= s
        check(t["dtype"] == "F32" and e - b == 4 * count, f"{name}: {t}")
        end = max(end, e)
    check(end == len(data), f"data section {len(data)} bytes, offsets end at {end}")
    ln = header["blocks.0.ln1.weight"]
    vals = struct.unpack(f"<{ln['shape'][0]}f", data[ln["data_offsets"][0]:ln["data_offsets"][1]])
    check(all(v == 1.0 for v in vals), "LayerNorm weights start at 1")

# Invalid input: exit 2 with a message naming the value.
for args, text in [(["--dp-shard", "0"], "--dp-shard 0"), (["--tp", "3"], "3 ranks"),
                   (["--dp-shard", "4", "--reshard-after-forward", "3"], "--reshard-after-forward 3"),
                   (["--dp-shard", "2", "--prefetch", "3"], "--prefetch 3"),
                   (["--no-sync"], "need FSDP"),
                   (["--heads", "5"], "--heads 5"), (["--grad-accum", "3"], "--grad-accum 3"),
                   (["--mp", "fp8"], "fp8"), (["--backend", "gloo"], "gloo"), (["--world", "3"], "--world 3")]:
    r = run(args + ["--steps", "2"])
    check(r.returncode == 2 and text in r.stderr, f"{args}: exit {r.returncode}, stderr {r.stderr.strip()}")

# Invalid values that were accepted silently, and limits refused by name (issue 32).
for args, text in [(["--clip", "nan"], "--clip nan"), (["--threads", "-5"], "--threads -5"),
                   (["--seed", "-1"], "-1"), (["--seed", "99999999999999999999"], "99999999999999999999"),
                   (["--dp-shard", "1025"], "at most 1024"), (["--dp-shard", "65536", "--tp", "65536"], "4294967296"),
                   (["--timeout-ms", "0"], "--timeout-ms")]:
    r = run(args + ["--steps", "2"])
    check(r.returncode == 2 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1,
          f"{args}: exit {r.returncode}, stderr {r.stderr.strip()}")
# --qlora (issue 27): refusals exit 2 with one line naming the value; one rank trains.
qlora_cases = [(["--qlora", "4"], "--qlora 4 needs --mp bf16"), (["--qlora", "-1", "--mp", "bf16"], "--qlora -1"),
               (["--qlora", "4", "--mp", "bf16", "--tp", "2"], "--tp 2"),
               (["--qlora", "4", "--mp", "bf16", "--dp-shard", "2", "--all-gather", "int8"], "--all-gather int8"),
               (["--qlora", "4", "--mp", "bf16", "--lora-alpha", "0"], "--lora-alpha 0"),
               (["--qlora", "4", "--mp", "bf16", "--dp-shard", "4", "--reshard-after-forward", "2"],
                "--reshard-after-forward 2")]
for args, text in qlora_cases:
    r = run(args + ["--steps", "2"])
    check(r.returncode == 2 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1,
          f"{args}: exit {r.returncode}, stderr {r.stderr.strip()}")
check(len(qlora_cases) == 6, "qlora refusal cases ran")
r = run(SMALL + ["--qlora", "2", "--mp", "bf16", "--steps", "3"])
check(r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["last_loss"] > 0,
      f"--qlora 2 on one rank: exit {r.returncode}, stderr {r.stderr.strip()}")

# A model too large for the machine: exit 3 naming the bytes, at once.
r = run(["--dim", "3037000500", "--heads", "4"])
check(r.returncode == 3 and re.search(r"needs at least \d+ bytes", r.stderr) is not None,
      f"--dim 3037000500: exit {r.returncode}, stderr {r.stderr.strip()}")

# --timeout-ms is taken and a healthy run is unaffected.
r = run(SMALL + ["--dp-shard", "2", "--steps", "2", "--timeout-ms", "5000"])
check(r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["steps"] == 2,
      f"--timeout-ms 5000: exit {r.returncode}, {r.stderr.strip()}")

# A diverged run stops at the first non-finite loss (exit 1, one line naming the step and the
# value, no JSON line), on one rank and under FSDP; a non-finite gradient norm likewise.
for args, step, what in [(["--steps", "5", "--lr", "1e30"], "2/5", "the loss is"),
                         (["--steps", "5", "--lr", "1e30", "--dp-shard", "2", "--clip", "0"], "2/5", "the loss is"),
                         (["--steps", "6", "--lr", "1e10", "--optimizer", "sgd"], "4/6", "the gradient norm is not finite")]:
    r = run(SMALL + args)
    err = r.stderr.strip().splitlines()
    out = r.stdout.strip().splitlines()
    check(r.returncode == 1 and len(err) == 1 and f"step {step}: {what}" in err[0],
          f"{args}: exit {r.returncode}, stderr {r.stderr.strip()}")
    check(not any(l.startswith("{") for l in out), f"{args}: a JSON line after divergence: {out[-1:]}")
    done = int(step.split("/")[0]) - 1
    check(len([l for l in out if l.startswith("step ")]) == done, f"{args}: {len(out)} progress lines, want {done}")

for f in failures:
    print("FAIL:", f)
print(f"fsdp_train_cli_test: {checks} checks, {len(failures)} failures")
sys.exit(1 if failures or checks < 30 else 0)
