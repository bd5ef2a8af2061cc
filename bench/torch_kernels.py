#!/usr/bin/env python3
"""PyTorch on the shapes of kernels-bench (bench/kernels_bench.cpp), for side-by-side figures in
bench/RESULTS.md: torch.matmul GFLOP/s on the same GEMM shapes (f32 and bf16), GB/s of gelu,
add, rms_norm / layer_norm (forward + backward through autograd), softmax, cross-entropy and
AdamW, causal scaled_dot_product_attention, each with torch.set_num_threads(T) for every T in
--threads. Medians over --iters runs after --warmup.

    /work/torchvenv/bin/python bench/torch_kernels.py [--rows 2048] [--dims 64,128,256,512]
        [--threads 1,2] [--iters 20] [--json FILE]

Needs torch (CPU); the build and the tests never do.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def filled(shape, scale=1.0, dtype=torch.float32):
    n = math.prod(shape)
    t = torch.sin(0.37 * torch.arange(n, dtype=torch.float64)).mul(scale).float().reshape(shape)
    return t.to(dtype)


def gemm_shapes(r, d):
    return [("qkv x[R,D]@W[D,3D]", r, 3 * d, d, False, False),
            ("mlp-up x[R,D]@W[D,4D]", r, 4 * d, d, False, False),
            ("mlp-down h[R,4D]@W[4D,D]", r, d, 4 * d, False, False),
            ("dX dY[R,4D]@W^T", r, d, 4 * d, False, True),
            ("dW X^T[D,R]@dY[R,4D]", d, 4 * d, r, True, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--dims", default="64,128,256,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--only", default="", help="comma list: gemm, elementwise, rows, attention")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dims = [int(x) for x in a.dims.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    only = set(a.only.split(",")) if a.only else {"gemm", "elementwise", "rows", "attention"}
    rows = []
    w, it = a.warmup, a.iters
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"rows {a.rows}, dims {dims}, iters {it} (median)")
    for nt in threads:
        torch.set_num_threads(nt)
        if "gemm" in only:
            print(f"\n== GEMM, torch.matmul, {nt} thread(s)")
            for d in dims:
                for name, m, n, k, ta, tb in gemm_shapes(a.rows, d):
                    for dt in (torch.float32, torch.bfloat16):
                        A = filled((k, m) if ta else (m, k), 0.5, dt)
                        B = filled((n, k) if tb else (k, n), 0.5, dt)
                        A = A.t() if ta else A
                        B = B.t() if tb else B
                        C = torch.empty(m, n, dtype=dt)
                        s = timed(lambda: torch.matmul(A, B, out=C), w, it)
                        gf = 2 * m * n * k / s / 1e9
                        label = "f32" if dt == torch.float32 else "bf16"
                        print(f"{name:<26} {d:>5} {m:>6} {n:>6} {k:>6}  torch {label:<5} {nt:>3} {s * 1e6:>10.1f} {gf:>8.1f}")
                        rows.append(dict(section="gemm", shape=name, D=d, m=m, n=n, k=k, dtype=label,
                                         threads=nt, median_us=s * 1e6, gflops=gf))
        if "elementwise" in only:
            d = dims[-1]
            n = a.rows * 4 * d
            x, y = filled((n,), 3.0), filled((n,), 1.0)
            out = torch.empty(n)
            f = 4.0 * n
            print(f"\n== element-wise f32, n = {n}, {nt} thread(s)")
            cases = [("add", 3 * f, lambda: torch.add(x, y, out=out)),
                     ("gelu (erf)", 2 * f, lambda: F.gelu(x)),
                     ("gelu (tanh)", 2 * f, lambda: F.gelu(x, approximate="tanh")),
                     ("gelu_backward (erf)", 3 * f, lambda: torch.ops.aten.gelu_backward(y, x)),
                     ("silu", 2 * f, lambda: F.silu(x))]
            for name, bytes_, fn in cases:
                s = timed(fn, w, it)
                print(f"{name:<22} {s * 1e6:>10.1f} {bytes_ / s / 1e9:>8.2f}")
                rows.append(dict(section="elementwise", op=name, threads=nt, median_us=s * 1e6, gbps=bytes_ / s / 1e9))
        if "rows" in only:
            print(f"\n== row kernels, {nt} thread(s)")
            for d in dims:
                x = filled((a.rows, d), 2.0).requires_grad_(True)
                wt = filled((d,), 1.0).requires_grad_(True)
                b = filled((d,), 0.1).requires_grad_(True)
                dy = filled((a.rows, d), 1.0)
                f = 4.0 * a.rows * d
                shape = f"[{a.rows},{d}]"
                with torch.no_grad():
                    cases = [(f"rms_norm {shape}", 2 * f, lambda: F.rms_norm(x, (d,), wt, 1e-6)),
                             (f"layer_norm {shape}", 2 * f, lambda: F.layer_norm(x, (d,), wt, b, 1e-5)),
                             (f"softmax {shape}", 2 * f, lambda: torch.softmax(x, -1))]
                    for name, bytes_, fn in cases:
                        s = timed(fn, w, it)
                        print(f"{name:<34} {s * 1e6:>10.1f} {bytes_ / s / 1e9:>8.2f}")
                        rows.append(dict(section="rows", op=name, threads=nt, median_us=s * 1e6, gbps=bytes_ / s / 1e9))
                for name, fwd in ((f"rms_norm fwd+bwd {shape}", lambda: F.rms_norm(x, (d,), wt, 1e-6)),
                                  (f"layer_norm fwd+bwd {shape}", lambda: F.layer_norm(x, (d,), wt, b, 1e-5))):
                    s = timed(lambda: fwd().backward(dy), w, it)
                    print(f"{name:<34} {s * 1e6:>10.1f} {5 * f / s / 1e9:>8.2f}")
                    rows.append(dict(section="rows", op=name, threads=nt, median_us=s * 1e6, gbps=5 * f / s / 1e9))
            logits = filled((a.rows, a.vocab), 4.0).requires_grad_(True)
            targets = torch.tensor([(i * 7919) % a.vocab for i in range(a.rows)])
            s = timed(lambda: F.cross_entropy(logits, targets).backward(), w, it)
            name = f"cross_entropy+dlogits [{a.rows},{a.vocab}]"
            print(f"{name:<34} {s * 1e6:>10.1f} {8.0 * logits.numel() / s / 1e9:>8.2f}")
            rows.append(dict(section="rows", op=name, threads=nt, median_us=s * 1e6, gbps=8.0 * logits.numel() / s / 1e9))
            n = 12 * dims[-1] * dims[-1] * 4
            p = torch.nn.Parameter(filled((n,)))
            p.grad = filled((n,), 0.01)
            opt = torch.optim.AdamW([p], foreach=False)
            s = timed(opt.step, w, it)
            name = f"adamw_step n={n}"
            print(f"{name:<34} {s * 1e6:>10.1f} {28.0 * n / s / 1e9:>8.2f}")
            rows.append(dict(section="rows", op=name, threads=nt, median_us=s * 1e6, gbps=28.0 * n / s / 1e9))
        if "attention" in only:
            print(f"\n== causal attention f32, {nt} thread(s)")
            for d in dims:
                e, h, t = 64, max(1, d // 64), a.seq
                bsz = max(1, a.rows // t)
                qkv = filled((bsz, t, 3, h, e), 0.5)
                q, k, v = (qkv.select(2, i).transpose(1, 2).requires_grad_(True) for i in range(3))
                flops = 4.0 * bsz * h * t * t * e
                with torch.no_grad():
                    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), w, it)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                dout = filled(tuple(o.shape))
                both = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout), w, it)
                bwd = max(both - fwd, 1e-9)
                name = f"B{bsz} H{h} T{t} E{e}"
                print(f"{name + ' fwd':<30} {fwd * 1e6:>10.1f} {flops / fwd / 1e9:>9.1f}")
                print(f"{name + ' bwd':<30} {bwd * 1e6:>10.1f} {2 * flops / bwd / 1e9:>9.1f}")
                rows.append(dict(section="attention", case=name, threads=nt, fwd_us=fwd * 1e6, bwd_us=bwd * 1e6,
                                 fwd_gflops=flops / fwd / 1e9, bwd_gflops=2 * flops / bwd / 1e9))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
