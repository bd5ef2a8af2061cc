#!/usr/bin/env python3
"""fsdp-train, issue 26: shard first, --init-from, --estimate, --memory-limit.

- A model whose parameters + gradients + AdamW state are at least 2.5x the per-rank
  --memory-limit trains under FSDP 4, FSDP x TP 2x2 and HSDP 2x4 (passing --check-parity against
  one rank without a limit), while the same model without the dp sharding (--dp-shard 1) is
  refused with exit 3 before anything is allocated, in one stderr line naming the estimate, the
  limit and the cheapest knob that would fit.
- --estimate prints the estimate as one JSON line and trains nothing.
- --init-from loads a consolidated safetensors file (bf16, written here without torch: 8-byte
  little-endian header length, JSON header, raw data) into FSDP 4 and FSDP x TP 2x2, and the
  first loss equals the one-rank run from the same file; also an index of two files.
- Shard-then-init (the default) and --init-before-shard train bit-identically.

usage: fsdp_train_memory_test.py path/to/fsdp-train
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

exe = sys.argv[1]
failures = []
checks = 0


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def run(args, timeout=280):
    return subprocess.run([exe] + args, capture_output=True, text=True, timeout=timeout)


def last_json(r):
    lines = r.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


# ---- the memory limit (the done-when) ----
# 32 blocks of dim 128 and a small vocabulary: parameters dominate, and FSDP's unsharded
# working set (one block and its prefetched neighbour) is small next to them.
BIG = ["--layers", "32", "--dim", "128", "--heads", "4", "--vocab", "32", "--seq", "16", "--steps", "2"]
V, D, L, T = 32, 128, 32, 16
params = V * D + T * D + L * (4 * D * D + 2 * 4 * D * D + 4 * D) + 2 * D + V * D
state = 16 * params  # f32 parameters + gradients + AdamW's two moments
LIMIT = 40_000_000
check(state >= 2.5 * LIMIT, f"the model's state {state} is not 2.5x the limit {LIMIT}")
print(f"model: {params} parameters, parameters + gradients + AdamW state {state} bytes = "
      f"{state / LIMIT:.2f}x the per-rank limit {LIMIT}")
configs = [
    ("FSDP 4", ["--dp-shard", "4", "--batch", "4"], ["--dp-shard", "1", "--batch", "4"]),
    ("FSDP x TP 2x2", ["--dp-shard", "2", "--tp", "2", "--batch", "4"], ["--dp-shard", "1", "--tp", "2", "--batch", "4"]),
    ("HSDP 2x4", ["--dp-replicate", "2", "--dp-shard", "4", "--batch", "8"],
     ["--dp-replicate", "2", "--dp-shard", "1", "--batch", "8"]),
]
for name, fits, refused in configs:
    e = run(BIG + fits + ["--estimate", "--memory-limit", str(LIMIT)])
    est = last_json(e)
    check(e.returncode == 0 and est.get("fits") is True, f"{name}: --estimate exit {e.returncode} {e.stdout} {e.stderr}")
    r = run(BIG + fits + ["--memory-limit", str(LIMIT), "--check-parity", "--log-every", "2"])
    out = last_json(r)
    check(r.returncode == 0 and out.get("parity") == "ok",
          f"{name}: exit {r.returncode} under the limit: {r.stderr.strip()} {r.stdout[-300:]}")
    if out:
        check(out["peak_block_bytes"] <= LIMIT, f"{name}: measured peak {out['peak_block_bytes']} over the limit")
        print(f"{name}: per-rank peak estimated {out['estimated_peak_bytes']} bytes ({out['estimated_peak_block_bytes']} "
              f"in blocks), measured {out['peak_bytes']} ({out['peak_block_bytes']} in blocks), limit {LIMIT}")
    r = run(BIG + refused + ["--memory-limit", str(LIMIT)], timeout=60)
    err = r.stderr.strip().splitlines()
    check(r.returncode == 3, f"{name} without dp sharding: exit {r.returncode} (expected 3): {r.stderr.strip()}")
    check(len(err) == 1, f"{name} without dp sharding: {len(err)} stderr lines")
    line = err[0] if err else ""
    check(f"--memory-limit {LIMIT}" in line and "estimated peak is" in line and "nothing was allocated" in line
          and "the cheapest knob that fits" in line, f"{name} without dp sharding: '{line}'")
    check("step " not in r.stdout, f"{name} without dp sharding: it trained")
    print(f"{name} refused: {line}")

# --estimate alone: one JSON line with every kind, no training.
r = run(BIG + ["--dp-shard", "4", "--batch", "4", "--estimate"])
est = last_json(r)
check(r.returncode == 0 and len(r.stdout.strip().splitlines()) == 1, f"--estimate: exit {r.returncode}, {r.stdout}")
for k in ("sharded_parameters", "gradients", "optimizer_state", "unsharded", "reduce_scatter", "activations",
          "transitions", "peak", "peak_blocks", "peak_at"):
    check(k in est, f"--estimate lacks {k}: {est}")
if est:
    check(est["optimizer_state"] == 2 * est["sharded_parameters"] and est["peak"] > est["sharded_parameters"] * 4,
          f"--estimate kinds: {est}")

# ---- --init-from ----
SMALL = ["--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "48", "--seq", "16", "--batch", "4", "--steps", "2"]
Vs, Ds, Ls, Ts = 48, 32, 2, 16


def shapes():
    out = [("tok_emb.weight", [Vs, Ds]), ("pos_emb.weight", [Ts, Ds])]
    for i in range(Ls):
        p = f"blocks.{i}."
        out += [(p + "ln1.weight", [Ds]), (p + "ln1.bias", [Ds])]
        out += [(p + f"attn.{w}.weight", [Ds, Ds]) for w in ("wq", "wk", "wv", "wo")]
        out += [(p + "ln2.weight", [Ds]), (p + "ln2.bias", [Ds])]
        out += [(p + "mlp.fc1.weight", [4 * Ds, Ds]), (p + "mlp.fc2.weight", [Ds, 4 * Ds])]
    out += [("ln_f.weight", [Ds]), ("ln_f.bias", [Ds]), ("lm_head.weight", [Vs, Ds])]
    return out


def bf16(x):
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    b += 0x7FFF + ((b >> 16) & 1)  # round to nearest even
    return struct.pack("<H", (b >> 16) & 0xFFFF)


def values(name, n):
    if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln_f.weight":
        return [1.0 + 0.01 * ((i * 13) % 7) for i in range(n)]
    seed = sum(ord(c) for c in name)
    return [0.05 * (((i + 1) * 7919 + seed * 104729) % 211 / 105.5 - 1.0) for i in range(n)]


def write_safetensors(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, shape in tensors:
        n = 1
        for s in shape:
            n *= s
        data = b"".join(bf16(v) for v in values(name, n))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model.safetensors")
    write_safetensors(model, shapes())
    first = {}
    for name, flags in (("one rank", []), ("FSDP 4", ["--dp-shard", "4"]), ("FSDP x TP 2x2", ["--dp-shard", "2", "--tp", "2"])):
        r = run(SMALL + flags + ["--init-from", model])
        out = last_json(r)
        check(r.returncode == 0 and out, f"--init-from under {name}: exit {r.returncode}: {r.stderr.strip()}")
        ratio = [l for l in r.stdout.splitlines() if l.startswith("init_from ")]
        check(len(ratio) == 1 and ratio[0].endswith("read/needed 1.00"), f"--init-from under {name}: {ratio}")
        if out:
            first[name] = out["first_loss"]
    print(f"--init-from first losses: {first}")
    one = first.get("one rank")
    for name in ("FSDP 4", "FSDP x TP 2x2"):
        got = first.get(name)
        check(one is not None and got is not None and abs(got - one) <= 1e-6 * abs(one),
              f"--init-from: the first loss under {name} {got} differs from one rank's {one}")
    # Not the seed's initialisation: the loss differs from a run without --init-from.
    r = run(SMALL + ["--dp-shard", "4"])
    check(last_json(r).get("first_loss") != first.get("FSDP 4"), "--init-from: the file was not used")
    # An index of two files gives the same first loss.
    names = shapes()
    half = len(names) // 2
    write_safetensors(os.path.join(tmp, "model-00001-of-00002.safetensors"), names[:half])
    write_safetensors(os.path.join(tmp, "model-00002-of-00002.safetensors"), names[half:])
    wm = {n: "model-00001-of-00002.safetensors" for n, _ in names[:half]}
    wm.update({n: "model-00002-of-00002.safetensors" for n, _ in names[half:]})
    index = os.path.join(tmp, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
    r = run(SMALL + ["--dp-shard", "4", "--init-from", index])
    check(r.returncode == 0 and last_json(r).get("first_loss") == first.get("FSDP 4"),
          f"--init-from an index: exit {r.returncode} {r.stderr.strip()}")
    # A file missing a tensor: exit 2 naming it, before training.
    write_safetensors(os.path.join(tmp, "short.safetensors"), names[:-1])
    r = run(SMALL + ["--dp-shard", "4", "--init-from", os.path.join(tmp, "short.safetensors")])
    check(r.returncode == 2 and "'lm_head.weight' (missing key)" in r.stderr and len(r.stderr.strip().splitlines()) == 1,
          f"--init-from a file missing lm_head.weight: exit {r.returncode}: {r.stderr.strip()}")

# ---- shard first (default) equals --init-before-shard, bit for bit ----
for flags in (["--dp-shard", "3"], ["--dp-replicate", "2", "--dp-shard", "2"], ["--dp-shard", "2", "--tp", "2"]):
    three = SMALL[:-2] + ["--steps", "3"]
    a = last_json(run(three + flags))
    b = last_json(run(three + flags + ["--init-before-shard"]))
    check(a and b and a["steps"] == 3 and a["first_loss"] == b["first_loss"] and a["last_loss"] == b["last_loss"],
          f"{flags}: shard-first {a} vs --init-before-shard {b}")

for f in failures:
    print("FAIL:", f)
print(f"fsdp_train_memory_test: {checks} checks, {len(failures)} failures")
sys.exit(1 if failures else 0)
