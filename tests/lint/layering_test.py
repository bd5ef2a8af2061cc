#!/usr/bin/env python3
"""Layering rules of docs/architecture.md section 1, checked on the source tree:
- kernels <- collectives <- dtensor <- nn <- {checkpoint, fsdp}: each folder includes only the
  folders of `allowed` below; checkpoint and fsdp are siblings (neither includes the other);
  program/ sits on kernels/ alone and no library folder includes it (only programs do);
- CUDA and NCCL headers only in .cpp/.cu files under kernels/cuda and collectives/nccl;
- no environment reads or exit() in library code;
- fsdp/ moves every byte through dtensor redistribute: it includes no collectives/ header and
  calls no communicator (collectives::, all_gather(, reduce_scatter(, all_reduce(, ...)."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
below_nn = {"kernels", "collectives", "dtensor", "nn"}
allowed = {
    "kernels": {"kernels"},
    "collectives": {"kernels", "collectives"},
    "dtensor": {"kernels", "collectives", "dtensor"},
    "nn": below_nn,
    "checkpoint": below_nn | {"checkpoint"},
    "fsdp": below_nn | {"fsdp"},
    "program": {"kernels", "program"},
}
layers = list(allowed)
include = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
gpu_header = re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api|nccl|cuda_fp16|cuda_bf16|cublas.*)\.h$")
failures = []
checked = 0
for layer in layers:
    for path in sorted((root / layer).rglob("*")):
        if path.suffix not in {".h", ".cpp", ".cu", ".cuh"}:
            continue
        rel = path.relative_to(root)
        text = path.read_text()
        checked += 1
        for inc in include.findall(text):
            top = inc.split("/")[0]
            if top in allowed and top not in allowed[layer]:
                failures.append(f"{rel}: includes {inc}: {layer}/ may include only {sorted(allowed[layer])}")
            if gpu_header.match(inc.split("/")[-1]):
                gpu_ok = (str(rel).startswith(("kernels/cuda/", "collectives/nccl/"))
                           and path.suffix in {".cpp", ".cu"})
                if not gpu_ok:
                    failures.append(f"{rel}: includes {inc} outside a .cpp/.cu of kernels/cuda or collectives/nccl")
        if re.search(r"\b(getenv|secure_getenv|setenv)\s*\(", text):
            failures.append(f"{rel}: reads or writes the environment in library code")
        # Calls of exit/abort (not methods such as LocalWorld::abort, nor their declarations).
        if re.search(r"(?<![\w:.>])(std::)?(exit|abort|quick_exit|_Exit)\s*\((?!\s*int\b)", text):
            failures.append(f"{rel}: calls exit/abort in library code")
collective_call = re.compile(
    r"(\bcollectives::|[.>](all_gather|reduce_scatter|all_reduce|all_to_all|all_to_all_v|broadcast|scatter|"
    r"barrier|send|recv|send_recv|group_start|group_end)\s*\()")
for path in sorted((root / "fsdp").rglob("*")):
    if path.suffix not in {".h", ".cpp", ".cu", ".cuh"}:
        continue
    rel = path.relative_to(root)
    text = path.read_text()
    for inc in include.findall(text):
        if inc.split("/")[0] == "collectives":
            failures.append(f"{rel}: includes {inc} (fsdp/ communicates only through dtensor redistribute)")
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("//")[0]
        if collective_call.search(code):
            failures.append(f"{rel}:{n}: a collective call in fsdp/ ({code.strip()}); use a DTensor redistribute")
for f in failures:
    print("FAIL:", f)
if checked < 100:  # the tree has hundreds of library files: a wrong root checks nothing
    failures.append(f"only {checked} library files found under {root}")
print(f"layering_test: {checked} files, {len(failures)} failures")
sys.exit(1 if failures else 0)
