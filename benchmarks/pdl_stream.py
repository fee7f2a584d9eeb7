"""Dependent weight-streaming kernels with and without programmatic dependent launch (PDL):
the ceiling of a decode layer made of short dependent kernels (DeepSeek's batch-1 step) if
each kernel read its weights while its predecessor still ran.

A chain of L Pallas Mosaic GPU kernels of C blocks. Kernel k copies its own weight slab
(`mb` MB in all, [S, 256] bf16 a block, TMA into shared memory), reads kernel k-1's output
(256 floats a block) and writes its own: out = prev + first row of the slab. Ways:
- `serial`: no PDL; the weight copy starts when the kernel does, after its predecessor ends;
- `pdl`: the kernel issues its weight copy, lets its dependents launch
  (`griddepcontrol_launch_dependents`), then waits for its predecessor
  (`griddepcontrol_wait`) before reading its output;
- `pdl_wait_first`: the same launch, but the wait comes before the weight copy.
The L slabs together exceed the L2 cache, so every call reads them from memory. Each way
is timed with and without XLA's command buffers (CUDA graphs). The output is checked
against plain jnp.

Needs jax >= 0.11 (Mosaic GPU's griddepcontrol primitives) and a Hopper GPU.
Run: PYTHONPATH=. python3 benchmarks/pdl_stream.py   (result $OUT/pdl_stream.json)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import best_call_time, copy_bandwidth, env_info, save_json
from jspec.models.deepseek import GPU_XLA_OPTIONS

WIDTH = 256  # values a block reads from its predecessor, and the slab's row length


def _body(w_gmem, prev_gmem, o_gmem, w_smem, p_smem, o_smem, bar, *, layer: int, rows: int, way: str):
    block = lax.axis_index("b")
    mine = pl.ds(block * WIDTH, WIDTH)
    if way == "pdl_wait_first":
        plgpu.griddepcontrol_launch_dependents()
        plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(w_gmem.at[layer, pl.ds(block * rows, rows)], w_smem, bar.at[0])
    if way == "pdl":
        plgpu.griddepcontrol_launch_dependents()
        plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(prev_gmem.at[mine], p_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[1])
    plgpu.barrier_wait(bar.at[0])
    o_smem[...] = p_smem[...] + w_smem[0].astype(jnp.float32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[mine])
    plgpu.wait_smem_to_gmem(0)


def stream_layer(w, prev, *, layer: int, way: str):
    """w [L, C*S, 256] bf16, prev [C*256] f32 -> [C*256] f32."""
    blocks = prev.shape[0] // WIDTH
    rows = w.shape[1] // blocks
    return plgpu.kernel(functools.partial(_body, layer=layer, rows=rows, way=way),
                        out_type=jax.ShapeDtypeStruct(prev.shape, jnp.float32), grid=(blocks,), grid_names=("b",),
                        scratch_types=[plgpu.SMEM((rows, WIDTH), jnp.bfloat16), plgpu.SMEM((WIDTH,), jnp.float32),
                                       plgpu.SMEM((WIDTH,), jnp.float32), plgpu.Barrier(num_barriers=2)])(w, prev)


def chain(w, x, *, way: str):
    for k in range(w.shape[0]):
        x = stream_layer(w, x, layer=k, way=way)
    return x


def reference(w, x):
    blocks = x.shape[0] // WIDTH
    rows = w.shape[1] // blocks
    first_rows = w.reshape(w.shape[0], blocks, rows, WIDTH)[:, :, 0, :].reshape(w.shape[0], -1)
    return x + jnp.sum(first_rows.astype(jnp.float32), axis=0)


def main():
    blocks = 128
    res = {"env": env_info(), "blocks": blocks, "copy": {k: v / 1e12 for k, v in copy_bandwidth().items()
                                                          if isinstance(v, float)}, "rows": []}
    print(res["copy"], flush=True)
    for mb in (1, 4, 8):
        rows = mb * (1 << 20) // (blocks * WIDTH * 2)
        layers = max(8, 160 // mb)
        w = jax.random.normal(jax.random.key(mb), (layers, blocks * rows, WIDTH), jnp.bfloat16)
        x = jnp.arange(blocks * WIDTH, dtype=jnp.float32)
        want = np.asarray(reference(w, x))
        for options_name, options in (("command_buffers", dict(GPU_XLA_OPTIONS)),
                                      ("no_command_buffers", {"xla_gpu_enable_command_buffer": ""})):
            for way in ("serial", "pdl", "pdl_wait_first"):
                f = jax.jit(functools.partial(chain, way=way)).lower(w, x).compile(options)
                t, out = best_call_time(f, w, x)
                err = float(np.max(np.abs(np.asarray(out) - want)))
                row = {"mb_per_kernel": mb, "kernels": layers, "options": options_name, "way": way,
                       "us_per_kernel": round(t / layers * 1e6, 2), "tb_per_s": round(w.nbytes / t / 1e12, 3),
                       "max_err": err}
                res["rows"].append(row)
                print(row, flush=True)
    save_json("pdl_stream.json", res)


if __name__ == "__main__":
    main()
