"""Whether one persistent kernel can hide a dependent product's weight reads behind the
product before it, on the GPU: the design question behind a batch-1 "megakernel" for
DeepSeek's attention half (benchmarks/grid_barrier.py measures the barrier alone).

Two dependent one-row products z = W2 (W1 x), each W [D, D] bf16 stored row per output
(W^T), one float32 vector between them, three ways:
- `two_kernels`: a kernel per product (what XLA launches today, one boundary);
- `fused`: one kernel of P programs (all resident), each owning D/P output rows: product
  1, a grid barrier (scalar atomics: `grid_barrier`), product 2 reading the whole vector;
- `fused_prefetch`: the same, each program loading its rows of W2 before product 1, so the
  second product's weight reads run while the first one and the barrier are in flight.
Calls cycle over NSETS weight sets (NSETS * 2 * D * D * 2 bytes, past the L2). Timed as
wall time a call over many calls of a jitted loop with command buffers; `one_kernel` (only
the first product) is the floor for a fused pair.

Run: PYTHONPATH=. python3 benchmarks/persistent_poc.py   (GPU; result $OUT/persistent_poc.json)
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.common import env_info, save_json
from jspec.models.deepseek import GPU_XLA_OPTIONS

NSETS = 8
CALLS = 64  # calls a jitted loop


def _rows(w_ref, sel_ref, rows: int):
    """This program's rows of weight set sel_ref[0] of w_ref [NSETS, D, D] -> [R, D] float32."""
    i = pl.program_id(0)
    return w_ref[sel_ref[0], pl.ds(i * rows, rows), :].astype(jnp.float32)


def _product(w, v):  # [R, D] x [D] -> [R]
    return jnp.sum(w * v[None, :], axis=1)


def _one_kernel(sel_ref, x_ref, w_ref, o_ref, *, rows: int):
    i = pl.program_id(0)
    o_ref[pl.ds(i * rows, rows)] = _product(_rows(w_ref, sel_ref, rows), x_ref[...].astype(jnp.float32))


def grid_barrier(count_ref, want, interpret: bool = False):
    """Counts this program in (count_ref [1] int32), then waits until the count reaches
    `want`: -> 0 as an int32 the compilers cannot see is 0 (the caller uses it, so the wait
    is not removed as dead code). In interpret mode (programs in sequence) it only counts.
    Scalar atomics (one thread issues them, the result reaches every thread), after a
    barrier of the program's threads so that all their stores precede the count; the wait
    reads the count with atomics too (a plain or volatile load is hoisted out of the loop)."""
    from jax.experimental.pallas import triton as plt
    if interpret:
        plt.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(1))
        return jnp.int32(0)
    plt.debug_barrier()
    plt.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(1))
    seen = lax.while_loop(lambda seen: seen < want,
                          lambda _: plt.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(0)), jnp.int32(0))
    return jnp.minimum(seen - want, 0)


def _fused_kernel(sel_ref, x_ref, w1_ref, w2_ref, _, y_ref, z_ref, count_ref, *, rows: int, prefetch: bool,
                  interpret: bool):
    from jax.experimental.pallas import triton as plt
    i = pl.program_id(0)
    w2 = _rows(w2_ref, sel_ref, rows) if prefetch else None
    y_ref[pl.ds(i * rows, rows)] = _product(_rows(w1_ref, sel_ref, rows), x_ref[...].astype(jnp.float32))
    zero = grid_barrier(count_ref, pl.num_programs(0), interpret)
    at = y_ref.at[pl.ds(zero, y_ref.shape[0])]
    y = y_ref[pl.ds(zero, y_ref.shape[0])] if interpret else plt.load(at, volatile=True)
    w2 = _rows(w2_ref, sel_ref, rows) if w2 is None else w2
    z_ref[pl.ds(i * rows, rows)] = _product(w2, y)


def _params(warps):
    from jax.experimental.pallas import triton as plt
    return plt.CompilerParams(num_warps=warps, num_stages=1)


