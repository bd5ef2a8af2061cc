#!/bin/bash
# The FSDP x TP StridedShard rows of bench/RESULTS.md (2026-11-23). Run from anywhere after
# building build/; writes the console output and JSON records next to this script.
cd "$(dirname "$0")/../../.."
B=build/bench/dtensor-bench
O=bench/results/strided
uptime | tee $O/load.txt
for p in search greedy; do
  $B --backend local --world 8 --mesh 2x4 --from '_S(0,4),S(0)' --to 'R,S(0)' --sizes 1M,4M,16M,64M --planner $p --check --json $O/local_unshard_$p.json > $O/local_unshard_$p.txt 2>&1
  $B --backend local --world 8 --mesh 2x4 --from 'P,S(0)' --to '_S(0,4),S(0)' --sizes 1M,4M,16M,64M --planner $p --check --json $O/local_grad_$p.json > $O/local_grad_$p.txt 2>&1
  mpirun --allow-run-as-root --oversubscribe -np 4 $B --backend mpi --mesh 2x2 --from '_S(0,2),S(0)' --to 'R,S(0)' --sizes 1M,4M,16M,64M --planner $p --check --json $O/mpi_unshard_$p.json > $O/mpi_unshard_$p.txt 2>&1
  mpirun --allow-run-as-root --oversubscribe -np 4 $B --backend mpi --mesh 2x2 --from 'P,S(0)' --to '_S(0,2),S(0)' --sizes 1M,4M,16M,64M --planner $p --check --json $O/mpi_grad_$p.json > $O/mpi_grad_$p.txt 2>&1
done
uptime | tee -a $O/load.txt
