"""Does XLA launch Pallas (Triton) kernels with programmatic dependent launch (PDL), so that
a kernel can start while its predecessor still runs?

Two kernels of P programs, one warp each: A spins S steps (a dependent float chain) and
writes its result; B spins S steps, then reads A's result. B depends on A through its
operand, so XLA runs them in order. Variants:
- `trigger`: A issues `griddepcontrol.launch_dependents` first (inline PTX);
- B's `griddepcontrol.wait` at its start, after its spin, or nowhere.
If B is launched with PDL and A triggers early, B's spin overlaps A's: the pair takes about
one kernel's time instead of two. The output says whether B read A's finished result.

`triton`: A and B are Pallas (Triton) kernels, the PTX issued by inline assembly.
`mosaic`: B is a Pallas Mosaic GPU kernel (`plgpu.griddepcontrol_wait`, jax >= 0.11), which
XLA launches with PDL when it waits; A is the Triton kernel above, 128 values a program.

Run: PYTHONPATH=. python3 benchmarks/pdl_probe.py   (GPU only; result $OUT/pdl_probe.json)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from benchmarks.common import best_call_time, env_info, save_json
from jspec.models.deepseek import GPU_XLA_OPTIONS

TRIGGER = "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;"
WAIT = "griddepcontrol.wait;\n\tmov.b32 $0, $1;"


def ptx_through(asm: str, v):
    """The int32 vector v, passed through the PTX asm; what reads the result waits for the asm
    (and the asm is dropped if nothing reads it)."""
    [out] = plt.elementwise_inline_asm(asm, args=[v], constraints="=r,r", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.int32)])
    return out


def spin(v, steps: int):
    return lax.fori_loop(0, steps, lambda _, a: a * 0.9999 + 1.0, v)


def _a_kernel(x_ref, o_ref, *, steps: int, trigger: bool):
    i = pl.program_id(0)
    start = x_ref[pl.ds(i, 1)]
    if trigger:
        start = start + ptx_through(TRIGGER, jnp.zeros((1,), jnp.int32)).astype(jnp.float32)
    o_ref[pl.ds(i, 1)] = spin(start, steps)


def _b_kernel(a_ref, x_ref, o_ref, *, steps: int, wait: str):
    """x_ref: the pair's input, written before A ran (so readable before the wait)."""
    i = pl.program_id(0)
    zero = jnp.zeros((1,), jnp.int32)
    if wait == "start":
        zero = ptx_through(WAIT, zero)
    mine = spin(x_ref[pl.ds(i, 1)] + zero.astype(jnp.float32), steps)
    if wait == "after":
        zero = ptx_through(WAIT, zero + jnp.minimum(mine, 0.0).astype(jnp.int32))
    a = plt.load(a_ref.at[pl.ds(i, 1)], mask=zero == 0, other=0.0)
    o_ref[pl.ds(i, 1)] = a + jnp.minimum(mine, 0.0)


def _call(kernel, *xs, **kw):
    x = xs[0]
    return pl.pallas_call(functools.partial(kernel, **kw), grid=(x.shape[0],), in_specs=[pl.BlockSpec()] * len(xs),
                          out_specs=pl.BlockSpec(), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
                          name=kernel.__name__.strip("_"))(*xs)


def pair(x, *, steps, trigger, wait, chain):
    for _ in range(chain):
        x = _call(_b_kernel, _call(_a_kernel, x, steps=steps, trigger=trigger), x, steps=steps, wait=wait)
    return x


def only(x, *, steps, which, chain):
    """chain kernels of one kind, each on the previous one's output."""
    for _ in range(chain):
        x = _call(_a_kernel, x, steps=steps, trigger=False) if which == "a" else _call(_b_kernel, x, x, steps=steps,
                                                                                           wait="start")
    return x


def _a128_kernel(x_ref, o_ref, *, steps: int, trigger: bool):
    i = pl.program_id(0)
    start = x_ref[pl.ds(i * 128, 128)]
    if trigger:
        start = start + ptx_through(TRIGGER, jnp.zeros((128,), jnp.int32)).astype(jnp.float32)
    o_ref[pl.ds(i * 128, 128)] = spin(start, steps)


def _b_mosaic_body(a_gmem, x_gmem, o_gmem, a_smem, x_smem, o_smem, bar, *, steps: int, trigger: bool, wait: str):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    rows = pl.ds(lax.axis_index("x") * 128, 128)
    if trigger:
        plgpu.griddepcontrol_launch_dependents()
    if wait == "start":
        plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(x_gmem.at[rows], x_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    mine = spin(x_smem[...], steps)
    if wait == "after":
        plgpu.griddepcontrol_wait()
    plgpu.copy_gmem_to_smem(a_gmem.at[rows], a_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[1])
    o_smem[...] = a_smem[...] + jnp.minimum(mine, 0.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows])
    plgpu.wait_smem_to_gmem(0)


