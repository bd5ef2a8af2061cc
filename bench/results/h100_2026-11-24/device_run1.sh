#!/bin/bash
# Device run 1 for issue 9 (and the [gpu] tests): see /work/notes.
set -u
D=$PWD/.dev; R=/tmp/res; mkdir -p $R
exec > >(tee $R/log1.txt) 2>&1
save() { tar czf $OUT/res.tgz -C $R . ; }
date; nvidia-smi -L; nproc; uname -r; head -2 /etc/os-release
SP=$(python3 -c 'import site;print(site.getsitepackages()[0])')
NV=$(find $SP/nvidia \( -name 'libnccl.so.2' -o -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' \) | xargs -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=$D/lib:$NV
echo "LD=$LD_LIBRARY_PATH"; find $SP/nvidia -name 'libnccl.so*'
for b in $D/bin/*; do ldd $b | grep "not found" | sed "s|^|$(basename $b): |"; done
t() { echo "== $*"; local s=$(date +%s%N); timeout ${TL:-240} "$@"; local rc=$?; echo "rc=$rc wall_ms=$(( ($(date +%s%N) - s) / 1000000 ))"; save; }
t $D/bin/kernels_gpu_test
t $D/bin/kernels_gpu_ops_test
t $D/bin/collectives_nccl_gpu_test
t $D/bin/collectives_nccl_test
for c in "S(0) R" "R S(0)" "P R" "P S(0)" "S(1) S(0)"; do set -- $c; TL=60 t $D/bin/dtensor-check redistribute --backend nccl --mesh 1 --shape 37,5 --from "$1" --to "$2"; done
# overlap with a core per rank (16 cores): local, new then old, 3 repeats
for i in 1 2 3; do for w in 2 4 8; do for v in bin old; do
  TL=100 t $D/$v/dtensor-bench --overlap --world $w --sizes 4M:32M --iters 11 --json $R/ov_local${w}_${v}_$i.json > $R/ov_local${w}_${v}_$i.txt 2>&1; tail -4 $R/ov_local${w}_${v}_$i.txt
done; done; done
cp -rn $D/root/* / ; export PATH=$D/root/usr/bin:$PATH
TL=30 t orterun --allow-run-as-root -np 2 hostname
for i in 1 2 3; do for w in 2 4 8; do for v in bin old; do
  TL=100 t orterun --allow-run-as-root -np $w $D/$v/dtensor-bench --backend mpi --overlap --sizes 4M:32M --iters 11 --json $R/ov_mpi${w}_${v}_$i.json > $R/ov_mpi${w}_${v}_$i.txt 2>&1; tail -4 $R/ov_mpi${w}_${v}_$i.txt
done; done; done
for v in bin old; do TL=120 t $D/$v/dtensor-bench --host-cost > $R/host_$v.txt 2>&1; tail -8 $R/host_$v.txt; done
TL=200 t $D/bin/fsdp-train --backend nccl --dp-shard 1 --steps 5 > $R/fsdp_nccl.txt 2>&1; tail -15 $R/fsdp_nccl.txt
date
