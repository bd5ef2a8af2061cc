#!/usr/bin/env python3
"""PyTorch's redistribute planner at scale, for the side by side with `plan-quality --scale`
(issue 25; bench/RESULTS.md). Not run in CI (needs torch).

Under the fake process group (no communication), for the same meshes, placements and tensor
(bf16 [65536, 4096]) as `plan-quality --scale`, it times torch's planning step of `redistribute`
(`_gen_transform_infos_non_cached`: cold, no cache) and prints one Markdown row per transition
with the median over --repeats and the number of transform steps.

    /work/torchvenv/bin/python bench/torch_plan_scale.py [--repeats 15] [--max-ranks 1048576]
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.tensor._redistribute as redistribute
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore


def parse_placement(text):
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("_S("):
        dim, sf = text[3:-1].split(",")
        return _StridedShard(int(dim), split_factor=int(sf))
    if text.startswith("S("):
        return Shard(int(text[2:-1]))
    raise ValueError(f"placement '{text}': expected R, P, S(d) or _S(d,sf)")


def parse_placements(text):
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(parse_placement(cur))
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    out.append(parse_placement(cur))
    return tuple(out)


# The rows of plan-quality --scale (tools/plan_quality.cpp: scale_rows), same order.
def rows():
    out = []
    for e in (8, 10, 11, 12, 14, 16, 17, 18, 20):
        m = str(1 << e)
        out += [(m, "FSDP unshard", "S(0)", "R"), (m, "FSDP reshard", "R", "S(0)"),
                (m, "FSDP gradient reduce-scatter", "P", "S(0)"), (m, "all-to-all", "S(0)", "S(1)")]
    for dp in (16, 128, 256, 512, 2048, 16384):
        m = f"{dp}x8"
        out += [(m, "FSDP x TP unshard", "_S(0,8),S(0)", "R,S(0)"),
                (m, "FSDP x TP reshard", "R,S(0)", "_S(0,8),S(0)"),
                (m, "FSDP x TP gradient reduce-scatter", "P,S(0)", "_S(0,8),S(0)"),
                (m, "all-to-all", "S(0),R", "S(1),R")]
    for m in ("2x16x8", "32x64x8", "8x256x8", "8x2048x8"):
        out += [(m, "HSDP x TP unshard", "R,_S(0,8),S(0)", "R,R,S(0)"),
                (m, "HSDP x TP reshard", "R,R,S(0)", "R,_S(0,8),S(0)"),
                (m, "HSDP x TP gradient reduce-scatter + all-reduce", "P,P,S(0)", "R,_S(0,8),S(0)")]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-ranks", type=int, default=1 << 20)
    args = ap.parse_args()
    if not 1 <= args.repeats <= 1000:
        sys.exit(f"torch_plan_scale: --repeats {args.repeats}: expected 1..1000")
    sizes = lambda m: [int(x) for x in m.split("x")]
    world = max(torch.Size(sizes(m)).numel() for m, *_ in rows())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    meta = TensorMeta(torch.Size([65536, 4096]), (4096, 1), torch.bfloat16)
    print(f"PyTorch {torch.__version__}: redistribute planning (_gen_transform_infos_non_cached), fake process "
          f"group, bf16 [65536, 4096]; medians over {args.repeats} repeats\n")
    print("| mesh | ranks | transition | torch steps | torch plan us |")
    print("|---|---|---|---|---|")
    for mesh_text, what, src, dst in rows():
        shape = sizes(mesh_text)
        n = torch.Size(shape).numel()
        if n > args.max_ranks:
            continue
        mesh = DeviceMesh("cpu", torch.arange(n).view(shape), _init_backend=False)
        s = DTensorSpec(mesh, parse_placements(src), meta)
        d = DTensorSpec(mesh, parse_placements(dst), meta)
        times, infos = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            infos = redistribute._gen_transform_infos_non_cached(s, d)
            times.append((time.perf_counter() - t) * 1e6)
        print(f"| {mesh_text} | {n} | {what} [{src}] -> [{dst}] | {len(infos)} | {statistics.median(times):.1f} |",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
