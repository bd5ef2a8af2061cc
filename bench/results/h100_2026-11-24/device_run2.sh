#!/bin/bash
set -u
D=$PWD/.dev; R=/tmp/res; mkdir -p $R
exec > >(tee $R/log2.txt) 2>&1
save() { tar czf $OUT/res.tgz -C $R . ; }
SP=$(python3 -c 'import site;print(site.getsitepackages()[0])')
NV=$(find $SP/nvidia \( -name 'libnccl.so.2' -o -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' \) | xargs -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=$D/lib:$NV
ls -la /usr/bin/mpirun* 2>&1; ldconfig -p | grep -E "libmpi.so.40|libpmix|libfmt"
ldconfig -p | grep -q libmpi.so.40 || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$D/mpilib
for b in $D/bin/*; do ldd $b | grep "not found" | sed "s|^|$(basename $b): |"; done
t() { echo "== $*"; local s=$(date +%s%N); timeout ${TL:-240} "$@"; local rc=$?; echo "rc=$rc wall_ms=$(( ($(date +%s%N) - s) / 1000000 ))"; save; }
F=$D/bin/fsdp-train
TL=120 t $F --backend local --dp-shard 1 --steps 5 --log-every 1
TL=120 t $F --backend nccl --dp-shard 1 --steps 5 --log-every 1 --check-parity
TL=120 t $F --backend nccl --dp-shard 1 --steps 5 --mp bf16 --check-parity
TL=120 t $F --backend local --dp-shard 1 --steps 5 --mp bf16
TL=120 t $F --backend nccl --dp-shard 1 --steps 5 --optimizer sgd --clip 1.0 --grad-accum 2 --check-parity
TL=120 t $F --backend nccl --dp-shard 1 --steps 5 --offload --check-parity
TL=120 t $F --backend nccl --dp-shard 1 --steps 20 --layers 4 --dim 512 --heads 8 --seq 256 --batch 16 --log-every 5
TL=120 t $F --backend local --dp-shard 1 --steps 20 --layers 4 --dim 512 --heads 8 --seq 256 --batch 16 --log-every 5
MR="mpirun --allow-run-as-root"
TL=30 t $MR -np 2 hostname
for i in 1 2 3; do for w in 2 4 8; do for v in bin old; do
  TL=100 t $MR -np $w $D/$v/dtensor-bench --backend mpi --overlap --sizes 4M:32M --iters 11 --json $R/ov_mpi${w}_${v}_$i.json > $R/ov_mpi${w}_${v}_$i.txt 2>&1; tail -4 $R/ov_mpi${w}_${v}_$i.txt
done; done; done
date
