#!/usr/bin/env bash
# gpu-check: every GPU check of the project in one device run (docs/gpu-check.md).
#
#   tools/gpu-check.sh build   [--build-dir build-gpu] [--carry .gpu-check]
#       here (CUDA toolkit, no GPU needed): configures a release tree for sm_90 without MPI,
#       builds the programs below, and gathers them (stripped) with the shared libraries a
#       stock machine lacks into the git-ignored --carry folder (its MANIFEST lists each file).
#       cuBLAS, cuBLASLt and NCCL (hundreds of MiB) are not carried: the device image has them
#       (its Python's nvidia packages, or its CUDA toolkit); `run` finds them.
#   tools/gpu-check.sh run     [--carry .gpu-check] [--out DIR] [--python python3] [--budget 480]
#       on the GPU machine: the checks below, each under its own timeout, all within --budget
#       seconds; writes DIR/gpu-check.md (the summary table) and DIR/gpu-check.log (every
#       check's output); exit 0 when every check passed, 1 otherwise.
#   tools/gpu-check.sh --dry-run [--build-dir build] [--python python3]
#       here, without a GPU: parses the options, gathers a carry folder from --build-dir into a
#       temporary folder and checks that every binary's libraries resolve in it, on a stock
#       system or among the device's (cuBLAS, NCCL, the driver), runs the PyTorch-absent path
#       of bench/gpu_step_torch.py, and prints the table with every GPU check as "dry" (its
#       command line). Exit 0 when all that holds. The test suite runs it (test gpu-check-dry-run).
#
# The device call (the session's `run` tool; 15 minutes of device time in all, starts included):
#   command: tools/gpu-check.sh run --out $OUT
#   carry:   [".gpu-check"]
#   timeout_s: 560
#
# Checks (name: what; a row of the table each):
#   env                  nvidia-smi -L, the driver
#   libs                 every carried binary's shared libraries resolve (ldd)
#   kernels-gpu, kernels-gpu-ops, nn-gpu, fsdp-meta-gpu, fsdp-offload-gpu, collectives-nccl-gpu,
#   collectives-nccl     the [gpu] test programs (exit 77, skipped, counts as a failure here)
#   local-cuda-2/4/8     dtensor-check redistribute --device cuda on the local backend, 2, 4, 8 ranks
#   fuzz-cuda            dtensor-check fuzz --device cuda: same cases, routes and expected errors
#                        as the same seed on the CPU, every case passing on both
#   nccl-1               dtensor-check redistribute --backend nccl on a one-rank mesh
#   bandwidth            gpu-bench kernels: copy / cast / chunk_cat / split_copy as a fraction of
#                        cudaMemcpy device-to-device (detail: the fractions; "low" below 0.90)
#   fsdp-fp32, fsdp-bf16 fsdp-train --backend nccl --check-parity (f32, --mp bf16) against the CPU
#   gpt-bf16             fsdp-train --mp bf16 on a dim-1024 8-layer GPT: tokens/s, TFLOP/s
#   torch-bf16           bench/gpu_step_torch.py, the same model under PyTorch (skip: no torch)
#   overlap              gpu-bench overlap: an nccl all_reduce hidden behind a matmul
#   offload-overlap      fsdp-train --offload: ms/step with pinned memory and the copy stream
#                        (default), with --no-pin-memory (synchronous copies), and without offload
# A "low" or "skip" row does not fail the run except where said; "FAIL" does.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "gpu-check: $*" >&2; exit 2; }

# Libraries every Linux machine has (glibc, the GCC runtime), and the ones the device brings.
STOCK_LIBS="linux-vdso.so.1 ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libstdc++.so.6 libgcc_s.so.1"
DEVICE_LIBS="libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libnccl.so.2"
# Programs carried: path under the build tree.
BINS="tests/kernels/kernels_gpu_test tests/kernels/kernels_gpu_ops_test tests/nn/nn_gpu_test
tests/fsdp/fsdp_gpu_meta_test tests/fsdp/fsdp_gpu_offload_test tests/collectives/collectives_nccl_gpu_test
tests/collectives/collectives_nccl_test tools/dtensor-check examples/fsdp-train bench/gpu-bench"
MAX_CARRY_MIB=48   # the working tree (~9 MiB) travels beside it, 64 MiB in all

