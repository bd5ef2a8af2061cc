#!/usr/bin/env python3
"""tools/gpu-check.sh `run` end to end without a GPU: the carried programs and nvidia-smi are
replaced by small scripts that print what the real ones print on a GPU (the formats of
gpu-bench, fsdp-train, dtensor-check and the Catch2 programs), so every parser, the table, the
budget and the exit status are exercised. Scenarios: all pass (exit 0; the TFLOP/s computed from
tokens/s; a bandwidth row "low"); a parity failure; a fuzz summary that differs from the CPU's; a
[gpu] program that reports skipped (exit 77: a failure there)."""
import os
import stat
import subprocess
import sys
import tempfile

SCRIPT = sys.argv[1]
failures = []
ran = 0


def check(cond, what):
    if not cond:
        failures.append(what)


CATCH2 = 'echo "All tests passed (12 assertions in 3 test cases)"'
FUZZ = """case "$*" in
  *fuzz*) echo "fuzz: seed 31, backend local, planner both, up to 8 ranks, 7 meshes: 250 cases executed (400 routes), 50 expected errors raised (InvalidArgument 40, Unsupported 10); planned in 0.1 s, total 2 s"
          echo "fuzz: 300 cases, 300 passed, 0 failed" ;;
  *) echo '{"plan":"[S(0)] -AG(0)-> [R]","collectives":1,"bytes_per_rank":8}'; echo '{"rank":0,"local_shape":[37,21],"ok":true}' ;;
esac"""
BENCH = """case "$1" in
  kernels)
    echo '{"kernel":"cudaMemcpy d2d f32","bytes":536870912,"us":180.1,"gbps":2980.8,"fraction":1.000,"ok":true}'
    echo '{"kernel":"copy f32->f32","bytes":536870912,"us":190.0,"gbps":2825.6,"fraction":0.948,"ok":true}'
    echo '{"kernel":"chunk_cat f32 dim 2048 world 8","bytes":402653184,"us":300.0,"gbps":1342.2,"fraction":0.450,"ok":true}' ;;
  overlap) echo '{"matmul_us":1500.0,"all_reduce_us":350.0,"both_us":1520.0,"hidden":0.943,"ok":true}' ;;
esac"""
TRAIN = """case "$*" in
  *--check-parity*) echo '{"steps":5,"first_loss":4.1,"last_loss":3.9,"parity":"PARITY","max_rel_loss_diff":1.5e-07,"max_param_diff":3.9e-06,"tokens_per_s":1000}'
                    [ PARITY = ok ] ;;
  *--no-pin-memory*) echo '{"steps":6,"parity":"skipped","tokens_per_s":40000,"peak_bytes":1}' ;;
  *--offload*) echo '{"steps":6,"parity":"skipped","tokens_per_s":80000,"peak_bytes":1}' ;;
  *) echo 'step 6/6 loss 9.1 ms 100.0'; echo '{"steps":6,"first_loss":9.2,"last_loss":9.1,"parity":"skipped","tokens_per_s":100000,"peak_bytes":1}' ;;
esac"""


def write(path, body):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


def scenario(name, parity="ok", cuda_summary=None, skipped_test=None):
    global ran
    ran += 1
    with tempfile.TemporaryDirectory() as tmp:
        carry, out, path = os.path.join(tmp, "carry"), os.path.join(tmp, "out"), os.path.join(tmp, "path")
        for d in (carry + "/bin", carry + "/lib", path):
            os.makedirs(d)
        for b in ("kernels_gpu_test", "kernels_gpu_ops_test", "nn_gpu_test", "fsdp_gpu_meta_test",
                  "fsdp_gpu_offload_test", "collectives_nccl_gpu_test", "collectives_nccl_test"):
            write(f"{carry}/bin/{b}", 'echo "skipped: no GPU"; exit 77' if b == skipped_test else CATCH2)
        fuzz = FUZZ
        if cuda_summary:
            fuzz = fuzz.replace('*fuzz*) echo', '*--device\\ cuda*) echo "fuzz: seed 31, backend local on cuda, planner both, up to 8 ranks, 7 meshes: ' + cuda_summary + '"; echo "fuzz: 300 cases, 300 passed, 0 failed" ;;\n  *fuzz*) echo', 1)
        write(f"{carry}/bin/dtensor-check", fuzz)
        write(f"{carry}/bin/gpu-bench", BENCH)
        write(f"{carry}/bin/fsdp-train", TRAIN.replace("PARITY", parity))
        write(f"{path}/nvidia-smi", 'case "$*" in *query*) echo 580.1 ;; *) echo "GPU 0: Fake H100 (UUID: x)" ;; esac')
        env = dict(os.environ, PATH=path + os.pathsep + os.environ["PATH"])
        r = subprocess.run(["bash", SCRIPT, "run", "--carry", carry, "--out", out, "--budget", "120"],
                           capture_output=True, text=True, timeout=300, env=env)
        rows = {}
        for line in r.stdout.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 4 and cells[0] != "check":
                rows[cells[0]] = cells
        table = open(os.path.join(out, "gpu-check.md")).read() if os.path.exists(os.path.join(out, "gpu-check.md")) else ""
        check("| gpt-bf16 |" in table, f"{name}: gpu-check.md holds the table")
        return r, rows


