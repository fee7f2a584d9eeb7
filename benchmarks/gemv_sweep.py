"""Batch-1 matrix-vector products of the Llama-3.1-8B decode step, alone (H200).

For each weight shape of a layer (qkv, o, gate_up, down) and both weight layouts
([out, in] as jspec stores them, and [in, out]), chains 16 distinct random matrices (more
bytes than L2 holds) in a jitted loop and reads each kernel's time from a profiler
trace. Prints us per product and TB/s for the product kernel and for everything the
product needs (XLA's split-K partial sums included).

Run: PYTHONPATH=. python3 benchmarks/gemv_sweep.py [tag]   (XLA_FLAGS may vary per run)
"""
from __future__ import annotations

import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import env_info, save_json
from benchmarks.profile_decode import kernel_table

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
NMAT, ITERS = 16, 20


def chain_fn(layout: str, K: int):
    dims = (((1,), (1,)), ((), ())) if layout == "nk" else (((1,), (0,)), ((), ()))

    def f(ws, x):
        def body(_, x):
            for w in ws:
                y = jax.lax.dot_general(x, w, dims)  # [1, N] bf16
                x = (y[:, :K] if y.shape[1] >= K else jnp.tile(y, (1, K // y.shape[1] + 1))[:, :K]) * 0.5
            return x
        return jax.lax.fori_loop(0, ITERS, body, x)
    return jax.jit(f)


def main(tag: str = ""):
    res = {"env": env_info(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    print(res["env"], res["xla_flags"], flush=True)
    key = jax.random.key(0)
    for name, (N, K) in SHAPES.items():
        for layout in ("nk", "kn"):
            shape = (N, K) if layout == "nk" else (K, N)
            ws = tuple(jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02 for i in range(NMAT))
            x = jax.random.normal(key, (1, K), jnp.bfloat16)
            f = chain_fn(layout, K)
            jax.block_until_ready(f(ws, x))
            d = tempfile.mkdtemp()
            jax.profiler.start_trace(d)
            jax.block_until_ready(f(ws, x))
            jax.profiler.stop_trace()
            stats, busy, window = kernel_table(d)
            calls = NMAT * ITERS
            nbytes = N * K * 2
            gemm = sum(t for n, (c, t) in stats.items() if "gemm" in n or "nvjet" in n or "gemv" in n)
            total = sum(t for n, (c, t) in stats.items())
            row = {"name": name, "layout": layout, "gemm_us": gemm / calls, "all_us": total / calls,
                   "window_us": window / calls, "gemm_TBps": nbytes / (gemm / calls) / 1e6,
                   "window_TBps": nbytes / (window / calls) / 1e6,
                   "kernels": {n: (c / calls, t / calls) for n, (c, t) in stats.items()}}
            res["rows"].append(row)
            print(f"{name:8s} {layout} gemm {row['gemm_us']:7.2f} us {row['gemm_TBps']:5.2f} TB/s | all kernels "
                  f"{row['all_us']:7.2f} us | window {row['window_us']:7.2f} us {row['window_TBps']:5.2f} TB/s "
                  f"| {len(stats)} kernel kinds", flush=True)
            save_json(f"gemv_sweep{'_' + tag if tag else ''}.json", res)
            del ws


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
