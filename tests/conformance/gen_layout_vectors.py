#!/usr/bin/env python3
"""Generate DTensor layout conformance vectors with PyTorch itself as the oracle.

Usage (from anywhere; paths are relative to this file):

    python3 tests/conformance/gen_layout_vectors.py            # (re)generate layout_vectors.json
    python3 tests/conformance/gen_layout_vectors.py --check    # compare the JSON with the section-2 model

Generation bootstraps a virtual environment at tests/conformance/.venv (created if missing),
installs torch there (pinned by TORCH_REQUIREMENT below), then re-executes itself with the venv's
interpreter and writes tests/conformance/layout_vectors.json.

`--check` needs no torch: it reads the JSON and compares torch's answers with an independent
Python model of the layout rules in docs/pytorch-semantics.md section 2 (chunk rule, left-to-right
nested sharding, two-level strided split rule, sentinel offsets). The data file always holds
torch's answers, never the model's.

What torch computes, per case and rank (one process impersonates every rank through the fake
process group used by PyTorch's own tests):
  * coord                     DeviceMesh.get_coordinate()
  * local_shape, global_offset torch.distributed.tensor._utils.compute_local_shape_and_global_offset
  * indices[t]                read from real data: for each tensor dim t, a float64 tensor whose
                              value at every element is that element's index along t is passed to
                              distribute_tensor(x, mesh, placements, src_data_rank=None) (each
                              rank splits its own copy, no communication); the values along dim t
                              of the local tensor, at index 0 of the other dims, are the global
                              indices the rank holds along t, in local order.
                              Partial(sum) divides values by the mesh-dim size
                              (Partial._partition_value); the product of those sizes is multiplied
                              back and the result rounded (asserted to be within 1e-6 of an int).
                              If some other dim u is empty on this rank (so there is no element to
                              read), the dim-t probe is re-run on a global shape where only the
                              empty dims u are replaced by a size that torch shards to a non-empty
                              extent on this rank (product of (split_factor * mesh size) over the
                              mesh dims that shard u; checked on the result). Only dim t's values
                              are read from that probe.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".venv")
VENV_PY = os.path.join(VENV, "bin", "python")
OUT_DEFAULT = os.path.join(HERE, "layout_vectors.json")
GENERATOR_REL = "tests/conformance/gen_layout_vectors.py"

# Pin for reproducibility; override with --torch-requirement.
TORCH_REQUIREMENT = "torch==2.15.0"
# torch's pure-python dependencies (tried first, with `pip install --no-deps torch`).
PURE_DEPS = [
    "filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec",
    "mpmath", "MarkupSafe", "setuptools", "numpy",
]
SEED = 1234
NUM_RANDOM = 800
MAX_RANKS = 8
IN_VENV_ENV = "GEN_LAYOUT_VECTORS_IN_VENV"


# ----------------------------------------------------------------------------------------------
# Bootstrap
# ----------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"[gen_layout_vectors] {msg}", file=sys.stderr, flush=True)


def _torch_imports(py: str) -> bool:
    r = subprocess.run(
        [py, "-c", "import torch, torch.distributed; print(torch.__version__)"],
        capture_output=True, text=True,
    )
    if r.returncode == 0:
        _log(f"import torch OK: {r.stdout.strip()}")
        return True
    tail = (r.stderr.strip().splitlines() or ["?"])[-1]
    _log(f"import torch failed: {tail}")
    return False


def _pip(*args: str) -> None:
    cmd = [VENV_PY, "-m", "pip", "install", "--disable-pip-version-check", *args]
    _log("running: " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def bootstrap(torch_req: str) -> None:
    if not os.path.exists(VENV_PY):
        _log(f"creating virtual environment {VENV}")
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    if not _torch_imports(VENV_PY):
        # 1) Try without the nvidia-*/triton/cuda wheels (several GB).
        _pip("--no-deps", torch_req)
        _pip(*PURE_DEPS)
        if not _torch_imports(VENV_PY):
            # 2) The CUDA wheel's libtorch links libcufile/libcusparseLt/libnvshmem at load time,
            #    so without those wheels `import torch` fails. Install the full dependency set.
            _log("import needs the CUDA runtime wheels; installing torch with all dependencies")
            _pip(torch_req)
            if not _torch_imports(VENV_PY):
                sys.exit("torch still does not import in the virtual environment")
    env = dict(os.environ)
    env[IN_VENV_ENV] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")
    os.execve(VENV_PY, [VENV_PY, os.path.abspath(__file__), *sys.argv[1:]], env)


# ----------------------------------------------------------------------------------------------
# Placement notation: S(d), _S(d,sf), R, P  (comma separated, no spaces, one per mesh dim)
# ----------------------------------------------------------------------------------------------

def parse_placements(s: str) -> list[tuple]:
    """'_S(0,2),S(0),R,P' -> [('_S',0,2), ('S',0), ('R',), ('P',)]"""
    out = []
    i = 0
    while i < len(s):
        if s.startswith("_S(", i):
            j = s.index(")", i)
            d, sf = s[i + 3:j].split(",")
            out.append(("_S", int(d), int(sf)))
            i = j + 1
        elif s.startswith("S(", i):
            j = s.index(")", i)
            out.append(("S", int(s[i + 2:j])))
            i = j + 1
        elif s[i] in "RP":
            out.append((s[i],))
            i += 1
        else:
            raise ValueError(f"bad placement string {s!r} at {i}")
        if i < len(s):
            if s[i] != ",":
                raise ValueError(f"bad placement string {s!r} at {i}")
            i += 1
    return out


def fmt_placements(pl: list[tuple]) -> str:
    parts = []
    for p in pl:
        if p[0] == "S":
            parts.append(f"S({p[1]})")
        elif p[0] == "_S":
            parts.append(f"_S({p[1]},{p[2]})")
        else:
            parts.append(p[0])
    return ",".join(parts)


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

def _case(mesh, shape, placements: str, source: str) -> dict:
    mesh = list(mesh)
    shape = list(shape)
    assert len(parse_placements(placements)) == len(mesh), (mesh, placements)
    assert math.prod(mesh) <= MAX_RANKS
    return {"source": source, "mesh": mesh, "shape": shape, "placements": placements}


def doc_cases() -> list[dict]:
    """The documented layout cases (docs/pytorch-semantics.md 6.1: PyTorch's own layout tests,
    labelled doc6.1#N, and the worked examples of section 2, labelled doc2.x) that fit in 8 ranks.
    Cases 1, 7 and 20 need more than 8 ranks and are left out."""
    c = []
    # 6.1 #2, #3
    c.append(_case((4, 2), (18, 2), "S(0),S(0)", "doc6.1#2"))
    c.append(_case((4, 2), (13, 2), "S(0),S(0)", "doc6.1#3"))
    # 6.1 #4, #5, #6
    c.append(_case((4, 2), (18, 2), "_S(0,2),S(0)", "doc6.1#4"))
    c.append(_case((4, 2), (39, 2), "_S(0,3),_S(0,4)", "doc6.1#5"))
    c.append(_case((4, 2), (18, 2), "S(0),_S(0,2)", "doc6.1#6"))
    # 6.1 #8, #9
    c.append(_case((4, 2), (15, 5), "_S(0,2),S(0)", "doc6.1#8"))
    c.append(_case((2, 2, 2), (16, 16), "_S(0,2),S(0),S(0)", "doc6.1#9"))
    # 6.1 #10 (4-D mesh, 8 ranks)
    c.append(_case((1, 2, 2, 2), (16, 16), "_S(0,2),_S(1,2),S(0),S(1)", "doc6.1#10a"))
    c.append(_case((1, 2, 2, 2), (16, 16), "_S(0,2),_S(1,2),S(0),S(0)", "doc6.1#10b"))
    # 6.1 #11 FSDP+TP even: (2W,2), mesh (W/2,2)
    for w in (2, 4, 6, 8):
        c.append(_case((w // 2, 2), (2 * w, 2), "_S(0,2),S(0)", f"doc6.1#11(W={w})"))
    # 6.1 #12 HSDP+TP: mesh (R,2,2), global (8,2)
    for r in (1, 2):
        c.append(_case((r, 2, 2), (8, 2), "R,_S(0,2),S(0)", f"doc6.1#12(R={r})"))
    # 6.1 #13: 1-D, sizes 0..2W+1 on W ranks, [S0]
    for w in (3, 4, 8):
        for n in range(0, 2 * w + 2):
            c.append(_case((w,), (n,), "S(0)", f"doc6.1#13(W={w})"))
    # 6.1 #14: mesh (2,4), pairs from {S0,S1,R}^2, dim0 sizes 1..8, shape (d0, 64//d0)
    for a, b in itertools.product(["S(0)", "S(1)", "R"], repeat=2):
        for d0 in range(1, 9):
            c.append(_case((2, 4), (d0, 64 // d0), f"{a},{b}", "doc6.1#14"))
    # 6.1 #15: W=8, sizes 0..7, [S0]
    for n in range(0, 8):
        c.append(_case((8,), (n,), "S(0)", "doc6.1#15"))
    # 6.1 #16: (size, chunks) pairs that fit in 8 ranks, on dims 0 and 1
    for n, k in [(16, 4), (17, 4), (15, 4), (7, 4), (3, 4), (1, 4), (8, 1), (8, 8)]:
        c.append(_case((k,), (n, 3), "S(0)", "doc6.1#16"))
        c.append(_case((k,), (3, n), "S(1)", "doc6.1#16"))
    # 6.1 #17: 1-D mesh of 4, arange(8)
    c.append(_case((4,), (8,), "_S(0,1)", "doc6.1#17"))
    c.append(_case((4,), (8,), "_S(0,2)", "doc6.1#17"))
    # 6.1 #18
    c.append(_case((2, 2), (2, 4), "_S(1,2),S(1)", "doc6.1#18"))
    # 6.1 #19: mesh (W/2,2), [_S(1,2),S(1)], dim-1 sizes 2,3,5,11
    for w in (4, 8):
        for n in (2, 3, 5, 11):
            c.append(_case((w // 2, 2), (3, n), "_S(1,2),S(1)", f"doc6.1#19(W={w})"))
    # Section 2.2 worked examples
    c.append(_case((4, 2), (13,), "S(0),S(0)", "doc2.2"))
    c.append(_case((2, 2), (5,), "S(0),S(0)", "doc2.2"))
    c.append(_case((4,), (5,), "S(0)", "doc2.2"))
    # Section 2.3 worked examples and reference results of the split rule
    c.append(_case((2, 2), (8,), "_S(0,2),S(0)", "doc2.3"))
    c.append(_case((2, 2), (8,), "S(0),S(0)", "doc2.3"))
    c.append(_case((4,), (9,), "_S(0,2)", "doc2.3"))
    c.append(_case((2,), (5,), "_S(0,2)", "doc2.3"))
    c.append(_case((8,), (6,), "_S(0,2)", "doc2.3"))
    c.append(_case((2,), (8,), "_S(0,3)", "doc2.3"))
    c.append(_case((2, 2), (8,), "S(0),_S(0,2)", "doc2.3"))
    # Section 2.3 hazard: 7 rows, mesh (3,2), [_S(0,2),S(0)]
    c.append(_case((3, 2), (7,), "_S(0,2),S(0)", "doc2.3-hazard"))
    c.append(_case((3, 2), (7, 5), "_S(0,2),S(0)", "doc2.3-hazard"))
    # Section 2.4 sentinel example: 4 rows, mesh (4,2), (S0,S0)
    c.append(_case((4, 2), (4,), "S(0),S(0)", "doc2.4"))
    # Section 2.1 chunk table (k=4 and k=8 that fit)
    for n in (16, 17, 15, 9, 10, 13, 7, 6, 5, 3, 2, 1, 0):
        c.append(_case((4,), (n,), "S(0)", "doc2.1"))
    c.append(_case((8,), (8,), "S(0)", "doc2.1"))
    return c


def _mesh_shapes() -> dict[int, list[tuple]]:
    by_nd: dict[int, list[tuple]] = {1: [], 2: [], 3: []}
    for nd in (1, 2, 3):
        for sh in itertools.product(range(1, MAX_RANKS + 1), repeat=nd):
            if math.prod(sh) <= MAX_RANKS:
                by_nd[nd].append(sh)
    return by_nd


def _rand_size(rng: random.Random) -> int:
    u = rng.random()
    if u < 0.06:
        return 0
    if u < 0.16:
        return 1
    return rng.randint(2, 20)


def random_cases(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    meshes = _mesh_shapes()
    out, seen = [], set()
    while len(out) < n:
        nd = rng.randint(1, 3)
        if nd > 1 and rng.random() < 0.15:
            # make sure meshes whose first dim has size 3 are well represented
            mesh = rng.choice([m for m in meshes[nd] if m[0] == 3])
        else:
            mesh = rng.choice(meshes[nd])
        tnd = rng.randint(1, 3)
        shape = tuple(_rand_size(rng) for _ in range(tnd))
        pl = []
        for _ in mesh:
            u = rng.random()
            if u < 0.35:
                pl.append(("S", rng.randrange(tnd)))
            elif u < 0.65:
                pl.append(("_S", rng.randrange(tnd), rng.randint(1, 4)))
            elif u < 0.85:
                pl.append(("R",))
            else:
                pl.append(("P",))
        key = (mesh, shape, fmt_placements(pl))
        if key in seen:
            continue
        seen.add(key)
        out.append(_case(mesh, shape, fmt_placements(pl), "random"))
    return out


def all_cases(seed: int, n_random: int) -> list[dict]:
    cases = doc_cases() + random_cases(seed, n_random)
    for i, c in enumerate(cases):
        c["id"] = i
    return cases


# ----------------------------------------------------------------------------------------------
# Torch oracle (runs inside the venv)
# ----------------------------------------------------------------------------------------------

def _unravel(r: int, shape) -> list[int]:
    coord = []
    for s in reversed(shape):
        coord.append(r % s)
        r //= s
    return coord[::-1]


def generate(out_path: str, seed: int, n_random: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def to_torch(pl):
        res = []
        for p in pl:
            if p[0] == "S":
                res.append(Shard(p[1]))
            elif p[0] == "_S":
                res.append(_StridedShard(p[1], split_factor=p[2]))
            elif p[0] == "R":
                res.append(Replicate())
            else:
                res.append(Partial())  # reduce_op="sum"
        return res

    def err(api: str, e: BaseException) -> str:
        msg = " ".join(str(e).split())
        return f"{api}: {type(e).__name__}: {msg}"

    def probe(shape, t, mesh, placements, scale):
        """distribute an index-along-t tensor; return the local tensor's values along t
        (at index 0 of the other dims) as ints, plus the local shape."""
        n = shape[t]
        view = [1] * len(shape)
        view[t] = n
        x = torch.arange(n, dtype=torch.float64).reshape(view).expand(*shape).contiguous()
        loc = distribute_tensor(x, mesh, placements, src_data_rank=None).to_local()
        lshape = list(loc.shape)
        if loc.numel() == 0:
            return None, lshape
        sel = [0] * len(shape)
        sel[t] = slice(None)
        vals = (loc[tuple(sel)] * scale).tolist()
        ints = [int(round(v)) for v in vals]
        for v, i in zip(vals, ints):
            if abs(v - i) > 1e-6:
                raise AssertionError(f"non-integer probe value {v}")
        return ints, lshape

    cases = all_cases(seed, n_random)
    # Results: case id -> list of rank records, or error string.
    results: dict[int, list] = {c["id"]: [None] * math.prod(c["mesh"]) for c in cases}
    errors: dict[int, tuple[int, str]] = {}
    notes: list[str] = []

    by_world: dict[int, list[dict]] = {}
    for c in cases:
        by_world.setdefault(math.prod(c["mesh"]), []).append(c)

    for world in sorted(by_world):
        group = by_world[world]
        for rank in range(world):
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            meshes = {}
            for c in group:
                cid = c["id"]
                if cid in errors:
                    continue
                mesh_shape = tuple(c["mesh"])
                shape = c["shape"]
                pl = parse_placements(c["placements"])
                try:
                    if mesh_shape not in meshes:
                        meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
                    mesh = meshes[mesh_shape]
                    placements = to_torch(pl)
                except Exception as e:  # noqa: BLE001
                    errors[cid] = (rank, err("setup", e))
                    continue
                coord = list(mesh.get_coordinate())
                if coord != _unravel(rank, mesh_shape):
                    raise AssertionError(f"coordinate {coord} != row-major unravel of {rank}")
                try:
                    ls, off = compute_local_shape_and_global_offset(shape, mesh, placements)
                    ls, off = [int(v) for v in ls], [int(v) for v in off]
                except Exception as e:  # noqa: BLE001
                    errors[cid] = (rank, err("compute_local_shape_and_global_offset", e))
                    continue
                scale = 1
                for m, p in enumerate(pl):
                    if p[0] == "P":
                        scale *= mesh_shape[m]
                try:
                    indices = []
                    for t in range(len(shape)):
                        if ls[t] == 0:
                            vals, lshape = [], None
                            # still run the real-shape probe for the shape cross-check
                            _, lshape = probe(shape, t, mesh, placements, scale)
                        else:
                            vals, lshape = probe(shape, t, mesh, placements, scale)
                        if lshape != ls:
                            notes.append(
                                f"case {cid} rank {rank}: distribute_tensor local shape {lshape} "
                                f"!= compute_local_shape_and_global_offset {ls}")
                        if vals is None:
                            # Another dim is empty on this rank: enlarge only the empty dims.
                            pshape = list(shape)
                            for u in range(len(shape)):
                                if u != t and ls[u] == 0:
                                    big = 1
                                    for m, p in enumerate(pl):
                                        if p[0] in ("S", "_S") and p[1] == u:
                                            big *= mesh_shape[m] * (p[2] if p[0] == "_S" else 1)
                                    pshape[u] = max(big, 1)
                            vals, plshape = probe(pshape, t, mesh, placements, scale)
                            if vals is None or plshape[t] != ls[t]:
                                raise AssertionError(
                                    f"enlarged probe {pshape} gave {plshape} on rank {rank}")
                        indices.append(vals)
                except Exception as e:  # noqa: BLE001
                    errors[cid] = (rank, err("distribute_tensor", e))
                    continue
                results[cid][rank] = {
                    "rank": rank, "coord": coord, "local_shape": ls,
                    "global_offset": off, "indices": indices,
                }
            dist.destroy_process_group()

    lines = []
    n_err = 0
    for c in cases:
        rec = {"id": c["id"], "source": c["source"], "mesh": c["mesh"], "shape": c["shape"],
               "placements": c["placements"]}
        if c["id"] in errors:
            n_err += 1
            rec["error_rank"], rec["error"] = errors[c["id"]]
        else:
            rec["ranks"] = results[c["id"]]
        lines.append(json.dumps(rec, separators=(",", ":")))
    header = {
        "torch_version": torch.__version__,
        "generator": GENERATOR_REL,
        "seed": seed,
        "num_cases": len(cases),
        "num_error_cases": n_err,
        "index_source": "distribute_tensor(index tensor, mesh, placements, src_data_rank=None) "
                        "with the fake process group, one process impersonating each rank",
        "shape_source": "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    }
    head = json.dumps(header, separators=(",", ":"))[:-1]
    with open(out_path, "w") as f:
        f.write(head + ',"cases":[\n')
        f.write(",\n".join(lines))
        f.write("\n]}\n")
    _log(f"torch {torch.__version__}: wrote {len(cases)} cases ({n_err} with error) to {out_path}")
    for note in notes:
        _log("NOTE " + note)


# ----------------------------------------------------------------------------------------------
# Independent model of docs/pytorch-semantics.md section 2 (for --check)
# ----------------------------------------------------------------------------------------------

def m_chunk(lst: list, k: int) -> list[list]:
    n = len(lst)
    c = -(-n // k)
    return [lst[min(n, r * c):min(n, (r + 1) * c)] for r in range(k)]


def m_strided(lst: list, k: int, sf: int) -> list[list]:
    pieces = m_chunk(lst, sf)
    sub = [m_chunk(p, k) for p in pieces]
    return [[x for j in range(sf) for x in sub[j][r]] for r in range(k)]


def model_rank(mesh, shape, pl, coord):
    idx = [list(range(n)) for n in shape]
    sharded = [False] * len(shape)
    for m, p in enumerate(pl):
        if p[0] == "S":
            idx[p[1]] = m_chunk(idx[p[1]], mesh[m])[coord[m]]
            sharded[p[1]] = True
        elif p[0] == "_S":
            idx[p[1]] = m_strided(idx[p[1]], mesh[m], p[2])[coord[m]]
            sharded[p[1]] = True
    ls = [len(i) for i in idx]
    off = [0 if not sharded[t] else (shape[t] if not idx[t] else idx[t][0])
           for t in range(len(shape))]
    return ls, off, idx


def model_order_rank(mesh, shape, pl, coord):
    """The 'explicit shard order' reading of _StridedShard (section 2.3, v2.8 style): a strided
    placement on tensor dim t is applied after the mesh dims whose sizes multiply to its split
    factor, right-to-left. Only used to label disagreements; returns None if not convertible."""
    idx = [list(range(n)) for n in shape]
    for t in range(len(shape)):
        order: list[int] = []
        for m in reversed(range(len(pl))):
            p = pl[m]
            if p[0] in ("S", "_S") and p[1] == t:
                sf = p[2] if p[0] == "_S" else 1
                placed = False
                for pos in range(len(order) + 1):
                    if math.prod(mesh[x] for x in order[:pos]) == sf:
                        order.insert(pos, m)
                        placed = True
                        break
                if not placed:
                    return None
        for m in order:
            idx[t] = m_chunk(idx[t], mesh[m])[coord[m]]
    return idx


def check(path: str) -> int:
    with open(path) as f:
        data = json.load(f)
    cases = data["cases"]
    n_err = sum(1 for c in cases if "error" in c)
    mism = []
    order_agree = 0
    for c in cases:
        if "error" in c:
            continue
        mesh, shape, pl = c["mesh"], c["shape"], parse_placements(c["placements"])
        for rr in c["ranks"]:
            coord = _unravel(rr["rank"], mesh)
            ls, off, idx = model_rank(mesh, shape, pl, coord)
            diffs = []
            if rr["coord"] != coord:
                diffs.append(f"coord torch={rr['coord']} model={coord}")
            if rr["local_shape"] != ls:
                diffs.append(f"local_shape torch={rr['local_shape']} model={ls}")
            if rr["global_offset"] != off:
                diffs.append(f"global_offset torch={rr['global_offset']} model={off}")
            if rr["indices"] != idx:
                diffs.append(f"indices torch={rr['indices']} model={idx}")
            # self-consistency of torch's own answers
            if [len(i) for i in rr["indices"]] != rr["local_shape"]:
                diffs.append("torch indices lengths != torch local_shape")
            if diffs:
                o = model_order_rank(mesh, shape, pl, coord)
                if rr["indices"] != idx and o is not None and o == rr["indices"]:
                    order_agree += 1
                mism.append(f"case {c['id']} ({c['source']}) mesh={mesh} shape={shape} "
                            f"[{c['placements']}] rank {rr['rank']}: " + "; ".join(diffs))
    n_ranks = sum(len(c["ranks"]) for c in cases if "ranks" in c)
    print(f"torch {data['torch_version']}: {len(cases)} cases, {n_err} errored, "
          f"{n_ranks} rank records checked")
    for c in cases:
        if "error" in c:
            print(f"  torch error: case {c['id']} mesh={c['mesh']} shape={c['shape']} "
                  f"[{c['placements']}]: {c['error']}")
    print(f"{len(mism)} rank records disagree with the section-2 model"
          + (f" ({order_agree} of them hold the indices of the shard-order reading)"
             if mism else ""))
    for m in mism:
        print("  " + m)
    return 1 if mism else 0


# ----------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare the JSON file with the section-2 model (no torch needed)")
    ap.add_argument("--out", default=OUT_DEFAULT, help="data file (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--num-random", type=int, default=NUM_RANDOM)
    ap.add_argument("--torch-requirement", default=TORCH_REQUIREMENT,
                    help="pip requirement for torch (default: %(default)s)")
    args = ap.parse_args()
    if args.check:
        sys.exit(check(args.out))
    if os.environ.get(IN_VENV_ENV) != "1":
        bootstrap(args.torch_requirement)  # does not return
    generate(args.out, args.seed, args.num_random)


if __name__ == "__main__":
    main()
