#!/bin/bash
# Issue 9's two missed targets, old (main at e416965) and new binaries interleaved in one session,
# normal priority (no chrt), nothing else running. Usage: run.sh OLD_BENCH NEW_BENCH OUTDIR
set -u
old=$1 new=$2 out=$3
mkdir -p "$out"
for i in 1 2 3 4; do
  for v in old new; do
    b=${!v}
    "$b" --host-cost --json "$out/host_${v}_$i.json" > "$out/host_${v}_$i.txt" 2>&1
  done
done
for i in 1 2; do
  for v in old new; do
    b=${!v}
    "$b" --overlap --world 4 --sizes 4M:32M --iters 11 --json "$out/overlap_local4_${v}_$i.json" > "$out/overlap_local4_${v}_$i.txt" 2>&1
    mpirun --allow-run-as-root --oversubscribe -np 4 "$b" --backend mpi --overlap --sizes 4M:32M --iters 11 \
      --json "$out/overlap_mpi4_${v}_$i.json" > "$out/overlap_mpi4_${v}_$i.txt" 2>&1
  done
done
