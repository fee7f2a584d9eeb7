"""The one-row padding of `models.llama.product` on and off: batch-1 decoding of a
DeepSeek-V2-Lite-shaped model with few layers (random bf16 weights, context 1k), both
settings in one process on the same weights (`jspec.clear_caches()` between), ms a step
from two run lengths' difference and whether the tokens are identical.

Run: PYTHONPATH=. python3 benchmarks/one_row_products.py [layers]   (default 6)
"""
from __future__ import annotations

import sys

import jspec
from benchmarks.common import Runner, random_params
from benchmarks.deepseek_h200 import V2_LITE, prompts
from jspec.models import llama


def main(layers: int):
    cfg = V2_LITE.replace(num_layers=layers)
    target = random_params(cfg)
    kept = llama.GPU_TWO_ROW_ELEMENTS
    tokens = None
    for mode in ("xla", "padded", "xla", "padded"):
        jspec.clear_caches()
        llama.GPU_TWO_ROW_ELEMENTS = kept if mode == "padded" else (0, 0)
        r = Runner(target, prompts(1, cfg.vocab_size), 64)
        per = r.per_round(16, 64, reps=3)[0]
        out = r.run(8)[1].tokens
        tokens = tokens or out
        print(f"{layers} layers, batch 1, one-row products {mode}: {per * 1e3:.3f} ms/step, "
              f"tokens {'identical' if out == tokens else 'DIFFER'}", flush=True)
    llama.GPU_TWO_ROW_ELEMENTS = kept


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