mode="" build_dir="" carry=".gpu-check" out="" python=python3 budget=480
case "${1:-}" in
  build | run) mode=$1; shift ;;
  --dry-run) mode=dry; shift ;;
  -h | --help | help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  *) die "unknown mode '$1': expected build, run, --dry-run or --help" ;;
esac
while (($#)); do
  case "$1" in
    --build-dir | --carry | --out | --python | --budget)
      (($# >= 2)) || die "$1 needs a value"
      case "$1" in
        --build-dir) build_dir=$2 ;; --carry) carry=$2 ;; --out) out=$2 ;;
        --python) python=$2 ;; --budget) budget=$2 ;;
      esac
      shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1' for $mode" ;;
  esac
done
[[ $budget =~ ^[0-9]+$ ]] && ((budget >= 10 && budget <= 600)) || die "--budget '$budget': expected 10..600 seconds"
[[ -n $build_dir ]] || { [[ $mode == dry ]] && build_dir=build || build_dir=build-gpu; }

# ---- gathering the carry folder ----

# needed_libs BINARY: "soname path" per line, the path "not found" when ldd cannot resolve it.
needed_libs() {
  ldd "$1" 2>/dev/null | awk '/=>/ {print $1, ($3 == "not" ? "not-found" : $3); next} NF {print $1, $1}'
}
in_list() { [[ " $2 " == *" $1 "* ]]; }
is_stock() { in_list "$(basename "$1")" "$STOCK_LIBS"; }

# gather BUILD_DIR DEST: binaries (stripped) into DEST/bin, the libraries neither stock nor the
# device's into DEST/lib, DEST/MANIFEST. Fails naming a missing binary or library.
gather() {
  local src=$1 dest=$2 b name lib path
  rm -rf "$dest" && mkdir -p "$dest/bin" "$dest/lib" || return 1
  for b in $BINS; do
    [[ -x $src/$b ]] || { echo "gpu-check: $src/$b is missing (build it first)" >&2; return 1; }
    cp "$src/$b" "$dest/bin/" && strip --strip-unneeded "$dest/bin/$(basename "$b")" || return 1
    while read -r lib path; do
      name=$(basename "$lib")
      is_stock "$name" || in_list "$name" "$DEVICE_LIBS" || [[ -e $dest/lib/$name ]] && continue
      [[ $path == not-found ]] && { echo "gpu-check: $b needs $name, not found here" >&2; return 1; }
      cp -L "$path" "$dest/lib/$name" || return 1
    done < <(needed_libs "$src/$b")
  done
  {
    echo "# gpu-check carry folder: built from $src ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)) on $(date -u +%FT%TZ)"
    echo "# bytes path"
    (cd "$dest" && find bin lib -type f -printf '%s %p\n' | sort -k2)
    echo "# from the device, not carried: $DEVICE_LIBS"
  } > "$dest/MANIFEST"
}

