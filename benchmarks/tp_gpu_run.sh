#!/bin/bash
# One device call on one H200 (no second GPU lent): the split path on a mesh of one GPU
# against the unsplit path (outputs and timings), the 8B shape after the fused-column
# layouts, and the 70B layer shape (40 of its 80 layers: what one of two GPUs holds).
# Run: bash benchmarks/tp_gpu_run.sh [check] [8b] [70b]  (writes $OUT/*.json and logs)
set -x
cd "$(dirname "$0")/.."
export PYTHONPATH=.
parts=" ${*:-check 8b 70b} "
if [[ $parts == *" check "* ]]; then
python3 - <<'PY' 2>&1 | tee $OUT/tp_check.log
import jax, jspec, numpy as np
from jspec.bundle import bundle_path
import os
root = bundle_path()
for dtype in ("float32", "bfloat16"):
    one = jspec.load(os.path.join(root, "target"), draft=os.path.join(root, "eagle3"), dtype=dtype)
    mesh1 = jspec.load(os.path.join(root, "target"), draft=os.path.join(root, "eagle3"), dtype=dtype, devices=1)
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):"]
    for spec in (None, jspec.SpecConfig(3, 1, 4), jspec.SpecConfig(5, 8, 16)):
        for cache in ("dense", jspec.CacheConfig("paged", page_size=16)):
            a = jspec.generate(one, prompts, max_new_tokens=64, spec=spec, cache=cache)
            b = jspec.generate(mesh1, prompts, max_new_tokens=64, spec=spec, cache=cache)
            print(dtype, spec, cache, "equal:", a.tokens == b.tokens, flush=True)
PY
fi
[[ $parts == *" 8b "* ]] && python3 benchmarks/tp_h200.py --shape 8b --devices 0,1 decode rounds 2>&1 | tee $OUT/tp_8b.log
[[ $parts == *" 70b "* ]] && python3 benchmarks/tp_h200.py --shape 70b --layers 40 --devices 0 decode 2>&1 | tee $OUT/tp_70b_L40.log
true
