#!/bin/bash
# FP8 kernels: FP8 x FP8 (w8a8) fixed, f16 widening, CUDA cores via f16
export PYTHONPATH=.
timeout 560 python3 .probe/fp8_variants.py > $OUT/fp8_variants.log 2>&1
echo "rc=$?" >> $OUT/fp8_variants.log
grep -o '"product": "[a-z_]*", "rows": [0-9]*\|"best": "[a-z0-9_]*", "best_TBps": [0-9.]*, "bf16_TBps": [0-9.]*' $OUT/fp8_variants.log | paste - - | tail -20
