"""Tilings of MLA decode + output at DeepSeek-V2-Lite's batch-1 shapes (H200): the MLA
kernel's key splits and key block, and the output kernel's column tile and latent chunk,
timed together (the splits the first writes, the second reads; 32 input sets), for one decode token and
a 4-token verify over a dense latent cache of CTX slots (capacity CAPACITY, as the
decode benchmark's). Also the V3 expert products' column tiles. Device time: the
kernels' summed durations in a profiler trace of NSETS calls chained in one program, each
on its own inputs, over 3 runs.

Run: PYTHONPATH=. python3 benchmarks/mla_b1_configs.py [mla] [v3] [rows]   (default mla and v3;
rows: the MLA kernel's query rows a program at 2-4 tokens and at 128 heads; result:
$OUT/mla_b1_configs.json)
"""
from __future__ import annotations

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import env_info, save_json
from benchmarks.profile_decode import kernel_spans
from jspec.cache.layout import AttnMeta
from jspec.kernels import mla_decode as md
from jspec.kernels import mla_output as mo
from jspec.kernels import moe_experts as me

NSETS = 8
CTX, CAPACITY = 1040, 1216
H, DC, DR, DV = 16, 512, 64, 128
RES: dict = {"env": env_info(), "rows": []}


def device_time(f, per_call) -> tuple[float, dict]:
    """(seconds of GPU kernel time of one f(*per_call[r]), {kernel: us a call})."""
    chain = jax.jit(lambda per_call: [f(*a) for a in per_call])
    jax.block_until_ready(chain(per_call))
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(3):
        jax.block_until_ready(chain(per_call))
    jax.profiler.stop_trace()
    stats, _ = kernel_spans(d)
    n = 3 * len(per_call)
    per = {k: round(v[1] / n, 2) for k, v in stats.items() if not k.lower().startswith(("memcpy", "memset"))}
    return sum(per.values()) / 1e6, per


def log(row):
    RES["rows"].append(row)
    print(row, flush=True)
    save_json("mla_b1_configs.json", RES)


def run(name, f, per_call, **kw):
    try:
        t, per = device_time(f, per_call)
    except Exception as e:  # noqa: BLE001  (a tiling Triton refuses)
        log({"case": name, **kw, "error": str(e)[:300]})
        return
    log({"case": name, **kw, "us": round(t * 1e6, 2), "kernels": per})


def mla_inputs(T: int, seed: int, heads: int = H):
    k = jax.random.split(jax.random.key(seed), 4)
    prefix = jnp.full((1,), CTX - T, jnp.int32)
    pos = prefix[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    meta = AttnMeta(positions=pos, prefix_len=prefix, local_mask=jnp.tril(jnp.ones((1, T, T), bool)),
                    local_positions=pos, write_index=jnp.zeros((1, T), jnp.int32), page_table=None)
    return (jax.random.normal(k[0], (1, T, heads, DC), jnp.bfloat16),
            jax.random.normal(k[1], (1, T, heads, DR), jnp.bfloat16),
            jax.random.normal(k[2], (1, CAPACITY, DC + DR), jnp.bfloat16), meta,
            jax.random.normal(k[3], (heads, DV, DC), jnp.bfloat16) * 0.05)


def mla(T: int, configs):
    """configs: (num_splits or None, block_k, num_stages, output block_n, output SPLIT_TILE, output warps)."""
    per_call = [mla_inputs(T, r) for r in range(4 * NSETS)]  # 110 MB: past the 50 MB L2
    default_tile = mo.SPLIT_TILE
    for splits, bk, stages, bn, tile, warps in configs:
        def f(q, r, c, meta, w, splits=splits, bk=bk, stages=stages, bn=bn, warps=warps):
            o, lse = md.paged_mla_attention_splits(q, r, c, meta, scale=0.07, num_splits=splits, block_k=bk,
                                                   num_stages=stages)
            return mo.mla_output(o, lse, w, num_tokens=T, block_n=bn, num_warps=warps)
        mo.SPLIT_TILE = tile
        run(f"mla_T{T}", f, per_call, tiles=dict(splits=splits, block_k=bk, stages=stages, block_n=bn,
                                                 split_tile=tile, warps=warps))
    mo.SPLIT_TILE = default_tile


def mla_rows(T: int, heads: int, block_rows):
    """The MLA kernel (and the output kernel, default tiles) with block_rows query rows a
    program (None: the default rule), T tokens of `heads` heads."""
    per_call = [mla_inputs(T, r, heads) for r in range(4 * NSETS)]
    for br in block_rows:
        def f(q, r, c, meta, w, br=br):
            o, lse = md.paged_mla_attention_splits(q, r, c, meta, scale=0.07, block_rows=br)
            return mo.mla_output(o, lse, w, num_tokens=T)
        run(f"mla_rows_T{T}_H{heads}", f, per_call, block_rows=br)


def v3_experts(Din, Dout, gated: bool, configs):
    E, k = 72, 9
    key = jax.random.key(Din)
    w = jax.random.normal(key, (E, Din, Dout), jnp.bfloat16)
    x = (jax.random.normal(key, (3, k, 2 * Din), jnp.float32) if gated else jax.random.normal(key, (1, Din), jnp.bfloat16))
    rng = np.random.default_rng(0)
    per_call = [(jnp.asarray(rng.permutation(E)[:k][None].astype(np.int32)),) for _ in range(NSETS)]
    mb = k * Din * Dout * 2 / 1e6
    for bn, bk, splits in configs:
        def f(ids, bn=bn, bk=bk, splits=splits):
            return me.expert_matmul(x, ids, w, gated=jnp.bfloat16 if gated else None, sum_splits=gated,
                                    block_n=bn, block_k=bk, num_splits=splits)
        try:
            t, _ = device_time(f, per_call)
        except Exception as e:  # noqa: BLE001
            log({"case": f"v3_{Din}x{Dout}", "tiles": [bn, bk, splits], "error": str(e)[:300]})
            continue
        log({"case": f"v3_{Din}x{Dout}", "tiles": [bn, bk, splits], "us": round(t * 1e6, 2),
             "TB/s": round(mb / 1e6 / t, 2)})


if __name__ == "__main__":
    which = set(sys.argv[1:]) or {"mla", "v3"}
    if "mla" in which:  # SPLIT_TILE 0: 128-wide chunks; 16384: the whole latent at 19-32 splits
        for T in (1, 4):
            mla(T, [(None, 64, 2, 16, 16384, 4), (None, 64, 2, 16, 16384, 8), (None, 64, 2, 16, 0, 4),
                    (None, 64, 2, 32, 16384, 8), (None, 64, 2, 16, 16384, 4)])
    if "rows" in which:  # query rows a program for verify-sized T and V3's 128 heads
        for T, heads in ((2, 16), (4, 16), (1, 128), (4, 128)):
            mla_rows(T, heads, [None, 16, 32, 64])
    if "v3" in which:
        v3_experts(2048, 7168, True, [(128, 64, None), (64, 64, None), (128, 64, None)])
        v3_experts(7168, 4096, False, [(128, 64, None), (64, 64, None), (32, 64, None), (64, 64, 2),
                                       (64, 32, None), (128, 64, None)])
