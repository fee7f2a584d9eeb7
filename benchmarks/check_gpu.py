"""GPU correctness check of the Pallas kernels inside the engine (run on the H200):
greedy generation on a small random Llama in float32 with the highest matmul precision
gives the same tokens with the Pallas kernels (auto) and with the jnp references.
Exits non-zero on a failure.
"""
from __future__ import annotations

import sys

import jax


def main() -> int:
    ok = True
    import os
    import jspec
    from benchmarks.common import random_params
    from jspec.config import ModelConfig
    cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    p = random_params(cfg)
    prompts = [list(range(5, 40)), list(range(100, 107))]
    outs = {}
    with jax.default_matmul_precision("highest"):
        for mode in ("reference", "auto"):
            os.environ["JSPEC_KERNELS"] = mode
            jspec.clear_caches()
            outs[mode] = jspec.generate(p, prompts, max_new_tokens=24, stop_token_ids=[],
                                        cache=jspec.CacheConfig("paged", page_size=16)).tokens
    good = outs["reference"] == outs["auto"]
    ok &= good
    print(f"greedy generation, Pallas kernels vs references (float32): {'ok' if good else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
