#!/bin/bash
# prev = main at b0363f4 (local workers SCHED_IDLE, mpi workers default policy); batch = every worker SCHED_BATCH
set -u
out=$1; mkdir -p $out
for i in 1 2; do for v in prev batch; do
  b=/tmp/hc/bench_$v
  $b --overlap --world 2 --sizes 4M:32M --iters 11 --json $out/local2_${v}_$i.json > $out/local2_${v}_$i.txt 2>&1
  $b --overlap --world 4 --sizes 4M:32M --iters 11 --json $out/local4_${v}_$i.json > $out/local4_${v}_$i.txt 2>&1
  mpirun --allow-run-as-root -np 2 $b --backend mpi --overlap --sizes 4M:32M --iters 11 --json $out/mpi2_${v}_$i.json > $out/mpi2_${v}_$i.txt 2>&1
  mpirun --allow-run-as-root --oversubscribe -np 4 $b --backend mpi --overlap --sizes 4M:32M --iters 11 --json $out/mpi4_${v}_$i.json > $out/mpi4_${v}_$i.txt 2>&1
  $b --host-cost --world 2 --json $out/host2_${v}_$i.json > $out/host2_${v}_$i.txt 2>&1
  $b --host-cost --world 4 --json $out/host4_${v}_$i.json > $out/host4_${v}_$i.txt 2>&1
done; done
echo done > $out/DONE
