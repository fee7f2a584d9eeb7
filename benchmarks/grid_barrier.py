"""What a grid-wide barrier inside one Pallas (Triton) kernel costs on the GPU, against a
boundary between two kernels of a CUDA graph: the question behind fusing DeepSeek's
batch-1 attention half (eight dependent, latency-bound kernels) into one persistent kernel.

- `barriers`: one kernel of P programs (P <= the SM count, all resident at once) passing R
  barriers (`persistent_poc.grid_barrier`): each program adds 1 to a counter with a scalar
  atomic (acquire-release, GPU scope; one thread issues it, the result reaches all), then
  reads the counter with atomics (adding 0) until all P programs have arrived.
- `chain`: R kernels of P programs, each reading the previous one's output (one float a
  program), compiled with command buffers as DeepSeek's loop is.
Both are timed as whole jitted calls (wall time over many calls, R = 1 and R = 201: the
difference over 200 is the cost of one barrier or one boundary).

Run: PYTHONPATH=. python3 benchmarks/grid_barrier.py   (GPU only; result $OUT/grid_barrier.json)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from benchmarks.common import best_call_time, env_info, save_json
from benchmarks.persistent_poc import grid_barrier
from jspec.models.deepseek import GPU_XLA_OPTIONS


def _barrier_kernel(x_ref, _, o_ref, count_ref, *, rounds: int, programs: int):
    """count_ref: the counter (aliased in and out), zero at the start."""
    i = pl.program_id(0)

    def one(r, acc):
        return acc + 1.0 + grid_barrier(count_ref, (r + 1) * programs).astype(jnp.float32)

    o_ref[pl.ds(i, 1)] = lax.fori_loop(0, rounds, one, x_ref[pl.ds(i, 1)])


def barriers(x, rounds: int):
    P = x.shape[0]
    count = jnp.zeros((1,), jnp.int32)
    out, _ = pl.pallas_call(
        functools.partial(_barrier_kernel, rounds=rounds, programs=P),
        grid=(P,),
        in_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((1,), jnp.int32)],
        input_output_aliases={1: 1},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        name="jspec_grid_barrier",
    )(x, count)
    return out


def _step_kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i, 1)] = x_ref[pl.ds((i + 1) % x_ref.shape[0], 1)] + 1.0


def chain(x, rounds: int):
    for _ in range(rounds):
        x = pl.pallas_call(_step_kernel, grid=(x.shape[0],), in_specs=[pl.BlockSpec()], out_specs=pl.BlockSpec(),
                           out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                           compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), name="jspec_step")(x)
    return x


def timed(fn, x, rounds: int) -> float:
    f = jax.jit(functools.partial(fn, rounds=rounds)).lower(x).compile(dict(GPU_XLA_OPTIONS))
    best, out = best_call_time(f, x, calls=200)
    assert float(out[0]) == rounds, (fn.__name__, rounds, float(out[0]))
    return best


def main():
    sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    res = {"env": env_info(), "sms": sms, "rows": []}
    for P in (16, 66, sms):
        x = jnp.zeros((P,), jnp.float32)
        for name, fn in (("barriers", barriers), ("chain", chain)):
            t1, t2 = timed(fn, x, 1), timed(fn, x, 201)
            row = {"what": name, "programs": P, "call_us_R1": round(t1 * 1e6, 2), "call_us_R201": round(t2 * 1e6, 2),
                   "us_each": round((t2 - t1) / 200 * 1e6, 3)}
            res["rows"].append(row)
            print(row, flush=True)
    save_json("grid_barrier.json", res)


if __name__ == "__main__":
    main()
