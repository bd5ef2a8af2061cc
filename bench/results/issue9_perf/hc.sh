#!/bin/bash
# hc.sh WORLD ROUNDS variant... : host-cost, interleaved; medians over rounds of redistribute/raw/framework
w=$1; R=$2; shift 2
tmp=$(mktemp -d)
for r in $(seq $R); do for v in "$@"; do chrt -f 10 /tmp/perflat/db_$v --host-cost --world $w --iters 7 --host-calls 1000 2>&1 | awk -v w=$w '$1==w && $2=="S(0)->R" {print $4, $7, $8}' >> $tmp/$v; done; done
for v in "$@"; do python3 -c "
import sys,statistics as s
rows=[list(map(float,l.split())) for l in open('$tmp/$v') if l.strip()]
print('%-10s world $w: redistribute %.2f raw %.2f framework %.2f  (framework runs: %s)'%('$v',s.median(r[0] for r in rows),s.median(r[1] for r in rows),s.median(r[2] for r in rows),' '.join('%.2f'%r[2] for r in rows)))"; done
rm -rf $tmp
