"""Shared benchmark helpers: timing, a device-to-device copy ceiling, random models."""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.config import ModelConfig, RopeConfig
from jspec.models import family_for

LLAMA31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), dtype="bfloat16",
                         max_position_embeddings=131072)


def out_dir() -> str:
    d = os.environ.get("OUT", "/tmp/jspec-bench")
    os.makedirs(d, exist_ok=True)
    return d


def env_info() -> dict:
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
            "date": time.strftime("%Y-%m-%d")}


def copy_bandwidth(nbytes: int = 2 << 30) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second), several ways."""
    out = {}
    try:
        import cupy as cp
        a = cp.ones(nbytes // 2, dtype=cp.float16)
        b = cp.empty_like(a)
        for _ in range(3):
            cp.cuda.runtime.memcpy(b.data.ptr, a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToDevice)
        cp.cuda.runtime.deviceSynchronize()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            cp.cuda.runtime.memcpy(b.data.ptr, a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToDevice)
            cp.cuda.runtime.deviceSynchronize()
            ts.append(time.perf_counter() - t)
        out["cudaMemcpy_d2d"] = 2 * a.nbytes / float(np.median(ts))
        del a, b
        cp.get_default_memory_pool().free_all_blocks()
    except Exception as e:  # noqa: BLE001
        out["cudaMemcpy_d2d_error"] = repr(e)[:200]
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.5)
    out["xla_elementwise"] = 2 * x.nbytes / median_time(f, x)
    return out


def median_time(f, *args, n: int = 10) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def best_call_time(f, *args, calls: int = 50):
    """(seconds a call, the last output): `calls` calls issued back to back, best of 3."""
    out = jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best, out


def random_params(cfg: ModelConfig, seed: int = 0) -> jspec.Params:
    """Random weights made on device (the fast 'rbg' generator: 8B values in seconds)."""
    jax.config.update("jax_default_prng_impl", "rbg")
    init = jax.jit(lambda key: family_for(cfg).init_weights(cfg, key))
    return jspec.Params(config=cfg, weights=init(jax.random.key(seed)))


def eagle3_head(target: jspec.Params, draft_vocab: int = 32000, seed: int = 1) -> jspec.DraftParams:
    tc = target.config
    m = tc.replace(num_layers=1, sliding_windows=(0,))
    n = tc.num_layers
    d = jspec.Eagle3Draft(m, target_hidden_size=tc.hidden_size, aux_layers=(2, n // 2, n - 3),
                          draft_vocab_size=draft_vocab)
    w = jax.jit(lambda k: d.init(k, tc.vocab_size))(jax.random.key(seed))
    return jspec.DraftParams(config=d, weights=w)


def model_for(shape: str = ""):
    """The 8B-shaped target with random weights, and for shape "S,K,N" a random EAGLE-3-shaped
    head with the matching SpecConfig -> (params, spec or None)."""
    target = random_params(LLAMA31_8B)
    if not shape:
        return target, None
    S, K, N = map(int, shape.split(","))
    return target.with_draft(eagle3_head(target)), jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N)


def bench_tag(shape: str = "") -> str:
    """JSPEC_BENCH_TAG joined with the S,K,N shape (as SxKxN), for result file names."""
    return "_".join(x for x in (os.environ.get("JSPEC_BENCH_TAG", ""), shape.replace(",", "x")) if x)


class Runner:
    """Runs one compiled generation loop (`jspec.compile`) with chosen per-request limits,
    so that two lengths share one program and their time difference is per-round cost."""

    def __init__(self, params, prompts, max_new: int, spec=None, cache=None, **sampling):
        self.prog = jspec.compile(params, prompts, max_new_tokens=max_new, stop_token_ids=[], cache=cache, spec=spec,
                                  **sampling)
        self.compile_s = self.prog.compile_s
        self.plan = self.prog.plan

    def run(self, max_new: int, **sampling):
        """(seconds, GenerateOutput) of the compiled prompts with max_new_tokens=max_new
        (sampling values: as compiled, unless given)."""
        out = self.prog.run(max_new_tokens=max_new, **sampling)
        return out.timing["run_s"], out

    def per_round(self, short: int, long: int, reps: int = 3, **sampling):
        """(seconds per round, rounds, tokens) from the difference of two runs."""
        self.run(short, **sampling)
        best = None
        for _ in range(reps):
            ts, rs = self.run(short, **sampling)
            tl, rl = self.run(long, **sampling)
            rounds = max(rl.stats.rounds) - max(rs.stats.rounds)
            toks = rl.timing["new_tokens"] - rs.timing["new_tokens"]
            per = (tl - ts) / rounds
            if best is None or per < best[0]:
                best = (per, rounds, toks)
        return best


def save_json(name: str, obj):
    path = os.path.join(out_dir(), name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path
