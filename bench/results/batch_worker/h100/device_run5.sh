#!/bin/bash
D=$PWD/.dev; R=/tmp/res; mkdir -p $R
export LD_LIBRARY_PATH=$D/lib
save() { tar czf $OUT/res.tgz -C $R . ; }
go() {
for i in 1 2; do for v in prev batch; do
  b=$D/bin/bench_$v
  for w in 2 4; do $b --overlap --world $w --sizes 4M:32M --iters 11 > $R/local${w}_${v}_$i.txt 2>&1; echo "local$w $v $i: $(grep 'rows within' $R/local${w}_${v}_$i.txt)"; save; done
  mpirun --allow-run-as-root -np 2 $b --backend mpi --overlap --sizes 4M:32M --iters 11 > $R/mpi2_${v}_$i.txt 2>&1; echo "mpi2 $v $i: $(grep 'rows within' $R/mpi2_${v}_$i.txt)"; save
done; done
for v in prev batch; do mpirun --allow-run-as-root -np 4 $D/bin/bench_$v --backend mpi --overlap --sizes 4M:32M --iters 11 > $R/mpi4_${v}_1.txt 2>&1; echo "mpi4 $v: $(grep 'rows within' $R/mpi4_${v}_1.txt)"; save; done
}
export -f go save; export D R
timeout 200 bash -c go
date
