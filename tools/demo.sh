#!/usr/bin/env bash
# The README's main job on the local backend (ranks are threads of one process): a GPT trained
# with FSDP on 4 ranks and checked against one rank, then the layout tour: the ownership rules,
# redistributes checked on every rank and a seeded fuzz run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "== fsdp-train: FSDP over 4 local ranks (fully_shard per block + root), every loss and the final"
echo "   parameters checked against single-rank training"
echo "\$ fsdp-train --backend local --dp-shard 4 --check-parity --log-every 10"
build/examples/fsdp-train --backend local --dp-shard 4 --check-parity --log-every 10
echo
check=build/tools/dtensor-check
$check demo
echo
echo "== redistribute: every rank checks its shard against the global tensor (local backend)"
run() { echo "\$ dtensor-check redistribute $*"; $check redistribute "$@"; echo; }
run --mesh 2x2 --shape 7,5 --from 'S(0),R' --to 'R,S(1)'
run --mesh 2x2 --shape 9,6 --from 'S(0),S(1)' --to 'S(1),S(0)' --planner greedy
run --mesh 2x2 --shape 9,6 --from 'S(0),S(1)' --to 'S(1),S(0)' --planner search
run --mesh 3x2 --shape 7,4 --from '_S(0,2),S(0)' --to 'S(0),R'
run --mesh 2x2x2 --shape 8,8,8 --from 'P,P,S(0)' --to 'S(0),S(0),S(0)'
echo "== fuzz: random meshes, shapes, dtypes and placement pairs (invalid ones must raise the right error)"
$check fuzz --cases 300 --seed 7
