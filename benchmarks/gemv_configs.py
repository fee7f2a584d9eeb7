"""XLA's Triton tilings for the batch-1 products of the Llama-3.1-8B decode step, cold and
hot (H200).

XLA's autotuner times each candidate tiling on the same buffers again and again, so a
weight that fits in L2 (50 MB on the H200: q/k/v is 50 MB, the output projection 34 MB) is
timed from L2, not from HBM as in a decode step. This script compiles each layer product
([1, K] x [K, N], bf16, weights [in, out]) chained over 16 distinct matrices (cold: 403 MB
and more, L2 cannot help) and over one matrix used 16 times (hot), first with XLA's own
choice, then with tilings forced through `xla_gpu_override_gemm_autotuner` (a coordinate
search from XLA's choice), and prints us per product and TB/s.

Run: PYTHONPATH=. python3 benchmarks/gemv_configs.py [qkv,o,gate_up,down]   (writes
$OUT/gemv_configs.json; GEMV_BUDGET_S bounds the search per shape)
"""
from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import env_info, save_json

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
NMAT, ITERS = 16, 10
BUDGET_S = float(os.environ.get("GEMV_BUDGET_S", 100))
SPACE = {"block_n": (16, 32, 64, 128, 256), "block_k": (64, 128, 256, 512), "split_k": (1, 2, 4, 8, 16),
         "num_stages": (1, 2, 3, 4, 5), "num_warps": (2, 4, 8)}


def chain(K: int, hot: bool):
    def f(ws, x):
        mats = [ws[0]] * NMAT if hot else ws

        def body(_, x):
            for w in mats:
                y = jnp.dot(x, w)  # [1, N] bf16
                x = (y[:, :K] if y.shape[1] >= K else jnp.tile(y, (1, -(-K // y.shape[1])))[:, :K]) * 0.5
            return x
        return jax.lax.fori_loop(0, ITERS, body, x)
    return f


def compiled(f, ws, x, options):
    return jax.jit(f).lower(ws, x).compile(compiler_options=options or None)


def per_product(g, ws, x) -> float:
    jax.block_until_ready(g(ws, x))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(g(ws, x))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / (NMAT * ITERS)


def key_text(cfg: dict) -> str:
    return (f"block_m: 16 block_n: {cfg['block_n']} block_k: {cfg['block_k']} split_k: {cfg['split_k']} "
            f"num_stages: {cfg['num_stages']} num_warps: {cfg['num_warps']} num_ctas: 1")


def xla_choice(f, ws, x) -> dict | None:
    """The tiling XLA's autotuner picks for the product (from a per-fusion cache dump)."""
    d = tempfile.mkdtemp()
    compiled(f, ws, x, {"xla_gpu_per_fusion_autotune_cache_dir": d})
    for path in glob.glob(os.path.join(d, "**", "*"), recursive=True):
        if os.path.isfile(path):
            text = open(path, errors="replace").read()
            m = {k: re.search(rf"{k}: (\d+)", text) for k in SPACE}
            if all(m.values()):
                return {k: int(v.group(1)) for k, v in m.items()}
    return None


def main(names):
    res = {"env": env_info(), "rows": []}
    print(res["env"], flush=True)
    key = jax.random.key(0)
    for name in names:
        N, K = SHAPES[name]
        ws = tuple(jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02 for i in range(NMAT))
        x = jax.random.normal(key, (1, K), jnp.bfloat16)
        nbytes = N * K * 2
        cold, hot = chain(K, False), chain(K, True)
        row = {"name": name, "N": N, "K": K}
        row["xla_choice"] = xla_choice(cold, ws, x)
        row["default_cold_us"] = per_product(compiled(cold, ws, x, None), ws, x) * 1e6
        row["default_hot_us"] = per_product(compiled(hot, ws, x, None), ws, x) * 1e6
        print(f"{name}: XLA picks {row['xla_choice']}; cold {row['default_cold_us']:.2f} us "
              f"({nbytes / row['default_cold_us'] / 1e6:.2f} TB/s), hot {row['default_hot_us']:.2f} us", flush=True)
        tried = {}

        def measure(cfg, hot_too=False):
            k = tuple(sorted(cfg.items()))
            if k in tried:
                return tried[k]
            try:
                opt = {"xla_gpu_override_gemm_autotuner": key_text(cfg)}
                t = per_product(compiled(cold, ws, x, opt), ws, x) * 1e6
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg} failed: {repr(e)[:160]}", flush=True)
                t = float("inf")
            tried[k] = t
            print(f"  {key_text(cfg)}: {t:.2f} us ({nbytes / t / 1e6:.2f} TB/s)", flush=True)
            return t

        best = dict(row["xla_choice"] or {"block_n": 64, "block_k": 256, "split_k": 4, "num_stages": 3,
                                           "num_warps": 4})
        best_t = measure(best)
        t0 = time.perf_counter()
        for _ in range(2):  # coordinate search
            for p, values in SPACE.items():
                for v in values:
                    if time.perf_counter() - t0 > BUDGET_S:
                        break
                    cfg = dict(best, **{p: v})
                    t = measure(cfg)
                    if t < best_t:
                        best, best_t = cfg, t
        row["best"] = best
        row["best_cold_us"] = best_t
        row["best_hot_us"] = per_product(compiled(hot, ws, x, {"xla_gpu_override_gemm_autotuner": key_text(best)}),
                                         ws, x) * 1e6
        row["tried"] = [dict(k, us=t) for k, t in tried.items()]
        print(f"{name}: best {key_text(best)} cold {best_t:.2f} us ({nbytes / best_t / 1e6:.2f} TB/s), "
              f"hot {row['best_hot_us']:.2f} us; XLA's choice cold {row['default_cold_us']:.2f}", flush=True)
        res["rows"].append(row)
        save_json("gemv_configs.json", res)
        del ws


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["o", "qkv"])
