"""The fused residual matrix-vector kernel (jspec/kernels/gemv.py) against XLA on one GPU.

For the Llama-3.1-8B output projection (N = K = 4096) and down projection (N = 4096,
K = 14336), bf16: x_new = residual + W a, y = gain * x_new, sum(x_new ** 2), chained over
32 distinct weight matrices in one jitted function (as the 32 layers of a decode step, so
no dispatch cost and no weight re-use from the L2 cache). XLA's version is the plain jnp
expression (its split-K product, the add and the reduction); the kernel is swept over
block sizes, warps and pipeline stages. Relative error against a float32 reference first.

    PYTHONPATH=. python3 benchmarks/gemv_h200.py    # writes $OUT/gemv_h200.json
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import save_json
from jspec.kernels import gemv

LAYERS = 32
BUDGET_S = float(os.environ.get("GEMV_BUDGET_S", 240))


def xla_step(a, w, res, g):
    x = res + jnp.einsum("nk,k->n", w, a)
    xf = x.astype(jnp.float32)
    return x, g * x, jnp.sum(xf * xf)[None]


def pallas_step(**kw):
    return lambda a, w, res, g: gemv.residual_gemv(a, w, res, g, **kw)


def chain(step, square: bool):
    """32 calls; the next call's residual is this one's x_new (and, when N == K, its
    activation is this one's gain product)."""
    def f(a, ws, res, g):
        total = jnp.zeros((), jnp.float32)
        for w in ws:
            x, y, ss = step(a, w, res, g)
            res = x
            if square:
                a = y
            total = total + jnp.sum(ss)
        return res, total
    return jax.jit(f)


def timed(f, *args, n=10):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main():
    t0 = time.perf_counter()
    res_all = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "cases": []}
    key = jax.random.key(0)
    for N, K in ((4096, 4096), (4096, 14336)):
        ka, kw, kr, kg = jax.random.split(jax.random.fold_in(key, K), 4)
        a = jax.random.normal(ka, (K,), jnp.bfloat16)
        ws = [jax.random.normal(jax.random.fold_in(kw, i), (N, K), jnp.bfloat16) * 0.02
              for i in range(LAYERS)]
        res = jax.random.normal(kr, (N,), jnp.bfloat16)
        g = (1 + 0.1 * jax.random.normal(kg, (N,))).astype(jnp.bfloat16)
        nbytes = LAYERS * N * K * 2
        # correctness of one call against float32
        x_ref, y_ref, ss_ref = gemv.residual_gemv_reference(a, ws[0].astype(jnp.float32), res.astype(jnp.float32),
                                                            g.astype(jnp.float32))
        x, y, ss = gemv.residual_gemv(a, ws[0], res, g)
        err = float(jnp.linalg.norm(x.astype(jnp.float32) - x_ref) / jnp.linalg.norm(x_ref))
        err_ss = float(abs(jnp.sum(ss) - jnp.sum(ss_ref)) / jnp.sum(ss_ref))
        print(f"N={N} K={K}: rel err x {err:.2e}, sum of squares {err_ss:.2e}", flush=True)
        t_xla = timed(chain(xla_step, N == K), a, ws, res, g)
        row = dict(N=N, K=K, impl="xla", us=t_xla / LAYERS * 1e6, TBps=nbytes / t_xla / 1e12, rel_err=err)
        res_all["cases"].append(row)
        print(f"  xla                          {row['us']:7.2f} us  {row['TBps']:.2f} TB/s", flush=True)
        for bn in (16, 32, 64):
            for bk in (128, 256, 512):
                for nw, st in ((4, 3), (8, 3), (4, 4), (8, 5)):
                    if bn * bk > 16384 or time.perf_counter() - t0 > BUDGET_S:
                        continue
                    try:
                        f = chain(pallas_step(block_n=bn, block_k=bk, num_warps=nw, num_stages=st), N == K)
                        t = timed(f, a, ws, res, g)
                        row = dict(N=N, K=K, impl="pallas", block_n=bn, block_k=bk, num_warps=nw,
                                   num_stages=st, us=t / LAYERS * 1e6, TBps=nbytes / t / 1e12)
                        res_all["cases"].append(row)
                        print(f"  pallas bn={bn:3d} bk={bk:3d} w={nw} s={st}   {row['us']:7.2f} us  "
                              f"{row['TBps']:.2f} TB/s", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"  pallas bn={bn} bk={bk} w={nw} s={st} failed: {repr(e)[:300]}", flush=True)
        del ws
    print("saved", save_json("gemv_h200.json", res_all))


if __name__ == "__main__":
    main()
