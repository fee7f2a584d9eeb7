"""Which products and norms compute a row the same whatever other rows share the call, and
what a row-invariant product costs (issue 40): the 8B shape's weights (bf16, random), x of
160 rows; for M in 1, 2, 5, 16, 17, 32, 160 rows, whether each row of an M-row product
equals the same row of the 160-row product bit for bit (`rows_equal_160`) and whether row
0 equals the 1-row product's (`row0_equal_1`); us a product at 1, 5, 32 and 160 rows
(rotating over several weight copies so that L2 holds none). Products: XLA's
(`models.llama.product`) and `kernels.row_matmul` with row blocks of 16 (default tiles,
64 columns, K chunks of 128) and of 64 (whether it equals the 16-row blocks' bits); the
RMSNorm (`moe_experts.rms_norm`) at the same row counts.

    PYTHONPATH=. python3 benchmarks/row_invariance.py     # $OUT/rowinv_probe.json
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.kernels.moe_experts import rms_norm
from jspec.kernels.row_matmul import row_matmul
from jspec.models.llama import product

out = {}
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]
MS = [1, 2, 5, 16, 17, 32, 160]
rng = np.random.default_rng(0)

def timed(fn, ws, x, reps=20):
    f = jax.jit(lambda ws, x: [fn(x, w) for w in ws])
    jax.block_until_ready(f(ws, x))
    t0 = time.perf_counter()
    for _ in range(reps):
        r = f(ws, x)
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / reps / len(ws) * 1e6

VARIANTS = (("xla", lambda x, w: product(x, w, float32_out=True)),
            ("row16", lambda x, w: row_matmul(x, w)),
            ("row16_bn64", lambda x, w: row_matmul(x, w, block_n=64)),
            ("row16_bk128", lambda x, w: row_matmul(x, w, block_k=128)),
            ("row64", lambda x, w: row_matmul(x, w, block_m=64)))

for K, N in SHAPES:
    x = jnp.asarray(rng.standard_normal((160, K)), jnp.bfloat16)
    nw = max(2, int(4e8 // (K * N * 2)))
    ws = [jnp.asarray(rng.standard_normal((K, N)) * 0.02, jnp.bfloat16) for _ in range(min(nw, 6))]
    w = ws[0]
    res, full = {}, {}
    for name, fn in VARIANTS:
        try:
            f = jax.jit(fn)
            ys = {M: np.asarray(f(x[:M], w)) for M in MS}
            full[name] = ys[160]
            res[name] = {"rows_equal_160": {M: bool(np.array_equal(ys[M], ys[160][:M])) for M in MS},
                         "row0_equal_1": {M: bool(np.array_equal(ys[M][:1], ys[1][:1])) for M in MS},
                         "us": {M: round(timed(fn, ws, x[:M]), 1) for M in (1, 5, 32, 160)}}
            if name != "xla":
                ref = full["xla"]
                res[name]["vs_xla_max_rel"] = float(np.max(np.abs(ys[160] - ref)) / np.max(np.abs(ref)))
            if name == "row64":
                res[name]["equals_row16"] = bool(np.array_equal(ys[160], full["row16"]))
        except Exception as e:
            res[name] = {"error": repr(e)[:400]}
        print(K, N, name, res[name], flush=True)
    out[f"{K}x{N}"] = res

x = jnp.asarray(rng.standard_normal((160, 4096)), jnp.bfloat16)
g = jnp.asarray(rng.standard_normal(4096), jnp.bfloat16)
f = jax.jit(lambda x: rms_norm(x, g, 1e-5))
ys = {M: np.asarray(f(x[:M])) for M in MS}
out["rms_norm"] = {M: bool(np.array_equal(ys[M], ys[160][:M])) for M in MS}
print("rms_norm", out["rms_norm"], flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/rowinv_probe.json", "w"), indent=1)
