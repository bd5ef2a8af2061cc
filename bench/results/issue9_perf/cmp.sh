#!/bin/bash
# cmp.sh WORLD ROUNDS variant... : interleaved rounds, median over rounds of each run's median
w=$1; R=$2; shift 2
declare -A res
for r in $(seq $R); do for v in "$@"; do x=$(chrt -f 10 /tmp/perflat/lat_$v $w 1000 7 | awk '{print $3}'); res[$v]="${res[$v]} $x"; done; done
for v in "$@"; do echo "$v world $w: $(echo ${res[$v]} | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END{printf "median %.2f  (runs: ", a[int((NR+1)/2)]}')$(echo ${res[$v]})"; done
