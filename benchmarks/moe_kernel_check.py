"""The Pallas MoE expert kernel (jspec.kernels.moe_experts) on the GPU: correctness against
the gather reference and timings, at DeepSeek-V2-Lite (E=64, k=6, D=2048, Fm=1408) and V3
(E=256, k=8, D=7168, Fm=2048) shapes, bf16 weights made on device.

(a) check: routed_experts (kernel) and routed_experts_reference (gather) against a float32
    chain from the same bf16 inputs, and each other, at N = 1 and 4 tokens (N*k pairs);
    expert_matmul against its float32 reference.
(b) time: routed_experts vs the gather reference at N = 1, 4, 16: us a call as
    `median_time` of single calls (dispatch and sync included) and as device time (calls
    chained in one program, each on other experts; see `device_time`), TB/s over the
    distinct chosen experts' bytes (gate_up + down).
(c) sweep: expert_matmul tilings for each product at N = 1 and 4 (device time, time-boxed
    by MOE_CHECK_BUDGET_S), then (d) routed_experts with the best tiles found.

Run: PYTHONPATH=. python3 benchmarks/moe_kernel_check.py [v2lite|v3 ...] (results: $OUT/moe_kernel_check.json)
"""
from __future__ import annotations

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import env_info, median_time, save_json
from jspec.kernels import moe_experts as me

SHAPES = {"v2lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048), "tiny": (16, 2, 64, 48)}
BUDGET_S = float(os.environ.get("MOE_CHECK_BUDGET_S", "200"))  # the sweep stops after this
T0 = time.perf_counter()
RES: dict = {"env": env_info()}

SWEEP = [  # (block_n, block_k, num_warps, num_stages, num_splits or None: auto, reduce_each_step)
    (128, 64, 2, 3, None, False),  # the default
    (128, 64, 4, 3, None, False),
    (128, 32, 4, 4, None, False),
    (128, 32, 2, 4, None, False),
    (128, 64, 2, 4, None, False),
    (128, 64, 2, 2, None, False),
    (64, 128, 2, 3, None, False),
    (64, 64, 1, 3, None, False),
    (256, 32, 2, 4, None, False),
    (256, 32, 4, 3, None, False),
    (64, 256, 8, 3, None, False),
    (128, 128, 4, 3, None, True),
    (128, 64, 2, 3, 1, False),
    (128, 64, 2, 3, 4, False),
    (128, 64, 2, 3, 8, False),
]


def log(key, row):
    RES[key] = row
    print(key, row, flush=True)
    save_json("moe_kernel_check.json", RES)


def device_time(f, x, id_sets, *ws, lo: int = 2, hi: int = 12) -> float:
    """Device seconds a call: f over `hi` and over `lo` id sets chained in one jitted
    program (different experts each call: no L2 reuse across calls), the difference of
    the two medians over hi - lo calls (cancels the dispatch and sync)."""
    def chain(x, id_sets, *ws, n):
        return [f(x, id_sets[r], *ws) for r in range(n)]
    t = {n: median_time(jax.jit(functools.partial(chain, n=n)), x, id_sets, *ws, n=10) for n in (lo, hi)}
    return (t[hi] - t[lo]) / (hi - lo)


def f32_chain(x, ids, gu, dn):
    """The routed experts in float32 from the same (bf16) inputs, h rounded like the
    reference's: the accuracy yardstick for both paths."""
    Fm = dn.shape[1]
    h = me.expert_matmul_reference(x, ids, gu).astype(x.dtype)
    a = (jax.nn.silu(h[:, :Fm]) * h[:, Fm:]).astype(jnp.float32)
    return jnp.einsum("pf,pfd->pd", a, dn[ids].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


NSETS = 12


def make_pairs(rng, N, k, E, D):
    """x pairs [N*k, D] (token n's row repeated k times) and NSETS id sets [NSETS, N*k]
    (each token's k distinct experts), with the mean count of distinct experts a set."""
    sets = [np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).reshape(-1) for _ in range(NSETS)]
    xs = jnp.asarray(rng.randn(N, D), jnp.bfloat16)
    distinct = float(np.mean([len(np.unique(s)) for s in sets]))
    return jnp.repeat(xs, k, axis=0), jnp.asarray(np.stack(sets).astype(np.int32)), distinct


def weights(name):
    E, k, D, Fm = SHAPES[name]
    key = jax.random.key(0)
    make = jax.jit(lambda key, shape: (jax.random.normal(key, shape, jnp.bfloat16) * 0.02).astype(jnp.bfloat16),
                   static_argnums=1)
    gu = jax.block_until_ready(make(key, (E, D, 2 * Fm)))
    dn = jax.block_until_ready(make(jax.random.fold_in(key, 1), (E, Fm, D)))
    rng = np.random.RandomState(0)
    return gu, dn, {N: make_pairs(rng, N, k, E, D) for N in (1, 4, 16)}


def check(name, gu, dn, cases):
    """(a) the kernel path against the gather reference and a float32 chain."""
    for N in (1, 4):
        x, sets, _ = cases[N]
        ids = sets[0]
        try:
            truth = np.asarray(jax.jit(f32_chain)(x, ids, gu, dn))
            got = np.asarray(jax.jit(me.routed_experts)(x, ids, gu, dn))
            want = np.asarray(jax.jit(me.routed_experts_reference)(x, ids, gu, dn))
            scale = float(np.abs(truth).max())
            h_k = np.asarray(jax.jit(me.expert_matmul)(x, ids, gu))
            h_r = np.asarray(jax.jit(me.expert_matmul_reference)(x, ids, gu))
            row = {"kernel_vs_f32": float(np.abs(got - truth).max()) / scale,
                   "reference_vs_f32": float(np.abs(want - truth).max()) / scale,
                   "kernel_vs_reference": float(np.abs(got - want).max()) / scale,
                   "gate_up_matmul_vs_f32": float(np.abs(h_k - h_r).max() / np.abs(h_r).max()),
                   "finite": bool(np.isfinite(got).all())}
            row["ok"] = bool(row["finite"] and row["kernel_vs_reference"] < 2e-2
                             and row["kernel_vs_f32"] <= max(2 * row["reference_vs_f32"], 1e-2)
                             and row["gate_up_matmul_vs_f32"] < 1e-4)
        except Exception as e:  # noqa: BLE001
            row = {"error": repr(e)[:600]}
        log(f"check_{name}_N{N}", row)


def time_paths(name, gu, dn, cases, paths, Ns=(1, 4, 16)):
    """(b) the routed experts, several paths: us a call (median of single calls, and device
    time from chains) and TB/s over the distinct chosen experts' bytes."""
    E, k, D, Fm = SHAPES[name]
    per_expert = (gu.nbytes + dn.nbytes) // E
    for N in Ns:
        x, sets, distinct = cases[N]
        nbytes = distinct * per_expert
        for path, f in paths(N):
            try:
                row = {"N": N, "pairs": N * k, "distinct": distinct, "MB": nbytes / 1e6}
                t = median_time(jax.jit(f), x, sets[0], gu, dn, n=20)
                big = path == "reference" and N * k * per_expert > 2e9  # gathers GBs a call
                td = device_time(f, x, sets, gu, dn, lo=1 if big else 2, hi=3 if big else 12)
                row.update(us_call=t * 1e6, us_device=td * 1e6, TBps_device=nbytes / td / 1e12)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:600]
            log(f"time_{name}_N{N}_{path}", row)