# check_carry DIR [size]: every binary's libraries are carried, stock or the device's; with
# `size`, the folder fits what travels (a dry run's tree may be a sanitizer or debug build).
check_carry() {
  local dir=$1 b lib path name bad=0 kib
  for b in "$dir"/bin/*; do
    while read -r lib path; do
      name=$(basename "$lib")
      [[ -e $dir/lib/$name ]] || is_stock "$name" || in_list "$name" "$DEVICE_LIBS" && continue
      echo "gpu-check: $(basename "$b") needs $name: not carried, not stock, not the device's" >&2
      bad=1
    done < <(LD_LIBRARY_PATH="$dir/lib" needed_libs "$b")
  done
  kib=$(du -sk "$dir" | cut -f1)
  if [[ ${2:-} == size ]] && ((kib > MAX_CARRY_MIB * 1024)); then
    echo "gpu-check: $dir is $((kib / 1024)) MiB, above $MAX_CARRY_MIB MiB" >&2
    bad=1
  fi
  return $bad
}

if [[ $mode == build ]]; then
  command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || die "build: nvcc not found (install the CUDA toolkit)"
  export PATH=$PATH:/usr/local/cuda/bin
  [[ -f $ROOT/tools/ccache_env.sh ]] && source "$ROOT/tools/ccache_env.sh"
  if [[ ! -f $build_dir/build.ninja ]]; then
    meson setup "$build_dir" --buildtype=release -Dcuda=enabled -Dmpi=disabled -Dgpu_arch=90 || exit 2
  else
    meson configure "$build_dir" --buildtype=release -Dcuda=enabled -Dmpi=disabled -Dgpu_arch=90 || exit 2
  fi
  nice -n 10 ninja -C "$build_dir" $BINS || exit 1
  gather "$build_dir" "$carry" || exit 1
  check_carry "$carry" size || exit 1
  cat "$carry/MANIFEST"
  echo "gpu-check: $carry is $(du -sh "$carry" | cut -f1); run it on the GPU machine with"
  echo "  command: tools/gpu-check.sh run --out \$OUT    carry: [\"$carry\"]    timeout_s: 560"
  exit 0
fi

# ---- the checks ----

dry=0; [[ $mode == dry ]] && dry=1
if ((dry)); then
  work=$(mktemp -d) || exit 2
  trap 'rm -rf "$work"' EXIT
  logdir=$work/logs
  [[ -d $build_dir ]] || die "--dry-run: build tree '$build_dir' not found"
else
  [[ -d $carry/bin ]] || die "run: carry folder '$carry/bin' not found (tools/gpu-check.sh build, then carry it)"
  [[ -n $out ]] || out=$ROOT/gpu-check-out
  mkdir -p "$out" || die "run: cannot create --out '$out'"
  work=$(mktemp -d) || exit 2  # per-check logs (the device returns at most 8 files from --out)
  trap 'rm -rf "$work"' EXIT
  logdir=$work/logs
fi
mkdir -p "$logdir"
rows=() failed=0 t_start=$SECONDS
BIN=$carry/bin

row() {  # row NAME STATUS SECONDS DETAIL
  rows+=("| $1 | $2 | $3 | $4 |")
  [[ $2 == FAIL ]] && failed=1
  printf '%-22s %-5s %5ss  %s\n' "$1" "$2" "$3" "$4"
}

# check NAME TIMEOUT CMD...: runs CMD under its timeout (cut to what is left of the budget),
# output to logs/NAME.log; status pass (0), skip (77), FAIL (anything else; 124: timed out).
# Sets $rc and $log for the caller's detail. In a dry run: records the command only.
check() {
  local name=$1 limit=$2 left t0
  shift 2
  log=$logdir/$name.log rc=0
  if ((dry)); then
    local shown="$*"
    row "$name" dry 0 "\`${shown//$work\//}\`"
    : > "$log"
    rc=dry
    return
  fi
  left=$((budget - (SECONDS - t_start)))
  if ((left < 5)); then  # the caller's row says so (why)
    rc=125 secs=0
    return
  fi
  ((limit > left)) && limit=$left
  t0=$SECONDS
  echo "== $name: $* (timeout ${limit} s)" >> "$out/gpu-check.log"
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  cat "$log" >> "$out/gpu-check.log"
  secs=$((SECONDS - t0))
}
status_of() { case $rc in 0) echo pass ;; 77) echo "${1:-FAIL}" ;; *) echo FAIL ;; esac; }
why() {  # the detail of a failed check: timeout or the last line of its log
  if ((rc == 125)); then echo "not run: the ${budget} s budget is spent"
  elif ((rc == 124 || rc == 137)); then echo "timed out (rc $rc)"; else echo "rc $rc: $(tail -n 1 "$log" | cut -c1-120)"; fi
}
done_check() {  # done_check NAME DETAIL_IF_PASSED [STATUS_FOR_77]: the row of a check just run
  [[ $rc == dry ]] && return
  local st; st=$(status_of "${3:-}")
  if [[ $st == pass || $st == skip ]]; then row "$1" "$st" "$secs" "$2"; else row "$1" "$st" "$secs" "$(why)"; fi
}
catch2_detail() { grep -E "All tests passed|test cases:|skipped:" "$log" | tail -n 1 | cut -c1-100; }

if ((dry)); then
  # Host side: the carry folder from the given tree, its libraries, the PyTorch-absent path.
  t0=$SECONDS
  if gather "$build_dir" "$work/carry" 2> "$logdir/gather.err" && check_carry "$work/carry" 2>> "$logdir/gather.err"; then
    row carry pass $((SECONDS - t0)) "$(ls "$work/carry/bin" | wc -l) binaries, libs: $(ls "$work/carry/lib" | tr '\n' ' ')($(du -sh "$work/carry" | cut -f1))"
  else
    row carry FAIL $((SECONDS - t0)) "$(tail -n 1 "$logdir/gather.err")"
  fi
  t0=$SECONDS
  "$python" bench/gpu_step_torch.py --pretend-no-torch > "$logdir/torch.log" 2>&1
  rc=$?
  if ((rc == 77)) && grep -q '^skipped: ' "$logdir/torch.log"; then
    row torch-absent pass $((SECONDS - t0)) "$(cut -c1-80 "$logdir/torch.log")"
  else
    row torch-absent FAIL $((SECONDS - t0)) "expected exit 77 and 'skipped: ...', got rc $rc"
  fi
  BIN=$work/carry/bin
else
  # The libraries the device brings: its Python's nvidia packages or its CUDA toolkit.
  libpath=$ROOT/$carry/lib
  [[ $carry == /* ]] && libpath=$carry/lib
  for lib in $DEVICE_LIBS; do
    [[ $lib == libcuda.so.1 ]] && continue
    ldconfig -p 2>/dev/null | grep -q "$lib " && continue
    dir=$( { "$python" -c 'import site; print("\n".join(p + "/nvidia" for p in site.getsitepackages()))' 2>/dev/null
             echo /usr/local/cuda/lib64; echo /usr/local/cuda/lib; } |
      while read -r d; do [[ -d $d ]] && find -L "$d" -maxdepth 5 -name "$lib" -print -quit 2>/dev/null; done | head -n 1)
    [[ -n $dir ]] && libpath=$libpath:$(dirname "$dir")
  done
  export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  : > "$out/gpu-check.log"
  check env 20 nvidia-smi -L
  done_check env "$(head -n 1 "$log" | cut -c1-60); driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  t0=$SECONDS
  missing=$(for b in "$BIN"/*; do ldd "$b" | grep 'not found' | sed "s|^|$(basename "$b"): |"; done)
  if [[ -z $missing ]]; then row libs pass $((SECONDS - t0)) "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; else row libs FAIL $((SECONDS - t0)) "$(echo "$missing" | head -n 3 | tr '\n' ';')"; fi
fi

for t in kernels_gpu_test:kernels-gpu kernels_gpu_ops_test:kernels-gpu-ops nn_gpu_test:nn-gpu \
         fsdp_gpu_meta_test:fsdp-meta-gpu fsdp_gpu_offload_test:fsdp-offload-gpu \
         collectives_nccl_gpu_test:collectives-nccl-gpu \
         collectives_nccl_test:collectives-nccl; do
  check "${t#*:}" 120 "$BIN/${t%%:*}"
  done_check "${t#*:}" "$(catch2_detail)"
done

# The local backend over CUDA memory: each transition checked on every rank (values known).
for w in 2 4 8; do
  mesh=$w; ((w == 8)) && mesh=2x4
  pairs=("S(0)" "R" "R" "S(1)" "P" "S(0)" "S(1)" "S(0)")
  ((w == 8)) && pairs=("S(0),S(1)" "R,R" "P,R" "S(0),S(1)" "S(1),R" "R,S(0)")
  if ((dry)); then
    check "local-cuda-$w" 60 "$BIN/dtensor-check" redistribute --device cuda --mesh "$mesh" --shape 37,21 --from "${pairs[0]}" --to "${pairs[1]}"
    continue
  fi
  t0=$SECONDS n=0 bad=""
  for ((i = 0; i < ${#pairs[@]}; i += 2)); do
    for dt in f32 bf16; do
      check "local-cuda-$w" 60 "$BIN/dtensor-check" redistribute --device cuda --mesh "$mesh" --shape 37,21 \
        --dtype $dt --from "${pairs[i]}" --to "${pairs[i + 1]}"
      n=$((n + 1))
      ((rc == 0)) || bad="${pairs[i]}->${pairs[i + 1]} $dt: $(why)"
    done
  done
  secs=$((SECONDS - t0))
  if [[ -z $bad ]]; then row "local-cuda-$w" pass $secs "$n redistributes, every rank ok"; else rc=1; row "local-cuda-$w" FAIL $secs "$bad"; fi
done

# Fuzz on CUDA memory against the same seed on the CPU: same cases executed, same errors.
fuzz=(fuzz --cases 300 --seed 31 --max-ranks 8)
check fuzz-cpu 120 "$BIN/dtensor-check" "${fuzz[@]}" --device cpu
cpu_log=$logdir/fuzz-cpu.log cpu_rc=$rc
check fuzz-cuda 180 "$BIN/dtensor-check" "${fuzz[@]}" --device cuda
if [[ $rc != dry ]]; then
  summary() { grep -o 'meshes: .* (InvalidArgument [0-9]*, Unsupported [0-9]*)' "$1"; }
  if ((rc == 0 && cpu_rc == 0)) && [[ -n $(summary "$log") && $(summary "$log") == "$(summary "$cpu_log")" ]]; then
    row fuzz-cuda pass "$secs" "$(tail -n 1 "$log"); as the CPU: $(summary "$log" | cut -c1-70)"
  elif ((rc == 0 && cpu_rc == 0)); then
    rc=1; row fuzz-cuda FAIL "$secs" "differs from the CPU run: '$(summary "$log")' vs '$(summary "$cpu_log")'"
  else
    ((rc == 0)) && { rc=$cpu_rc; log=$cpu_log; }
    row fuzz-cuda FAIL "$secs" "$(why)"
  fi
fi

# The nccl backend on one rank.
if ((dry)); then
  check nccl-1 30 "$BIN/dtensor-check" redistribute --backend nccl --mesh 1 --shape 37,5 --from "S(0)" --to R
else
  t0=$SECONDS n=0 bad=""
  for c in "S(0) R" "R S(0)" "P R" "P S(0)" "S(1) S(0)"; do
    set -- $c
    check nccl-1 30 "$BIN/dtensor-check" redistribute --backend nccl --mesh 1 --shape 37,5 --from "$1" --to "$2"
    n=$((n + 1))
    ((rc == 0)) || bad="$1->$2: $(why)"
  done
  secs=$((SECONDS - t0))
  if [[ -z $bad ]]; then row nccl-1 pass $secs "$n redistributes ok"; else rc=1; row nccl-1 FAIL $secs "$bad"; fi
fi

# Kernel bandwidth against cudaMemcpy device-to-device of the same run.
check bandwidth 90 "$BIN/gpu-bench" kernels
if [[ $rc == 0 ]]; then
  detail=$(sed -n 's/.*"kernel":"\([^"]*\)".*"gbps":\([0-9.]*\),"fraction":\([0-9.]*\).*/\1 \2 \3/p' "$log" |
    awk '{f = $NF; g = $(NF-1); $NF = ""; $(NF-1) = ""; sub(/ +$/, ""); split($0, w, " "); printf "%s%s %s %.0f GB/s %.2f", (NR > 1 ? "; " : ""), w[1], w[2], g, f; if (NR > 1 && f < 0.90) low = 1} END {if (low) printf " (low: below 0.90)"}')
  st=pass; [[ $detail == *"(low"* ]] && st=low
  grep -q '"ok":false' "$log" && { st=FAIL; detail="wrong output: $(grep '"ok":false' "$log" | head -n 1 | cut -c1-80)"; }
  row bandwidth "$st" "$secs" "$detail"
