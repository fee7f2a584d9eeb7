"""Tilings of the expert kernel for DeepSeek-V2-Lite's batch-1 products (H200): the dense
products `matvec` runs (the fused query/latent projection with the input norm in its
prologue, the output projection) beside XLA's product as `models.llama.Linear` runs it
(norm kernel, two-row padding), and the routed experts' two products (6 routed + 2 shared
experts of one token; the second, gated one takes the first one's 3 K splits). Time a call: the GPU kernels' summed durations in a
profiler trace of NSETS calls chained in one program, each on its own weight copy (no
call reads another's weights from L2), over 3 runs (`device_time`). Time-boxed by MATVEC_BUDGET_S.

Run: PYTHONPATH=. python3 benchmarks/matvec_configs.py [dense] [gate_up] [down] [variants]
(default: the first three;
result: $OUT/matvec_configs.json)
"""
from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import env_info, save_json
from benchmarks.profile_decode import kernel_spans
from jspec.kernels import moe_experts as me
from jspec.models.llama import product

BUDGET_S = float(os.environ.get("MATVEC_BUDGET_S", "240"))
NSETS = 8
CONFIGS = [  # (block_n, block_k, num_warps, num_stages, num_splits or None: the default rule)
    (128, 64, 2, 3, None), (128, 64, 2, 3, 16), (128, 64, 2, 3, 32), (64, 64, 2, 3, None), (64, 64, 2, 3, 16),
    (64, 128, 2, 3, None), (64, 128, 4, 3, 16), (256, 32, 2, 3, None), (128, 128, 4, 3, None),
    (128, 128, 4, 2, 16), (32, 256, 2, 3, None), (32, 128, 1, 3, 16), (128, 64, 4, 3, None),
    (128, 64, 1, 3, None), (128, 64, 2, 4, None), (128, 64, 2, 2, None), (64, 64, 1, 4, 32),
    (32, 64, 1, 3, None), (32, 128, 1, 3, 32), (64, 128, 1, 3, 16), (32, 64, 2, 3, 32),
]
RES: dict = {"env": env_info(), "rows": []}
T0 = time.perf_counter()


def _tables(rng, E, k, S, own_shared: bool):
    """NSETS routing tables [1, k + S]: distinct routed experts per call; the S shared
    experts E.. E+S-1 in every call (in L2 after the first), or with `own_shared` each
    call its own (E + S r ..), as each layer has its own."""
    tables = np.zeros((NSETS, 1, k + S), np.int32)
    for r in range(NSETS):
        tables[r, 0, :k] = rng.permutation(E)[:k]
        tables[r, 0, k:] = E + (S * r if own_shared else 0) + np.arange(S)
    return jnp.asarray(tables)


def device_time(f, x, id_sets, *ws, **_) -> float:
    """Seconds of GPU kernel time a call of f(x, id_sets[r], *ws) (see the module doc)."""
    import tempfile

    chain = jax.jit(lambda x, id_sets, *ws: [f(x, id_sets[r], *ws) for r in range(NSETS)])
    jax.block_until_ready(chain(x, id_sets, *ws))
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(3):
        jax.block_until_ready(chain(x, id_sets, *ws))
    jax.profiler.stop_trace()
    stats, _ = kernel_spans(d)
    us = sum(v[1] for k, v in stats.items() if not k.lower().startswith(("memcpy", "memset")))
    return us / 1e6 / (3 * NSETS)


def log(row):
    RES["rows"].append(row)
    print(row, flush=True)
    save_json("matvec_configs.json", RES)