def sweep(name, N, gu, dn, cases, deadline):
    """(c) tilings of each product alone (device time) -> {matrix: best tiles}."""
    E, k, D, Fm = SHAPES[name]
    x, sets, distinct = cases[N]
    a = jnp.zeros((x.shape[0], Fm), x.dtype) + 0.01
    best = {}
    for mat, xin, w in (("gate_up", x, gu), ("down", a, dn)):
        nbytes = distinct * w.nbytes // E
        for cfg in SWEEP:
            if time.perf_counter() > deadline:
                print("sweep budget spent", flush=True)
                return best
            bn, bk, nw, ns, sp, red = cfg
            tiles = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, num_splits=sp, reduce_each_step=red)
            f = functools.partial(me.expert_matmul, **tiles)
            try:
                td = device_time(f, xin, sets, w)
                row = {"cfg": cfg, "us_device": td * 1e6, "TBps_device": nbytes / td / 1e12}
                if mat not in best or td < best[mat][0]:
                    best[mat] = (td, tiles)
            except Exception as e:  # noqa: BLE001
                row = {"cfg": cfg, "error": repr(e)[:300]}
            log(f"sweep_{name}_N{N}_{mat}_{'_'.join(map(str, cfg))}", row)
    return best


def main(names):
    print(RES["env"], flush=True)
    jax.config.update("jax_default_prng_impl", "rbg")
    data = {}
    for name in names:
        data[name] = weights(name)
        check(name, *data[name])
        time_paths(name, *data[name], lambda N: (("kernel", me.routed_experts), ("reference", me.routed_experts_reference)))
        print(f"{name} checked and timed at {time.perf_counter() - T0:.0f} s", flush=True)
    jobs = [(name, N) for N in (1, 4) for name in names]
    best = {}
    for i, (name, N) in enumerate(jobs):  # an equal share of the time left to each
        left = BUDGET_S - (time.perf_counter() - T0)
        best[name, N] = sweep(name, N, *data[name], deadline=time.perf_counter() + left / (len(jobs) - i))
    for name in names:  # (d) the routed experts with each size's best tiles (N=16: N=4's)
        def tuned(N, name=name):
            b = best.get((name, min(N, 4)), {})
            if not b:
                return ()
            tiles = {m: b.get(m, (None, {}))[1] for m in ("gate_up", "down")}  # {}: the defaults
            log(f"tuned_{name}_N{N}", tiles)
            return (("kernel_tuned", functools.partial(me.routed_experts, gate_up_tiles=tiles["gate_up"],
                                                       down_tiles=tiles["down"])),)
        time_paths(name, *data[name], tuned)
    print(f"done in {time.perf_counter() - T0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["v2lite", "v3"])