else
  done_check bandwidth ""
fi

# fsdp-train on the GPU against one CPU rank (--check-parity).
for mp in fp32 bf16; do
  check "fsdp-$mp" 150 "$BIN/fsdp-train" --backend nccl --dp-shard 1 --steps 5 --mp $mp --check-parity
  done_check "fsdp-$mp" "$(tail -n 1 "$log" | grep -o '"parity":"[a-z]*","max_rel_loss_diff":[^,]*,"max_param_diff":[^,]*' | tr -d '"')"
done

# The bf16 step of a dim-1024, 8-layer GPT, ours then PyTorch's, with the same FLOP count.
D=1024 L=8 H=16 T=1024 B=8 V=8192
fpt=$((6 * (12 * L * D * D + V * D) + 12 * L * T * D))
model=(--dim $D --layers $L --heads $H --seq $T --batch $B --vocab $V)
check gpt-bf16 150 "$BIN/fsdp-train" --backend nccl --dp-shard 1 --steps 6 --log-every 1 --mp bf16 "${model[@]}"
if [[ $rc == 0 ]]; then
  tps=$(tail -n 1 "$log" | grep -o '"tokens_per_s":[0-9.]*' | cut -d: -f2)
  row gpt-bf16 pass "$secs" "$(awk -v t="${tps:-0}" -v f=$fpt 'BEGIN {printf "%.0f tokens/s, %.2f TFLOP/s (%d FLOP/token; B %d T %d)", t, t * f / 1e12, f, '$B', '$T'}')"
