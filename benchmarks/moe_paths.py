"""MoE expert products on the GPU, four ways, at decode and verification sizes (H200).

For N tokens routed to k of E experts each (DeepSeek-V2-Lite: E=64, k=6, D=2048, Fm=1408;
V3: E=256, k=8, D=7168, Fm=2048), times the routed part of an MoE layer:
- gather: each (token, expert) pair gathers its expert's weights, then batched products
  (what `jspec.models.deepseek.MoE` does when N*k < E);
- slots: an unrolled loop over the pairs, each a dynamic slice of the expert's weights
  feeding its product (XLA may fuse the slice into the product's operand read);
- ragged: pairs sorted by expert, `jax.lax.ragged_dot`;
- dense: every expert over every token, weighted by the routing (zero for unchosen);
- grouped: `jspec.kernels.moe_grouped` (pairs grouped by expert in tiles, the Pallas
  kernel on the tensor cores); from 32 tokens on also its tilings (`GROUPED_TILES`);
- pairs: `jspec.kernels.moe_experts.routed_experts`, the decode path's kernel (a program
  per pair and column tile; an expert's repeated reads for other pairs come from L2).
Bytes: the distinct experts' weights the pairs need; GB/s = those bytes / time.

Run: PYTHONPATH=. python3 benchmarks/moe_paths.py [v2lite|v3 ...]   (MOE_PATHS_N=1,4,...: the token
counts, default 1,4,16,32,1024; MOE_PATHS=a,b: the paths, default all; MOE_PATHS_TILES=0: no
tilings of the grouped kernel)
"""
from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import env_info, median_time, save_json
from jspec.kernels import moe_experts, moe_grouped as mg

SHAPES = {"v2lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048)}


def gather(x, ids, w, gu, dn):
    Fm = dn.shape[1]
    h = jnp.einsum("nd,nkdf->nkf", x, gu[ids])
    y = jnp.einsum("nkf,nkfd->nkd", jax.nn.silu(h[..., :Fm]) * h[..., Fm:], dn[ids])
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), w)


def slots(x, ids, w, gu, dn):
    N, k = ids.shape
    Fm = dn.shape[1]
    out = []
    for n in range(N):
        acc = jnp.zeros((x.shape[1],), jnp.float32)
        for j in range(k):
            g = jax.lax.dynamic_index_in_dim(gu, ids[n, j], keepdims=False)  # [D, 2Fm]
            d = jax.lax.dynamic_index_in_dim(dn, ids[n, j], keepdims=False)  # [Fm, D]
            h = x[n] @ g
            acc = acc + w[n, j] * (jax.nn.silu(h[:Fm]) * h[Fm:]) @ d
        out.append(acc)
    return jnp.stack(out)


def ragged(x, ids, w, gu, dn):
    N, k = ids.shape
    E, Fm = gu.shape[0], dn.shape[1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // k], gu, sizes)
    h = jax.lax.ragged_dot(jax.nn.silu(h[:, :Fm]) * h[:, Fm:], dn, sizes)
    y = jnp.zeros_like(h).at[order].set(h).reshape(N, k, -1)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), w)


def dense(x, ids, w, gu, dn):
    N, k = ids.shape
    E, Fm = gu.shape[0], dn.shape[1]
    we = jnp.zeros((N, E), jnp.float32).at[jnp.arange(N)[:, None], ids].add(w)
    h = jnp.einsum("nd,edf->enf", x, gu)
    y = jnp.einsum("enf,efd->end", jax.nn.silu(h[..., :Fm]) * h[..., Fm:], dn)
    return jnp.einsum("end,ne->nd", y.astype(jnp.float32), we)


def grouped(x, ids, w, gu, dn, block_m=None, **tiles):
    """The grouped kernel (block_m None: `moe_grouped.block_rows`)."""
    N, k = ids.shape
    y = mg.grouped_experts(x, ids, gu, dn, block_m=block_m, **tiles).reshape(N, k, -1)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), w)


def pairs(x, ids, w, gu, dn):
    N, k = ids.shape
    y = moe_experts.routed_experts(x, ids, gu, dn).reshape(N, k, -1)
    return jnp.einsum("nkd,nk->nd", y, w)