def dense(name, K, N, norm: bool):
    key = jax.random.key(K + N)
    x = (jax.random.normal(key, (1, K)) * 3).astype(jnp.bfloat16)
    ws = jax.random.normal(jax.random.fold_in(key, 1), (NSETS, K, N), jnp.bfloat16)
    nw = jnp.ones((K,), jnp.bfloat16)
    sets = jnp.arange(NSETS)
    mb = K * N * 2 / 1e6

    def xla(x, i, ws):
        h = me.rms_norm(x, nw, 1e-6) if norm else x
        return product(h[None], ws[i])  # [1, 1, N]: the Linear's padded one-row product on a GPU

    t = device_time(xla, x, sets, ws, lo=1, hi=NSETS)
    log({"product": name, "impl": "xla", "us": round(t * 1e6, 2), "TB/s": round(mb / 1e6 / t, 2) if t > 0 else None})
    for bn, bk, warps, stages, splits in CONFIGS:
        if time.perf_counter() - T0 > BUDGET_S:
            return

        def kern(x, i, ws):
            return me.expert_matmul(x, jnp.zeros((1,), jnp.int32), ws[i][None], norm=(nw, 1e-6) if norm else None,
                                    block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                    num_splits=splits).astype(jnp.bfloat16)
        try:
            t = device_time(kern, x, sets, ws, lo=1, hi=NSETS)
        except Exception as e:  # noqa: BLE001  (a tiling Triton refuses)
            log({"product": name, "tiles": [bn, bk, warps, stages, splits], "error": str(e)[:200]})
            continue
        log({"product": name, "tiles": [bn, bk, warps, stages, splits], "us": round(t * 1e6, 2),
             "TB/s": round(mb / 1e6 / t, 2) if t > 0 else None})


def experts():
    E, k, D, Fm, S = 64, 6, 2048, 1408, 2
    key = jax.random.key(7)
    gu = jax.random.normal(key, (E, D, 2 * Fm), jnp.bfloat16)
    sgu = jax.random.normal(jax.random.fold_in(key, 2), (S, D, 2 * Fm), jnp.bfloat16)
    x = jax.random.normal(key, (1, D), jnp.bfloat16)
    tables = _tables(np.random.default_rng(0), E, k, S, own_shared=False)
    mb = (k + S) * D * 2 * Fm * 2 / 1e6
    for bn, bk, warps, stages, splits in CONFIGS[:12]:
        if time.perf_counter() - T0 > BUDGET_S:
            return

        def kern(x, t, gu, sgu):
            return me.expert_matmul(x, t, gu, sgu, sum_splits=False, block_n=bn, block_k=bk, num_warps=warps,
                                    num_stages=stages, num_splits=splits)
        t = device_time(kern, x, tables, gu, sgu, lo=1, hi=NSETS)
        log({"product": "v2lite_gate_up_8_experts", "tiles": [bn, bk, warps, stages, splits],
             "us": round(t * 1e6, 2), "TB/s": round(mb / 1e6 / t, 2) if t > 0 else None})


DOWN_CONFIGS = [  # the gated product's tilings: (block_n, block_k, num_warps, num_stages, num_splits)
    (128, 64, 2, 3, None), (128, 64, 2, 3, 2), (128, 64, 2, 3, 3), (128, 64, 2, 3, 8), (64, 64, 2, 3, None),
    (64, 64, 2, 3, 3), (128, 32, 2, 3, None), (128, 128, 4, 3, None), (128, 128, 4, 3, 3), (256, 64, 4, 3, None),
    (256, 64, 4, 3, 3), (128, 64, 4, 3, None), (128, 64, 1, 3, None), (128, 64, 2, 4, None), (128, 64, 2, 2, None),
    (64, 128, 2, 3, None),
]


def down():
    """The gated second product: 8 experts' [1408, 2048] weights, the first product's 3 K
    splits [3, 8, 2816] as input (silu(gate) * up applied while loading)."""
    E, k, D, Fm, S = 64, 6, 2048, 1408, 2
    key = jax.random.key(8)
    dn = jax.random.normal(key, (E, Fm, D), jnp.bfloat16)
    sdn = jax.random.normal(jax.random.fold_in(key, 2), (S, Fm, D), jnp.bfloat16)
    h = jax.random.normal(jax.random.fold_in(key, 3), (3, k + S, 2 * Fm), jnp.float32)
    tables = _tables(np.random.default_rng(1), E, k, S, own_shared=False)
    mb = (k + S) * Fm * D * 2 / 1e6
    for bn, bk, warps, stages, splits in DOWN_CONFIGS:
        if time.perf_counter() - T0 > BUDGET_S:
            return

        def kern(h, t, dn, sdn):
            return me.expert_matmul(h, t, dn, sdn, gated=jnp.bfloat16, block_n=bn, block_k=bk, num_warps=warps,
                                    num_stages=stages, num_splits=splits)
        try:
            t = device_time(kern, h, tables, dn, sdn)
        except Exception as e:  # noqa: BLE001  (a tiling Triton refuses)
            log({"product": "v2lite_down_8_experts", "tiles": [bn, bk, warps, stages, splits], "error": str(e)[:200]})
            continue
        log({"product": "v2lite_down_8_experts", "tiles": [bn, bk, warps, stages, splits],
             "us": round(t * 1e6, 2), "TB/s": round(mb / 1e6 / t, 2) if t > 0 else None})