else
  done_check gpt-bf16 ""
fi
if ((dry)); then
  check torch-bf16 150 "$python" bench/gpu_step_torch.py "${model[@]}"
else
  check torch-bf16 150 env PYTHONUNBUFFERED=1 "$python" bench/gpu_step_torch.py "${model[@]}"
  if [[ $rc == 0 ]]; then
    row torch-bf16 pass "$secs" "$(tail -n 1 "$log" | sed 's/[{}"]//g' | cut -c1-110)"
  else
    done_check torch-bf16 "$(tail -n 1 "$log" | cut -c1-100)" skip
  fi
fi

# A collective on the nccl stream hidden behind a matmul on the compute stream.
check overlap 60 "$BIN/gpu-bench" overlap
if [[ $rc == 0 ]]; then
  row overlap pass "$secs" "$(tail -n 1 "$log" | sed 's/[{}"]//g')"
else
  done_check overlap ""
fi

# FSDP offload on the GPU (fsdp/offload.h): the step time with pinned memory and copies on the
# copy stream, with synchronous copies from ordinary memory, and without offload; the same model.
OB=8 OT=512
om=(--backend nccl --dp-shard 1 --steps 6 --log-every 1 --mp bf16 --dim 768 --layers 6 --heads 12 --seq $OT
    --batch $OB --vocab 8192)