GROUPED_TILES = {  # (block_m, block_n, block_k, num_warps, num_stages) from 256 tokens on, and below
    "large": [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 32, 8, 4),
              (128, 256, 32, 8, 4), (128, 256, 64, 8, 4), (128, 128, 64, 4, 3), (256, 128, 64, 8, 3)],
    "small": [(16, 128, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 128, 4, 4), (16, 64, 64, 2, 3),
              (16, 256, 64, 4, 3), (32, 128, 64, 4, 3), (16, 64, 256, 4, 3), (16, 128, 64, 2, 4)],
}


def expert_weights(name: str):
    """Random bf16 routed experts of a shape -> (gate_up [E, D, 2Fm], down [E, Fm, D])."""
    E, k, D, Fm = SHAPES[name]
    jax.config.update("jax_default_prng_impl", "rbg")
    key = jax.random.key(0)
    gu = (jax.random.normal(key, (E, D, 2 * Fm), jnp.float32) * 0.02).astype(jnp.bfloat16)
    dn = (jax.random.normal(jax.random.fold_in(key, 1), (E, Fm, D), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return gu, dn


def token_inputs(name: str, N: int, rng: np.random.RandomState):
    """N tokens' routing and activations -> (ids [N, k] numpy, x [N, D] bf16, weights [N, k])."""
    E, k, D, Fm = SHAPES[name]
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    return ids, jnp.asarray(rng.randn(N, D), jnp.bfloat16), jnp.asarray(rng.rand(N, k), jnp.float32)


def main(names):
    res = {"env": env_info()}
    print(res["env"], flush=True)
    for name in names:
        E, k, D, Fm = SHAPES[name]
        gu, dn = expert_weights(name)
        per_expert = (gu.nbytes + dn.nbytes) // E
        rng = np.random.RandomState(0)
        counts = [int(v) for v in os.environ.get("MOE_PATHS_N", "1,4,16,32,1024").split(",")]
        paths = [("gather", gather), ("slots", slots), ("ragged", ragged), ("dense", dense), ("grouped", grouped),
                 ("pairs", pairs)]
        if "MOE_PATHS" in os.environ:
            paths = [p for p in paths if p[0] in os.environ["MOE_PATHS"].split(",")]
        if "grouped" in [p[0] for p in paths] and os.environ.get("MOE_PATHS_TILES", "1") != "0":
            paths += [(f"grouped_{size}_{t}", functools.partial(grouped, block_m=t[0], tiles=dict(
                block_n=t[1], block_k=t[2], num_warps=t[3], num_stages=t[4])))
                for size, tiles in GROUPED_TILES.items() for t in tiles]
        for N in counts:
            ids, x, w = token_inputs(name, N, rng)
            distinct = len(np.unique(ids))
            want = None
            for fname, f in paths:
                if ((fname == "slots" and N * k > 64) or (fname == "gather" and N * k * per_expert > 8e9)
                        or (fname.startswith("grouped_") and fname.split("_")[1] != ("large" if N >= 256 else "small"))
                        or (fname.startswith("grouped_") and N < 32)):
                    continue
                try:
                    fj = jax.jit(f)
                    out = np.asarray(fj(x, jnp.asarray(ids), w, gu, dn))
                    if want is None:
                        want = out
                    err = float(np.abs(out - want).max() / (np.abs(want).max() + 1e-9))
                    t = median_time(fj, x, jnp.asarray(ids), w, gu, dn, n=20)
                    row = {"shape": name, "N": N, "path": fname, "us": t * 1e6, "distinct_experts": distinct,
                           "GBps_distinct": distinct * per_expert / t / 1e9, "rel_err": err}
                except Exception as e:  # noqa: BLE001
                    row = {"shape": name, "N": N, "path": fname, "error": repr(e)[:300]}
                res[f"{name}_N{N}_{fname}"] = row
                print(row, flush=True)
        del gu, dn
    save_json("moe_paths.json", res)


if __name__ == "__main__":
    main(sys.argv[1:] or ["v2lite", "v3"])