def one_kernel(sel, x, w, programs: int, warps: int, interpret=False):
    """sel [1] int32: which of w's [NSETS, D, D] sets; x [D] -> [D] float32."""
    D = w.shape[1]
    return pl.pallas_call(functools.partial(_one_kernel, rows=D // programs), grid=(programs,),
                          in_specs=[pl.BlockSpec()] * 3, out_specs=pl.BlockSpec(),
                          out_shape=jax.ShapeDtypeStruct((D,), jnp.float32), interpret=interpret,
                          compiler_params=None if interpret else _params(warps), name="jspec_poc_product")(sel, x, w)


def two_kernels(sel, x, w1, w2, programs: int, warps: int, interpret=False):
    return one_kernel(sel, one_kernel(sel, x, w1, programs, warps, interpret), w2, programs, warps, interpret)


def fused(sel, x, w1, w2, programs: int, warps: int, prefetch: bool, interpret=False):
    D = w1.shape[1]
    count = jnp.zeros((1,), jnp.int32)
    _, z, _ = pl.pallas_call(
        functools.partial(_fused_kernel, rows=D // programs, prefetch=prefetch, interpret=interpret),
        grid=(programs,), in_specs=[pl.BlockSpec()] * 5, out_specs=[pl.BlockSpec()] * 3,
        out_shape=[jax.ShapeDtypeStruct((D,), jnp.float32)] * 2 + [jax.ShapeDtypeStruct((1,), jnp.int32)],
        input_output_aliases={4: 2}, interpret=interpret,
        compiler_params=None if interpret else _params(warps), name="jspec_poc_fused")(sel, x, w1, w2, count)
    return z


def reference(x, w1, w2):
    y = jnp.dot(w1.astype(jnp.float32), x.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return jnp.dot(w2.astype(jnp.float32), y, precision=lax.Precision.HIGHEST)


def timed(step, x, w1s, w2s) -> tuple[float, jax.Array]:
    """Seconds a call: CALLS calls in a jitted loop (weight set c % NSETS), best of 3."""
    def loop(x, w1s, w2s):
        def body(c, acc):
            return acc + step(jnp.reshape(c % NSETS, (1,)), x, w1s, w2s)[:1]
        return lax.fori_loop(0, CALLS, body, jnp.zeros((1,), jnp.float32))

    f = jax.jit(loop).lower(x, w1s, w2s).compile(dict(GPU_XLA_OPTIONS))
    jax.block_until_ready(f(x, w1s, w2s))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(f(x, w1s, w2s))
        best = min(best, (time.perf_counter() - t) / CALLS)
    return best, step(jnp.zeros((1,), jnp.int32), x, w1s, w2s)


def main():
    D = 2048
    key = jax.random.key(0)
    w1s = (jax.random.normal(key, (NSETS, D, D)) / np.sqrt(D)).astype(jnp.bfloat16)
    w2s = (jax.random.normal(jax.random.fold_in(key, 1), (NSETS, D, D)) / np.sqrt(D)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 2), (D,), jnp.bfloat16)
    want = reference(x, w1s[0], w2s[0])
    res = {"env": env_info(), "D": D, "rows": []}
    for programs, warps in ((128, 4), (128, 8), (128, 16)):
        ways = {"one_kernel": lambda s, x, a, b: one_kernel(s, x, a, programs, warps),
                "two_kernels": lambda s, x, a, b: two_kernels(s, x, a, b, programs, warps),
                "fused": lambda s, x, a, b: fused(s, x, a, b, programs, warps, False),
                "fused_prefetch": lambda s, x, a, b: fused(s, x, a, b, programs, warps, True)}
        for name, step in ways.items():
            try:
                t, z = timed(step, x, w1s, w2s)
            except Exception as e:  # noqa: BLE001
                row = {"way": name, "programs": programs, "warps": warps, "error": str(e)[:300]}
            else:
                err = None if name == "one_kernel" else float(jnp.max(jnp.abs(z - want)) / jnp.max(jnp.abs(want)))
                row = {"way": name, "programs": programs, "warps": warps, "us": round(t * 1e6, 2), "rel_err": err}
            res["rows"].append(row)
            print(row, flush=True)
    save_json("persistent_poc.json", res)


if __name__ == "__main__":
    main()