if ((dry)); then
  check offload-overlap 90 "$BIN/fsdp-train" "${om[@]}" --offload
else
  t0=$SECONDS bad="" ms=()
  for v in "--offload" "--offload --no-pin-memory" ""; do
    check offload-overlap 90 "$BIN/fsdp-train" "${om[@]}" $v
    tps=$(tail -n 1 "$log" | grep -o '"tokens_per_s":[0-9.]*' | cut -d: -f2)
    if ((rc != 0)) || [[ -z $tps ]] || ! awk -v t="$tps" 'BEGIN {exit !(t > 0)}'; then
      bad="${v:-no offload}: $(why)"
      break
    fi
    ms+=("$(awk -v t="$tps" 'BEGIN {printf "%.1f", 1000 * '$OB' * '$OT' / t}')")
  done
  secs=$((SECONDS - t0))
  if [[ -z $bad ]]; then
    row offload-overlap pass $secs "ms/step: pinned ${ms[0]}, pageable ${ms[1]}, no offload ${ms[2]} (pageable / pinned $(awk 'BEGIN {printf "%.2f", '"${ms[1]}"' / '"${ms[0]}"'}'))"
  else
    rc=1; row offload-overlap FAIL $secs "$bad"
  fi
fi

table=$(printf '| check | status | s | detail |\n|---|---|---|---|\n'; printf '%s\n' "${rows[@]}")
echo
echo "$table"
if ((!dry)); then
  { echo "gpu-check $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null), $(date -u +%FT%TZ), $(nvidia-smi -L 2>/dev/null | head -n 1)"; echo; echo "$table"; } > "$out/gpu-check.md"
  echo "gpu-check: $((SECONDS - t_start)) s; table in $out/gpu-check.md, output in $out/gpu-check.log"
fi
exit $failed
