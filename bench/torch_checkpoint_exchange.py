#!/usr/bin/env python3
"""Exchange checkpoints with PyTorch in both directions (not part of CI: it needs torch).

ours -> torch:
  1. fsdp-train --tp 2 trains the GPT a few steps and saves (--save-dir): TP shards S(0), S(1)
     and replicated norms. checkpoint-tool demo saves layouts fsdp-train cannot make yet
     (FSDP x TP _S(0,2),S(0) on 2x2; _S(0,2) over 4 ranks, where each rank writes two boxes;
     uneven S(0) over 3; RaggedShard ranges over 4 and HSDP [R, Rg], each range several boxes).
  2. PyTorch (4 gloo processes) loads each with dcp.load + HuggingFaceStorageReader into
     DTensors on OTHER meshes (2x2 [Shard(0), Shard(1)] or [R, Shard(0)]; 1-D of 4 [Shard(-1)]),
     model parameters and the AdamW state, and compares every full tensor with the expected
     values: our consolidated export (checkpoint-tool export, assembled by our code) and, for the
     demo layouts, the closed-form values (i % 1000) * 0.5 + k computed in torch. PyTorch then
     saves the demo tensors as 2x2 [S(0),S(1)] DTensors, and checkpoint-tool demo-check loads
     them under three RaggedShard layouts.
torch -> ours:
  3. PyTorch trains the same GPT (from fsdp-train --dump-init, same batches) with FSDP2
     (fully_shard per block and the root, 2 gloo processes) for K steps, takes get_state_dict
     (model + flattened AdamW state, FQN keys) and saves it with dcp.save +
     HuggingFaceStorageWriter(save_distributed=True) (one shard file per rank, no metadata
     file), then trains N more steps.
  4. fsdp-train --tp 2 --resume-from that directory continues at step K; its losses for steps
     K+1..K+N must equal PyTorch's within --tolerance (relative; default 1e-4, the bound
     torch_train_compare.py uses between the two implementations).

Usage (from the repository root, a build with examples):
    python3 bench/torch_checkpoint_exchange.py --python /work/torchvenv/bin/python [--build-dir build]
The last line is one JSON object; exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

MODEL = {"layers": 2, "dim": 32, "heads": 4, "vocab": 48, "seq": 16, "batch": 4}
LR = 3e-3


def log(msg: str) -> None:
    print(f"[torch_checkpoint_exchange] {msg}", file=sys.stderr, flush=True)


def model_args() -> list[str]:
    out = []
    for k, v in MODEL.items():
        out += [f"--{k}", str(v)]
    return out + ["--lr", str(LR), "--log-every", "1"]


# ---------------------------------------------------------------------------------------------
# The torch side
# ---------------------------------------------------------------------------------------------

def load_worker(rank: int, world: int, cfg: dict, port: int, out_path: str) -> None:
    """Loads our checkpoints into DTensors on meshes other than the saving one and compares."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = []

    def layouts(ndim):
        mesh22 = init_device_mesh("cpu", (2, 2))
        mesh4 = init_device_mesh("cpu", (4,))
        out = [("2x2 [S(0),S(1)]" if ndim == 2 else "2x2 [R,S(0)]", mesh22,
                [Shard(0), Shard(1)] if ndim == 2 else [Replicate(), Shard(0)]),
               ("4 [S(1)]" if ndim == 2 else "4 [S(0)]", mesh4, [Shard(ndim - 1)])]
        return out

    def load_and_compare(ckpt, expected: dict, label: str):
        # Every key on two target layouts.
        for which in range(2):
            sd, meta = {}, {}
            for k, full in expected.items():
                lay = layouts(full.dim())[which]
                sd[k] = distribute_tensor(torch.zeros_like(full), lay[1], lay[2])
                meta[k] = lay[0]
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt))
            for k, full in expected.items():
                got = sd[k].full_tensor()
                ok = torch.equal(got, full)
                results.append({"check": f"{label}: {k} on {meta[k]}", "ok": bool(ok),
                                 "max_abs_diff": float((got.double() - full.double()).abs().max()) if got.numel() else 0.0})
        dist.barrier()

    # fsdp-train's checkpoint: model params and optimizer state vs the consolidated export.
    full = load_file(cfg["export"])
    expected = {k: v for k, v in full.items() if v.dim() >= 1}
    load_and_compare(cfg["ours"], expected, "fsdp-train tp2")
    # The demo layouts: closed-form values.
    for label, path in cfg["demos"].items():
        exp = {}
        for k, (name, shape) in enumerate((("demo.a", (13, 10)), ("demo.b", (16, 8)), ("demo.c", (7,)),
                                           ("demo.d", (3, 4, 5)))):
            n = 1
            for s in shape:
                n *= s
            exp[name] = ((torch.arange(n, dtype=torch.float64) % 1000) * 0.5 + k).to(torch.float32).reshape(shape)
        load_and_compare(path, exp, f"demo {label}")
    if cfg.get("torch_demo"):
        # The demo tensors saved by PyTorch as DTensors on 2x2 (several chunks per tensor), for
        # checkpoint-tool demo-check under RaggedShard layouts.
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        mesh22 = init_device_mesh("cpu", (2, 2))
        sd = {k: distribute_tensor(v, mesh22, [Shard(0), Shard(1)] if v.dim() >= 2 else [Replicate(), Shard(0)])
              for k, v in exp.items()}
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(cfg["torch_demo"], save_distributed=True))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def fsdp_worker(rank: int, world: int, cfg: dict, port: int, out_path: str) -> None:
    """Trains with FSDP2 for K steps, saves with the HF writer (sharded), trains N more."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch_train_compare import build_gpt, make_batch  # fsdp-train's GPT, loaded from cfg["init"]

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build_gpt(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            foreach=False)
    positions = torch.arange(cfg["seq"])
    losses = []
    for step in range(cfg["k"] + cfg["n"]):
        if step == cfg["k"]:
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
            sd = dict(msd)
            for key, v in osd.items():
                if key.startswith("state.") and isinstance(v, torch.Tensor):
                    sd["optim." + key] = v
            dcp.save(sd, storage_writer=HuggingFaceStorageWriter(cfg["torch_ckpt"], save_distributed=True))
        B = cfg["batch"]
        ids, targets = make_batch(cfg["seed"], step, step * B, B, cfg["seq"], cfg["vocab"])
        logits = model(torch.tensor(ids), positions)
        loss = F.cross_entropy(logits.flatten(0, 1), torch.tensor(targets).flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses}, f)
    dist.destroy_process_group()


def spawn(fn_name: str, world: int, cfg: dict, out_path: str) -> None:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(globals()[fn_name], args=(world, cfg, port, out_path), nprocs=world, join=True)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------

def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log(" ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        log(f"exit {p.returncode}: {p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        raise SystemExit(1)
    return p


def losses_of(stdout: str) -> dict[int, float]:
    import re
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+)/\d+ loss (\S+)", stdout, re.M)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=os.environ.get("TORCH_PYTHON"), help="a python with torch 2.15")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--k", type=int, default=4, help="steps before PyTorch saves")
    ap.add_argument("--n", type=int, default=6, help="steps after")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--torch-worker", help=argparse.SUPPRESS)
    ap.add_argument("--torch-config", help=argparse.SUPPRESS)
    ap.add_argument("--torch-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        cfg = json.loads(args.torch_config)
        spawn(args.torch_worker, cfg["world"], cfg, args.torch_out)
        return 0
    if not args.python:
        log("needs --python (or TORCH_PYTHON): an interpreter with torch 2.15, numpy and safetensors")
        return 2
    train = os.path.join(args.build_dir, "examples", "fsdp-train")
    tool = os.path.join(args.build_dir, "examples", "checkpoint-tool")
    tmp = tempfile.mkdtemp(prefix="ckpt-exchange-")
    report = {"checks": [], "ours_to_torch": None, "torch_to_ours": None}

    # ---- ours -> torch ----
    run([train, "--backend", "local", "--tp", "2", "--steps", "5", "--save-dir", os.path.join(tmp, "ours")]
        + model_args())
    ours = os.path.join(tmp, "ours", "step-00000005")
    run([tool, "export", ours, os.path.join(tmp, "export")])
    demos = {
        "fsdp-x-tp 2x2 _S(0,2),S(0)": ["--mesh", "2,2", "--placements", "_S(0,2),S(0)"],
        "strided 4 _S(0,2)": ["--mesh", "4", "--placements", "_S(0,2)"],
        "uneven 3 S(0)": ["--mesh", "3", "--placements", "S(0)"],
        "hsdp 2x2 R,S(0)": ["--mesh", "2,2", "--placements", "R,S(0)"],
        "ragged 4 Rg(0,[1,2,0,1],4)": ["--mesh", "4", "--placements", "Rg(0,[1,2,0,1],4)"],
        "ragged hsdp 2x2 R,Rg(0,[1,3],2)": ["--mesh", "2,2", "--placements", "R,Rg(0,[1,3],2)"],
    }
    demo_dirs = {}
    for i, (label, flags) in enumerate(demos.items()):
        d = os.path.join(tmp, f"demo{i}")
        run([tool, "demo", d] + flags)
        demo_dirs[label] = d
    cfg = {"world": 4, "ours": ours, "export": os.path.join(tmp, "export", "model.safetensors"), "demos": demo_dirs,
           "torch_demo": os.path.join(tmp, "torch_demo")}
    out = os.path.join(tmp, "load.json")
    run([args.python, os.path.abspath(__file__), "--torch-worker", "load_worker", "--torch-config", json.dumps(cfg),
         "--torch-out", out], timeout=600)
    checks = json.load(open(out))
    report["checks"] = checks
    bad = [c for c in checks if not c["ok"]]
    report["ours_to_torch"] = {"tensors_compared": len(checks), "mismatches": len(bad)}
    for c in bad:
        log(f"MISMATCH {c}")
    # PyTorch's 2x2 [S(0),S(1)] save of the demo tensors loads into RaggedShard layouts.
    for mesh, ps in (("4", "Rg(0,[1,2,0,1],4)"), ("2,2", "R,Rg(0,[1,3],2)"), ("3", "Rg(1,[1,0,2],1)")):
        p = subprocess.run([tool, "demo-check", cfg["torch_demo"], "--mesh", mesh, "--placements", ps],
                           capture_output=True, text=True)
        ok_rg = p.returncode == 0
        checks.append({"check": f"torch 2x2 [S(0),S(1)] -> ours {mesh} [{ps}]", "ok": ok_rg})
        if not ok_rg:
            bad.append(checks[-1])
            log(f"MISMATCH torch -> {mesh} [{ps}]: exit {p.returncode} {p.stdout.strip()} {p.stderr.strip()}")
    report["ours_to_torch"] = {"tensors_compared": len(checks), "mismatches": len(bad)}

    # ---- torch -> ours ----
    init = os.path.join(tmp, "init.safetensors")
    run([train, "--backend", "local", "--tp", "1", "--steps", "1", "--dump-init", init] + model_args())
    meta_cfg = {"norm_eps": 1e-5}
    try:
        import struct
        with open(init, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        meta_cfg = json.loads(header["__metadata__"]["config"])
    except Exception as e:  # pragma: no cover
        log(f"reading the init config failed: {e}")
    tcfg = dict(MODEL)
    tcfg.update({"world": 2, "init": init, "lr": LR, "seed": 0, "k": args.k, "n": args.n,
                 "norm_eps": meta_cfg.get("norm_eps", 1e-5), "mlp_hidden": meta_cfg.get("mlp_hidden", 4 * MODEL["dim"]),
                 "torch_ckpt": os.path.join(tmp, "torch")})
    out = os.path.join(tmp, "fsdp.json")
    run([args.python, os.path.abspath(__file__), "--torch-worker", "fsdp_worker", "--torch-config",
         json.dumps(tcfg), "--torch-out", out], timeout=600)
    torch_losses = json.load(open(out))["losses"]
    files = sorted(os.listdir(os.path.join(tmp, "torch")))
    log(f"PyTorch wrote {files}")
    p = run([train, "--backend", "local", "--tp", "2", "--steps", str(args.k + args.n), "--resume-from",
             os.path.join(tmp, "torch")] + model_args())
    ours_losses = losses_of(p.stdout)
    rel = []
    for step in range(args.k + 1, args.k + args.n + 1):
        t = torch_losses[step - 1]
        o = ours_losses.get(step)
        rel.append(abs(o - t) / abs(t) if o is not None else float("inf"))
    worst = max(rel) if rel else float("inf")
    report["torch_to_ours"] = {"files": files, "resumed_at": args.k, "steps": args.n,
                               "torch_losses": torch_losses[args.k:], "ours_losses": [ours_losses.get(s) for s in
                                                                                        range(args.k + 1,
                                                                                              args.k + args.n + 1)],
                               "max_rel_loss_diff": worst}
    ok = not bad and worst <= args.tolerance and len(checks) > 0
    report["ok"] = ok
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}))
    if args.keep:
        log(f"kept {tmp}")
    else:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