VARIANTS = [  # (label, expert_matmul keywords; num_splits "x2" / "half": of the default's)
    ("default", {}), ("reduce_each_step", {"reduce_each_step": True}),
    ("reduce_each_step_bk128", {"reduce_each_step": True, "block_k": 128}),
    ("reduce_each_step_bk128_w4", {"reduce_each_step": True, "block_k": 128, "num_warps": 4}),
    ("bn256_w4", {"block_n": 256, "num_warps": 4}), ("stages5", {"num_stages": 5}),
    ("splits_x2", {"num_splits": "x2"}), ("splits_half", {"num_splits": "half"}), ("no_norm", {"norm": None}),
]


def variants():
    """V2-Lite's two expert products of one token (6 routed + 2 shared experts), the first
    with the post-attention norm in its prologue as the model runs it, in kernel variants
    (VARIANTS); and XLA's sum over as many bytes, a reading-speed reference."""
    E, k, D, Fm, S = 64, 6, 2048, 1408, 2
    key = jax.random.key(9)
    gu = jax.random.normal(key, (E, D, 2 * Fm), jnp.bfloat16)
    sgu = jax.random.normal(jax.random.fold_in(key, 1), (NSETS * S, D, 2 * Fm), jnp.bfloat16)
    dn = jax.random.normal(jax.random.fold_in(key, 2), (E, Fm, D), jnp.bfloat16)
    sdn = jax.random.normal(jax.random.fold_in(key, 3), (NSETS * S, Fm, D), jnp.bfloat16)
    x = jax.random.normal(key, (1, D), jnp.bfloat16)
    nw = jnp.ones((D,), jnp.bfloat16)
    tables = _tables(np.random.default_rng(2), E, k, S, own_shared=True)
    mb = (k + S) * D * 2 * Fm * 2 / 1e6
    ref = jax.random.normal(key, (NSETS, (k + S) * D, 2 * Fm), jnp.bfloat16)
    t = device_time(lambda x, i, a: jnp.sum(a[i].astype(jnp.float32), axis=0), x, jnp.arange(NSETS), ref)
    log({"product": "xla_sum_same_bytes", "us": round(t * 1e6, 2), "TB/s": round(mb / 1e6 / t, 2)})
    del ref
    h = me.expert_matmul(x, tables[0], gu, sgu, sum_splits=False, norm=(nw, 1e-6))
    splits = {"gate_up": h.shape[0], "down": me.expert_matmul(h, tables[0], dn, sdn, gated=jnp.bfloat16,
                                                                  sum_splits=False).shape[0]}
    for label, kw in VARIANTS:
        for which in ("gate_up", "down"):
            if time.perf_counter() - T0 > BUDGET_S or (which == "down" and "norm" in kw):
                continue
            kw2 = dict(kw)
            if kw2.get("num_splits") == "x2":
                kw2["num_splits"] = 2 * splits[which]
            elif kw2.get("num_splits") == "half":
                kw2["num_splits"] = max(1, splits[which] // 2)
            try:
                if which == "gate_up":
                    kw2.setdefault("norm", (nw, 1e-6))
                    t = device_time(lambda x, tb, gu, sgu: me.expert_matmul(x, tb, gu, sgu, sum_splits=False, **kw2),
                                    x, tables, gu, sgu)
                else:
                    t = device_time(lambda h, tb, dn, sdn: me.expert_matmul(h, tb, dn, sdn, gated=jnp.bfloat16, **kw2),
                                    h, tables, dn, sdn)
            except Exception as e:  # noqa: BLE001  (a variant Triton refuses)
                log({"product": which, "variant": label, "error": str(e)[:200]})
                continue
            log({"product": which, "variant": label, "us": round(t * 1e6, 2),
                 "TB/s": round(mb / (1 if which == "gate_up" else 2) / 1e6 / t, 2)})


if __name__ == "__main__":
    which = set(sys.argv[1:]) or {"dense", "gate_up", "down"}
    if "variants" in which:
        variants()
    if "dense" in which:
        dense("v2lite_qkv_a_norm", 2048, 3648, True)
        dense("v2lite_o_proj", 2048, 2048, False)
    if "gate_up" in which:
        experts()
    if "down" in which:
        down()
