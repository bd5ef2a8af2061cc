#!/usr/bin/env python3
"""fsdp-train --init-from against PyTorch (issue 26; needs torch and safetensors: not in CI).

PyTorch writes a consolidated model.safetensors with `safetensors.torch.save_file` (random
weights for fsdp-train's GPT, in f32 and in bf16); fsdp-train loads it shard by shard under one
rank, FSDP 4 and FSDP x TP 2x2 (--init-from; every rank reads only its shards' bytes), and the
first loss of each is compared with PyTorch's forward of the same weights on fsdp-train's first
batch (bench/torch_train_compare.py's model and data generator).

Usage (from the repository root, with an interpreter that has torch and safetensors):
    /path/to/python bench/torch_init_from_compare.py [--build-dir build] [--tolerance 1e-5]
The last line is one JSON object: {"torch_first_loss": .., "runs": [{"dtype": "f32", "layout":
"FSDP 4", "first_loss": .., "rel_diff": .., "read_over_needed": ..}, ...], "max_rel_diff": ..}.
Exit status 0 when every first loss is within --tolerance of torch's, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_train_compare import build_gpt, make_batch  # noqa: E402  (fsdp-train's model and data)

CFG = {"vocab": 48, "dim": 32, "heads": 4, "layers": 2, "seq": 16, "norm_eps": 1e-5, "mlp_hidden": 128}
ARGS = ["--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "48", "--seq", "16", "--batch", "4",
        "--steps", "1", "--seed", "0"]
LAYOUTS = [("one rank", []), ("FSDP 4", ["--dp-shard", "4"]), ("FSDP x TP 2x2", ["--dp-shard", "2", "--tp", "2"])]


def weights(dtype):
    import torch
    g = torch.Generator().manual_seed(1234)
    D, V, T, H = CFG["dim"], CFG["vocab"], CFG["seq"], CFG["mlp_hidden"]
    w = {"tok_emb.weight": torch.randn(V, D, generator=g) * 0.02, "pos_emb.weight": torch.randn(T, D, generator=g) * 0.02}
    for i in range(CFG["layers"]):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            w[p + ln + ".weight"] = 1 + 0.1 * torch.randn(D, generator=g)
            w[p + ln + ".bias"] = 0.1 * torch.randn(D, generator=g)
        for n in ("wq", "wk", "wv", "wo"):
            w[p + f"attn.{n}.weight"] = torch.randn(D, D, generator=g) * 0.02
        w[p + "mlp.fc1.weight"] = torch.randn(H, D, generator=g) * 0.02
        w[p + "mlp.fc2.weight"] = torch.randn(D, H, generator=g) * 0.02
    w["ln_f.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
    w["ln_f.bias"] = 0.1 * torch.randn(D, generator=g)
    w["lm_head.weight"] = torch.randn(V, D, generator=g) * 0.02
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


def torch_first_loss(path):
    import torch
    import torch.nn.functional as F
    model = build_gpt(dict(CFG, init=path)).float()
    ids, targets = make_batch(0, 0, 0, 4, CFG["seq"], CFG["vocab"])
    with torch.no_grad():
        logits = model(torch.tensor(ids), torch.arange(CFG["seq"]))
        return F.cross_entropy(logits.reshape(-1, CFG["vocab"]), torch.tensor(targets).reshape(-1)).item()


def main() -> int:
    import torch
    from safetensors.torch import save_file
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default=os.path.join(os.path.dirname(HERE), "build"))
    ap.add_argument("--tolerance", type=float, default=1e-5)
    a = ap.parse_args()
    exe = os.path.join(a.build_dir, "examples", "fsdp-train")
    runs, worst = [], 0.0
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            path = os.path.join(tmp, f"model-{name}.safetensors")
            save_file(weights(dtype), path, metadata={"format": "pt"})
            ref = torch_first_loss(path)
            result[f"torch_first_loss_{name}"] = ref
            for layout, flags in LAYOUTS:
                r = subprocess.run([exe] + ARGS + flags + ["--init-from", path], capture_output=True, text=True,
                                   timeout=300)
                if r.returncode != 0:
                    print(f"fsdp-train {layout} {name}: exit {r.returncode}: {r.stderr.strip()}", file=sys.stderr)
                    return 1
                lines = r.stdout.strip().splitlines()
                got = json.loads(lines[-1])["first_loss"]
                ratio = next((l.split()[-1] for l in lines if l.startswith("init_from ")), None)
                rel = abs(got - ref) / abs(ref)
                worst = max(worst, rel)
                runs.append({"dtype": name, "layout": layout, "first_loss": got, "torch_first_loss": ref,
                             "rel_diff": rel, "read_over_needed": ratio})
                print(f"{name:5} {layout:14} first loss {got:.9g} torch {ref:.9g} rel diff {rel:.2e} "
                      f"read/needed {ratio}", file=sys.stderr)
    result.update({"runs": runs, "max_rel_diff": worst})
    print(json.dumps(result))
    return 0 if worst <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