def _b_mosaic(a, x, **kw):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.kernel(functools.partial(_b_mosaic_body, **kw), out_type=jax.ShapeDtypeStruct(a.shape, a.dtype),
                        grid=(a.shape[0] // 128,), grid_names=("x",),
                        scratch_types=[plgpu.SMEM((128,), jnp.float32)] * 3 + [plgpu.Barrier(num_barriers=2)])(a, x)


def mosaic_pair(x, *, steps, trigger, wait, chain, mosaic_trigger=False):
    """A (Triton, 128 values a program) then B (Mosaic GPU), chain times."""
    for _ in range(chain):
        a = pl.pallas_call(functools.partial(_a128_kernel, steps=steps, trigger=trigger), grid=(x.shape[0] // 128,),
                           in_specs=[pl.BlockSpec()], out_specs=pl.BlockSpec(),
                           out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                           compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), name="a128_kernel")(x)
        x = _b_mosaic(a, x, steps=steps, trigger=mosaic_trigger, wait=wait)
    return x


def mosaic_chain(x, *, steps, trigger, wait, chain):
    """chain Mosaic B kernels, each reading the previous one's output."""
    for _ in range(chain):
        x = _b_mosaic(x, x, steps=steps, trigger=trigger, wait=wait)
    return x


def main():
    steps, P, chain = 5000, 132, 8
    x = jnp.arange(P, dtype=jnp.float32)
    want = jax.jit(lambda v: pair(v, steps=steps, trigger=False, wait="start", chain=chain))(x)
    res = {"env": env_info(), "steps": steps, "programs": P, "pairs_per_call": chain, "rows": []}
    for options_name, options in (("command_buffers", dict(GPU_XLA_OPTIONS)),
                                  ("no_command_buffers", {"xla_gpu_enable_command_buffer": ""})):
        for trigger, wait in ((False, "none"), (True, "start"), (True, "after"), (True, "none"), (False, "after")):
            fn = functools.partial(pair, steps=steps, trigger=trigger, wait=wait, chain=chain)
            f = jax.jit(fn).lower(x).compile(options)
            t, out = best_call_time(f, x, calls=100)
            row = {"options": options_name, "trigger": trigger, "wait": wait, "us_per_pair": round(t / chain * 1e6, 2),
                   "exact": bool(jnp.all(out == want)), "max_err": float(jnp.max(jnp.abs(out - want)))}
            res["rows"].append(row)
            print(row, flush=True)
    xm = jnp.arange(P * 128, dtype=jnp.float32)
    for options_name, options in (("command_buffers", dict(GPU_XLA_OPTIONS)),
                                  ("no_command_buffers", {"xla_gpu_enable_command_buffer": ""})):
        for what, fn, trigger, wait in (("mosaic_pair", mosaic_pair, False, "none"),
                                        ("mosaic_pair", mosaic_pair, True, "start"),
                                        ("mosaic_pair", mosaic_pair, True, "after"),
                                        ("mosaic_chain", mosaic_chain, False, "start"),
                                        ("mosaic_chain", mosaic_chain, True, "start"),
                                        ("mosaic_chain", mosaic_chain, True, "after")):
            try:
                f = jax.jit(functools.partial(fn, steps=steps, trigger=trigger, wait=wait, chain=chain)).lower(
                    xm).compile(options)
                t, out = best_call_time(f, xm, calls=100)
                ref = jax.jit(functools.partial(fn, steps=steps, trigger=False, wait="start", chain=chain))(xm)
                row = {"options": options_name, "what": what, "trigger": trigger, "wait": wait,
                       "us_per_step": round(t / chain * 1e6, 2), "exact": bool(jnp.all(out == ref))}
            except Exception as e:  # noqa: BLE001
                row = {"options": options_name, "what": what, "trigger": trigger, "wait": wait, "error": repr(e)[:800]}
            res["rows"].append(row)
            print(row, flush=True)
    for which in ("a", "b"):
        one = jax.jit(functools.partial(only, steps=steps, which=which, chain=chain)).lower(x).compile(
            dict(GPU_XLA_OPTIONS))
        res[f"kernel_{which}_us"] = round(best_call_time(one, x, calls=100)[0] / chain * 1e6, 2)
        print(f"kernel {which} alone, us", res[f"kernel_{which}_us"], flush=True)
    save_json("pdl_probe.json", res)


if __name__ == "__main__":
    main()
