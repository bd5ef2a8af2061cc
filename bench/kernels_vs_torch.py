#!/usr/bin/env python3
"""Side-by-side figures of our compute kernels (build/bench/kernels-bench) and PyTorch
(bench/torch_kernels.py) on the same shapes, for bench/RESULTS.md. On a shared, loaded machine
absolute numbers drift, so the two programs run alternately, section by section, for --rounds
rounds, and every figure is the median over the rounds; ratios compare figures of the same rounds.

    python3 bench/kernels_vs_torch.py --python /work/torchvenv/bin/python [--build-dir build]
        [--rounds 3] [--rows 2048] [--dims 64,128,256,512] [--threads 1,2] [--iters 15]
        [--json FILE]

Prints Markdown tables. `--python PY` (or TORCH_PYTHON) names an interpreter with torch; the
build and the tests never need torch.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        subprocess.run(cmd + ["--json", path], check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def med(values):
    return statistics.median(values) if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=os.environ.get("TORCH_PYTHON", sys.executable))
    ap.add_argument("--build-dir", default=os.environ.get("BUILD_DIR", "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--dims", default="64,128,256,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sections", default="gemm,elementwise,rows,attention")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    ours_bin = os.path.join(a.build_dir, "bench", "kernels-bench")
    common = ["--rows", str(a.rows), "--dims", a.dims, "--threads", a.threads, "--iters", str(a.iters),
              "--warmup", str(a.warmup)]
    ours = defaultdict(list)   # key -> [value per round]
    torch = defaultdict(list)
    isa = "?"
    for r in range(a.rounds):
        for section in a.sections.split(","):
            o = run_json([ours_bin, "--only", section, "--isa", "all" if section == "gemm" else "best",
                          "--no-check"] + common)
            isa = o["isa"]
            t = run_json([a.python, os.path.join(HERE, "torch_kernels.py"), "--only", section] + common)
            for row in o["rows"]:
                if row["section"] == "gemm":
                    ours[("gemm", row["shape"], row["D"], row["variant"], row["threads"])].append(row["gflops"])
                elif row["section"] == "elementwise":
                    if row["variant"] in (isa, "best"):
                        ours[("elementwise", row["op"].replace(" (api)", ""), row["variant"])].append(row["gbps"])
                elif row["section"] == "rows":
                    ours[("rows", row["op"])].append(row["median_us"])
                elif row["section"] == "attention":
                    ours[("attention", row["case"], row["threads"], "fwd")].append(row["fwd_us"])
                    ours[("attention", row["case"], row["threads"], "bwd")].append(row["bwd_us"])
            for row in t["rows"]:
                if row["section"] == "gemm":
                    torch[("gemm", row["shape"], row["D"], row["dtype"], row["threads"])].append(row["gflops"])
                elif row["section"] == "elementwise":
                    torch[("elementwise", row["op"], row["threads"])].append(row["gbps"])
                elif row["section"] == "rows":
                    torch[("rows", row["op"], row["threads"])].append(row["median_us"])
                elif row["section"] == "attention":
                    torch[("attention", row["case"], row["threads"], "fwd")].append(row["fwd_us"])
                    torch[("attention", row["case"], row["threads"], "bwd")].append(row["bwd_us"])
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)

    threads = [int(x) for x in a.threads.split(",")]
    dims = [int(x) for x in a.dims.split(",")]
    out = {"isa": isa, "rounds": a.rounds, "rows": a.rows, "tables": {}}
    sections = a.sections.split(",")
    if "gemm" in sections:
        print(f"\n### GEMM, GFLOP/s (R = {a.rows}; median of {a.rounds} rounds; ratio = ours / torch)\n")
        head = ["shape", "D", "Eigen SSE2", "Eigen AVX2", "Eigen AVX-512"]
        for nt in threads:
            head += [f"ours f32 {nt}t", f"torch f32 {nt}t", "ratio"]
        head += ["ours bf16 1t", "torch bf16 1t", "ratio"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        shapes = sorted({k[1] for k in ours if k[0] == "gemm"}, key=lambda s: ["qkv", "mlp-up", "mlp-down", "dX", "dW"].index(s.split()[0]))
        table = []
        for d in dims:
            for s in shapes:
                cells = [s, str(d)]
                rec = {"shape": s, "D": d}
                for v, name in (("eigen-baseline", "sse2"), ("eigen-avx2", "avx2"), ("eigen-avx512", "avx512")):
                    x = med(ours.get(("gemm", s, d, v, 1), []))
                    rec[name] = x
                    cells.append(f"{x:.1f}" if x == x else "-")
                for nt in threads:
                    x, y = med(ours[("gemm", s, d, "matmul f32", nt)]), med(torch[("gemm", s, d, "f32", nt)])
                    rec[f"ours_f32_{nt}t"], rec[f"torch_f32_{nt}t"] = x, y
                    cells += [f"{x:.1f}", f"{y:.1f}", f"{x / y:.2f}"]
                x, y = med(ours[("gemm", s, d, "matmul bf16", 1)]), med(torch[("gemm", s, d, "bf16", 1)])
                rec["ours_bf16_1t"], rec["torch_bf16_1t"] = x, y
                cells += [f"{x:.1f}", f"{y:.1f}", f"{x / y:.2f}"]
                table.append(rec)
                print("| " + " | ".join(cells) + " |")
        out["tables"]["gemm"] = table
    if "elementwise" in sections:
        print(f"\n### Element-wise f32, GB/s (n = R x 4D, D = {dims[-1]}; ours: the {isa} variant; 1 thread)\n")
        print("| op | ours | torch | ratio |\n|---|---|---|---|")
        table = []
        for op in ("add", "gelu (erf)", "gelu (tanh)", "gelu_backward (erf)", "silu"):
            x = med(ours.get(("elementwise", op, isa), []) or ours.get(("elementwise", op, "best"), []))
            y = med(torch[("elementwise", op, 1)])
            table.append({"op": op, "ours_gbps": x, "torch_gbps": y})
            print(f"| {op} | {x:.2f} | {y:.2f} | {x / y:.2f} |")
        out["tables"]["elementwise"] = table
    if "rows" in sections:
        print("\n### Row kernels, microseconds (1 thread; ratio = torch / ours, > 1 means ours is faster)\n")
        print("| op | ours | torch | ratio |\n|---|---|---|---|")
        table = []
        names = sorted({k[1] for k in ours if k[0] == "rows"}, key=lambda n: (n.split()[0].replace("_backward", ""), n))
        for name in names:
            if "_backward" in name:
                continue
            x = med(ours[("rows", name)])
            base = name.split(" ")[0]
            tname = name
            if base in ("rms_norm", "layer_norm"):
                shape = name.split(" ", 1)[1]
                xb = med(ours[("rows", f"{base}_backward {shape}")])
                y = med(torch[("rows", f"{base} fwd+bwd {shape}", 1)])
                label = f"{base} fwd+bwd {shape}"
                table.append({"op": label, "ours_us": x + xb, "torch_us": y})
                print(f"| {label} | {x + xb:.1f} | {y:.1f} | {y / (x + xb):.2f} |")
                y = med(torch[("rows", tname, 1)])
            elif base == "adamw_step" and "bf16" in name:
                continue
            else:
                y = med(torch[("rows", tname, 1)])
            table.append({"op": name, "ours_us": x, "torch_us": y})
            print(f"| {name} | {x:.1f} | {y:.1f} | {y / x:.2f} |")
        out["tables"]["rows"] = table
    if "attention" in sections:
        print("\n### Causal attention f32, microseconds (ratio = torch / ours)\n")
        print("| case | threads | ours fwd | torch fwd | ratio | ours bwd | torch bwd | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        table = []
        for key in sorted({(k[1], k[2]) for k in ours if k[0] == "attention"}):
            case, nt = key
            of, ob = med(ours[("attention", case, nt, "fwd")]), med(ours[("attention", case, nt, "bwd")])
            tf, tb = med(torch[("attention", case, nt, "fwd")]), med(torch[("attention", case, nt, "bwd")])
            table.append({"case": case, "threads": nt, "ours_fwd_us": of, "torch_fwd_us": tf, "ours_bwd_us": ob,
                          "torch_bwd_us": tb})
            print(f"| {case} | {nt} | {of:.0f} | {tf:.0f} | {tf / of:.2f} | {ob:.0f} | {tb:.0f} | {tb / ob:.2f} |")
        out["tables"]["attention"] = table
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
