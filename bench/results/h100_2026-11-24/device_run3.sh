#!/bin/bash
set -u
D=$PWD/.dev; R=/tmp/res; mkdir -p $R
exec > >(tee $R/log3.txt) 2>&1
save() { tar czf $OUT/res.tgz -C $R . ; }
SP=$(python3 -c 'import site;print(site.getsitepackages()[0])')
NV=$(find $SP/nvidia \( -name 'libnccl.so.2' -o -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' \) | xargs -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=$D/lib:$NV
t() { echo "== $*"; local s=$(date +%s%N); timeout ${TL:-240} "$@"; local rc=$?; echo "rc=$rc wall_ms=$(( ($(date +%s%N) - s) / 1000000 ))"; save; }
MR="mpirun --allow-run-as-root"
TL=60 t $MR -np 2 $D/bin/dtensor-bench --backend mpi --overlap --sizes 4M:32M --iters 11 --json $R/ov_mpi2_bound.json > $R/ov_mpi2_bound.txt 2>&1; grep -E "backend|warning|within" $R/ov_mpi2_bound.txt
for i in 1 2 3; do for w in 2 4 8; do for v in bin old; do
  [ $w != 2 ] && [ $i = 3 ] && continue
  TL=100 t $MR --bind-to none -np $w $D/$v/dtensor-bench --backend mpi --overlap --sizes 4M:32M --iters 11 --json $R/ovn_mpi${w}_${v}_$i.json > $R/ovn_mpi${w}_${v}_$i.txt 2>&1; grep -E "backend|within" $R/ovn_mpi${w}_${v}_$i.txt
done; done; done
date
