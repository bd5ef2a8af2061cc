#!/bin/bash
D=$PWD/.dev
SP=$(python3 -c 'import site;print(site.getsitepackages()[0])')
NV=$(find $SP/nvidia \( -name 'libnccl.so.2' -o -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' \) | xargs -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=$D/lib:$NV:$D/mpilib
nvidia-smi -L
timeout 120 $D/bin/nn_gpu_test --durations yes; echo "rc=$?"
