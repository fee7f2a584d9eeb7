#!/bin/bash
# FP8 kernel: the tilings swept at decode row counts, then the 8B decode with the best
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
export PYTHONPATH=.
timeout 570 python3 benchmarks/bench_8b.py fp8 --sweep --product-rows 1 16 32 64 --batches 1 32 --shapes 3,1,4 > $OUT/fp8_sweep.log 2>&1
echo "rc=$?" >> $OUT/fp8_sweep.log
tail -5 $OUT/fp8_sweep.log