# Every check passes (torch-bf16: pass or skip, whichever this python allows).
r, rows = scenario("all pass")
check(r.returncode == 0, f"all pass: exit 0, got {r.returncode}: {r.stdout[-400:]} {r.stderr[-400:]}")
expected = ["env", "libs", "kernels-gpu", "kernels-gpu-ops", "nn-gpu", "fsdp-meta-gpu", "fsdp-offload-gpu",
            "collectives-nccl-gpu", "collectives-nccl", "local-cuda-2", "local-cuda-4", "local-cuda-8", "fuzz-cuda",
            "nccl-1", "bandwidth", "fsdp-fp32", "fsdp-bf16", "gpt-bf16", "torch-bf16", "overlap", "offload-overlap"]
check(sorted(rows) == sorted(expected), f"all pass: rows {sorted(rows)}")
for name, cells in rows.items():
    ok = {"bandwidth": ("low",), "torch-bf16": ("pass", "skip")}.get(name, ("pass",))
    check(cells[1] in ok, f"all pass: row {name} is {cells[1]}, expected {ok}: {cells[3]}")
if "env" in rows:
    check("Fake H100" in rows["env"][3] and "580.1" in rows["env"][3], f"env detail: {rows['env'][3]}")
if "gpt-bf16" in rows:
    # 6 (12 L D^2 + V D) + 12 L T D with D 1024, L 8, V 8192, T 1024: 754974720 FLOP per token.
    check("100000 tokens/s, 75.50 TFLOP/s (754974720 FLOP/token" in rows["gpt-bf16"][3], f"gpt-bf16: {rows['gpt-bf16'][3]}")
if "bandwidth" in rows:
    check("copy f32->f32 2826 GB/s 0.95" in rows["bandwidth"][3] and "(low: below 0.90)" in rows["bandwidth"][3],
          f"bandwidth: {rows['bandwidth'][3]}")
if "fsdp-bf16" in rows:
    check("parity:ok" in rows["fsdp-bf16"][3], f"fsdp-bf16: {rows['fsdp-bf16'][3]}")
if "fuzz-cuda" in rows:
    check("as the CPU" in rows["fuzz-cuda"][3], f"fuzz-cuda: {rows['fuzz-cuda'][3]}")
if "overlap" in rows:
    check("hidden:0.943" in rows["overlap"][3], f"overlap: {rows['overlap'][3]}")
if "offload-overlap" in rows:
    # 8 x 512 tokens per step at 80000 / 40000 / 100000 tokens/s.
    check("pinned 51.2, pageable 102.4, no offload 41.0 (pageable / pinned 2.00)" in rows["offload-overlap"][3],
          f"offload-overlap: {rows['offload-overlap'][3]}")
if "local-cuda-8" in rows:
    check("6 redistributes" in rows["local-cuda-8"][3], f"local-cuda-8: {rows['local-cuda-8'][3]}")

# A parity failure fails the run and names the check.
r, rows = scenario("parity", parity="mismatch")
check(r.returncode == 1, f"parity: exit 1, got {r.returncode}")
check(rows.get("fsdp-fp32", ["", ""])[1] == "FAIL", f"parity: fsdp-fp32 row {rows.get('fsdp-fp32')}")

# CUDA fuzz that executed other cases than the CPU's.
r, rows = scenario("fuzz", cuda_summary="249 cases executed (400 routes), 50 expected errors raised (InvalidArgument 40, Unsupported 10)")
check(r.returncode == 1, f"fuzz: exit 1, got {r.returncode}")
check(rows.get("fuzz-cuda", ["", ""])[1] == "FAIL" and "differs from the CPU" in rows.get("fuzz-cuda", ["", "", "", ""])[3],
      f"fuzz: row {rows.get('fuzz-cuda')}")

# A [gpu] program that reports skipped is a failure on the GPU machine.
r, rows = scenario("skip", skipped_test="nn_gpu_test")
check(r.returncode == 1, f"skip: exit 1, got {r.returncode}")
check(rows.get("nn-gpu", ["", ""])[1] == "FAIL", f"skip: row {rows.get('nn-gpu')}")

check(ran == 4, f"4 scenarios ran, got {ran}")
for f in failures:
    print("FAIL:", f)
print(f"gpu_check_test: {ran} scenarios, {len(failures)} failures")
sys.exit(1 if failures else 0)
