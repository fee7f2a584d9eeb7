#!/bin/bash
# FP8 products after the kernel's rework: the 8B step, Qwen3.5-27B (16 layers), DeepSeek-V2-Lite
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
timeout 270 python3 benchmarks/bench_8b.py fp8 --product-rows 1 4 16 32 64 --shapes 3,1,4 5,8,16 > $OUT/bench_fp8.log 2>&1; echo "rc=$?" >> $OUT/bench_fp8.log
timeout 150 python3 benchmarks/qwen35.py fp8 --layers 16 --batches 1,32 > $OUT/qwen35_fp8.log 2>&1; echo "rc=$?" >> $OUT/qwen35_fp8.log
timeout 150 python3 benchmarks/deepseek.py decode --fp8 --batches 1,32 > $OUT/deepseek_fp8.log 2>&1; echo "rc=$?" >> $OUT/deepseek_fp8.log
ls $OUT; grep -h "speed-up\|rc=" $OUT/*.log; tail -4 $OUT/qwen35_fp8.log $OUT/deepseek_fp8.log | cut -c1-300
