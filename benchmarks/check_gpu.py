"""GPU correctness checks of the Pallas kernels inside the engine (run on the H200).

1. The fused residual-add + RMSNorm kernel against its reference (bf16 and f32).
2. Greedy generation on a small random Llama in float32 with the highest matmul precision:
   the Pallas kernels (auto) and the jnp references give the same tokens.
Prints one line per check and exits non-zero on a failure.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jspec.kernels import rmsnorm


def main() -> int:
    ok = True
    for shape in [(1, 4096), (32, 4096), (4, 1024, 1024)]:
        for dtype in (jnp.bfloat16, jnp.float32):
            k = jax.random.split(jax.random.key(len(shape)), 3)
            x = jax.random.normal(k[0], shape).astype(dtype)
            d = jax.random.normal(k[1], shape).astype(dtype)
            w = (1 + 0.1 * jax.random.normal(k[2], shape[-1:])).astype(dtype)
            y, s = rmsnorm.add_rms_norm_pallas(x, d, w, 1e-5)
            yr, sr = jax.jit(rmsnorm.add_rms_norm_reference, static_argnums=3)(x, d, w, 1e-5)
            err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - yr.astype(jnp.float32))))
            same_sum = bool(jnp.all(s == sr))
            good = same_sum and err <= (2e-2 if dtype == jnp.bfloat16 else 1e-5)
            ok &= good
            print(f"add_rms_norm {shape} {jnp.dtype(dtype).name}: max err {err:.2e}, sums equal {same_sum}"
                  f" {'ok' if good else 'FAIL'}", flush=True)

    import os
    import jspec
    from jspec import api
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
            jax.clear_caches()
            api._COMPILED.clear()
            outs[mode] = jspec.generate(p, prompts, max_new_tokens=24, stop_token_ids=[],
                                        cache=jspec.CacheConfig("paged", page_size=16)).tokens
    good = outs["reference"] == outs["auto"]
    ok &= good
    print(f"greedy generation, Pallas kernels vs references (float32): {'ok' if good else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
