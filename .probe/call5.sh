#!/bin/bash
# DeepSeek FP8 after the kernel's rework and the fused-norm projection: V2-Lite and a V3 layer, batch 1
export PYTHONPATH=.
timeout 175 python3 benchmarks/deepseek.py decode --fp8 --batches 1 > $OUT/deepseek_fp8_b1.log 2>&1; echo "rc=$?" >> $OUT/deepseek_fp8_b1.log
timeout 95 python3 benchmarks/deepseek.py v3layer --fp8 --batch 1 > $OUT/deepseek_v3layer_fp8_b1.log 2>&1; echo "rc=$?" >> $OUT/deepseek_v3layer_fp8_b1.log
ls $OUT; grep -h "ms_per\|rc=\|speed" $OUT/*.log | cut -c1-250
