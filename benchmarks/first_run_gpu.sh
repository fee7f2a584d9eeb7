#!/bin/bash
# The first run on a GPU: the CLI's default command, the bench sweep over chains and trees
# for the bundled pair, and the round's fixed cost with a kernel trace. Logs under $OUT.
# Run: OUT=dir bash benchmarks/first_run_gpu.sh
set -u
export PYTHONPATH=.
python3 -m jspec > "$OUT/cli_default.txt" 2>&1
python3 -m jspec bench --max-new-tokens 160 --repeats 5 \
  --spec 3,1,4 4,1,5 5,1,6 6,1,7 8,1,9 4,4,8 5,4,12 5,8,16 6,8,24 7,8,32 > "$OUT/bench_b1.txt" 2>&1
python3 benchmarks/round_cost.py > "$OUT/round_cost_chain.txt" 2>&1
python3 benchmarks/round_cost.py --steps 5 --topk 8 --tokens 16 > "$OUT/round_cost_tree.txt" 2>&1
