"""jspec's Pallas kernels on the GPU against their pure-jnp references: correctness at
real shapes (relative error against a float32 reference of the same inputs, beside the
reference's own error in the inputs' dtype), then times against the reference.

Sections (arguments; default all):
- attention: the GQA decode/verify kernel (`kernels.attention.decode`), dense and paged
  caches, ragged lengths, sliding window; times of single jitted calls (median of 20,
  dispatch included: small cases are bound by it) for Hkv 8, 32 query heads, Dh 128.
- mla: the MLA kernel (`kernels.mla.decode`), dense and paged (1, 16, 64) caches, trees
  up to T=16; device times (a jitted loop of --loop calls, each call's queries through an
  optimization barrier with the previous output, median of 5 loops) for Dc 512, Dr 64 at
  --ctx contexts, B 1 and 32, H 16 and 128 (--tree-rows: also T=16 at B=1, 4k).
- moe: the expert kernel on a routing table with shared experts (`moe_experts.
  routed_experts`, the decode and verification path) against the gather reference, and
  the grouped kernel (`moe_grouped.grouped_experts`, prefill and large batches) against
  `jax.lax.ragged_dot`, at DeepSeek-V2-Lite (E 64, k 6, D 2048, Fm 1408) and V3 (E 256,
  k 8, D 7168, Fm 2048) expert shapes. Correctness with 32 of V3's experts (the V3
  per-expert shape; the float32 yardstick of all 256 would not fit an 80 GB GPU beside
  them); times with all of them, bf16 only: the pair kernel's device time (12 calls
  minus 2 in one program, other experts each call) at N = 1, 4, 16 tokens, TB/s over the
  distinct experts' bytes; the grouped kernel's wall time of one call and its kernel time
  from a profiler trace at N = 32 and 1024.
- deepseek: the other DeepSeek decode kernels: `mla_output` (the MLA splits merged, W_UV
  applied), `mla_inputs` (absorbed query, RoPE, cache row; the row written into a cache),
  `moe_route` (ids equal to the reference's), `matvec` (few-row products through the
  expert kernel, the input norm in its prologue) and the dense MLP as one expert.
- engine: greedy generation with the kernels against the references: a small Llama in
  float32 at the highest matmul precision (tokens must be equal), and a 4-layer
  DeepSeek-V2-Lite-shaped model in bf16 (where the tokens first differ: near-ties flip).

Every case runs in its own try/except; arrays are freed between cases (the largest, V3's
256 experts, are 22.5 GB), so the whole check fits one 80 GB H100 as well as an H200.
No timing case starts after --budget seconds. --check: correctness only. --smoke: tiny
shapes in interpret mode (checks the script on a CPU). Exits 1 when a check fails.

Run: PYTHONPATH=. python3 benchmarks/kernels.py [attention] [mla] [moe] [deepseek] [engine] [--check]
     [--tree-rows] [--ctx 1024,4096,16384,32768] [--moe-shapes v2lite,v3] [--budget 400] [--smoke]
Result: $OUT/kernels.json
"""
from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import V2_LITE, env_info, kernel_time, median_time, prompts, random_params, save_json
from jspec.config import ModelConfig
from jspec.kernels.attention import decode as da
from jspec.kernels import dispatch
from jspec.kernels.mla import decode as md
from jspec.kernels.mla import inputs as mi
from jspec.kernels.mla import output as mo
from jspec.kernels.moe import experts as me
from jspec.kernels.moe import grouped as mg
from jspec.kernels.moe import route as mr
from jspec.kernels.meta import AttnMeta

SECTIONS = ("attention", "mla", "moe", "deepseek", "engine")
T0 = time.perf_counter()
RES: dict = {"env": env_info(), "check": [], "time": [], "errors": []}


def elapsed() -> float:
    return time.perf_counter() - T0


def rel(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def f32(a):
    return a.astype(jnp.float32)


def record(kind: str, row: dict):
    RES[kind].append(row)
    print(f"  {kind} " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
          flush=True)
    save_json("kernels.json", RES)


def error(section: str, case, e: Exception):
    msg = f"{type(e).__name__}: {e}"
    print(f"  ERROR {section} {case}: {msg[:1500]}", flush=True)
    RES["errors"].append({"section": section, "case": str(case), "error": msg[:4000],
                          "trace": traceback.format_exc()[-3000:]})
    save_json("kernels.json", RES)


def cases(section: str, items, fn, timing: bool = False, budget: float = float("inf")):
    """fn(*item) for each item, each in its own try/except; timing cases stop at the budget;
    arrays are freed after each case."""
    for item in items:
        if timing and elapsed() > budget:
            RES["errors"].append({"section": section, "case": str(item), "error": "skipped: budget"})
            continue
        try:
            fn(*item)
        except Exception as e:  # noqa: BLE001
            error(section, item, e)
        gc.collect()


def checked(section: str, name: str, err: float, ref_err: float | None, tol: float, **extra):
    """A correctness row: the kernel's error within max(tol, 4 x the dtype reference's)."""
    ok = bool(np.isfinite(err) and err <= max(tol, 4 * (ref_err or 0.0)))
    record("check", {"section": section, "name": name, "kernel_vs_f32": err,
                     **({} if ref_err is None else {"reference_vs_f32": ref_err}), **extra, "ok": ok})


# --------------------------------------------------------------------------- attention

Hkv, Gq, Dh = 8, 4, 128


def attention_inputs(key, *, B, T, ctx, page_size=0, dtype=jnp.bfloat16, Tl=None, ragged=False, capacity=None,
                     Hkv=Hkv, Gq=Gq, Dh=Dh):
    """Decode/verify inputs: each row holds `ctx` keys (random in [T, capacity] when ragged),
    the last T new (a causal chain); paged caches use shuffled pages."""
    capacity = capacity or ctx
    Tl = Tl or T
    kq, kk, kl, kp = jax.random.split(key, 4)
    lengths = jax.random.randint(kl, (B,), Tl, capacity + 1) if ragged else jnp.full((B,), ctx)
    prefix = (lengths - Tl).astype(jnp.int32)
    local_pos = prefix[:, None] + jnp.arange(Tl, dtype=jnp.int32)[None]
    local_mask = jnp.broadcast_to(jnp.tril(jnp.ones((Tl, Tl), bool))[Tl - T:], (B, T, Tl))
    meta = dict(positions=local_pos[:, Tl - T:], prefix_len=prefix, local_mask=local_mask,
                local_positions=local_pos, write_index=jnp.zeros((B, T), jnp.int32))
    if page_size:
        Gp = -(-capacity // page_size)
        table = jax.random.permutation(kp, B * Gp).astype(jnp.int32).reshape(B, Gp)
        shape = (B * Gp, page_size, 2, Hkv, Dh)
        meta.update(page_table=table, page_size=page_size)
    else:
        shape = (B, capacity, 2, Hkv, Dh)
        meta.update(page_table=None)
    q = jax.random.normal(kq, (B, T, Hkv * Gq, Dh), dtype)
    kv = jax.random.normal(kk, shape, dtype)  # keys and values (jspec.cache.kv layout)
    return q, kv, AttnMeta(**meta), lengths


def attention(args):
    print("\n== attention: GQA decode/verify kernel", flush=True)
    shrink = (lambda c: max(32, c // 16)) if args.smoke else (lambda c: c)
    checks = [  # name, inputs, window, kernel keywords
        ("dense T1 S1000", dict(B=2, T=1, ctx=1000), 0, {}),
        ("dense T16 ragged", dict(B=3, T=16, ctx=1024, ragged=True), 0, dict(num_splits=4)),
        ("paged16 T4 ragged", dict(B=4, T=4, ctx=2048, page_size=16, ragged=True), 0, {}),
        ("paged3 T16 Tl24", dict(B=2, T=16, Tl=24, ctx=300, page_size=3, ragged=True), 0, {}),
        ("paged64 T4 window128", dict(B=2, T=4, ctx=1024, page_size=64), 128, {}),
        ("paged1 T1 Gq1 Dh64", dict(B=2, T=1, ctx=100, page_size=1, Gq=1, Dh=64), 0, {}),
        ("dense f32 T4", dict(B=2, T=4, ctx=512, dtype=jnp.float32), 0, {}),
    ]

    def check(i, name, kw, window, kkw):
        q, kv, meta, _ = attention_inputs(jax.random.key(i), **dict(kw, ctx=shrink(kw["ctx"])))
        s = q.shape[-1] ** -0.5
        out = f32(jax.jit(lambda q, kv, m: da.paged_decode_attention(q, kv, m, window=window, scale=s, **kkw))(
            q, kv, meta))
        with jax.default_matmul_precision("highest"):  # no TF32 in the yardstick
            ref32 = da.decode_attention_reference(f32(q), f32(kv), meta, window=window, scale=s)
        ref = f32(da.decode_attention_reference(q, kv, meta, window=window, scale=s))
        checked("attention", name, rel(out, ref32), rel(ref, ref32), 1e-4 if q.dtype == jnp.float32 else 3e-2)

    cases("attention", [(i,) + c for i, c in enumerate(checks)], check)
    if args.check:
        return
    ctxs, batches, capacity = ((64, 256), (1, 2), 256) if args.smoke else ((1024, 4096), (1, 32), 4096)

    def time_case(cache, B, T, ctx, ragged=False):
        page_size = int(cache[5:]) if cache.startswith("paged") else 0
        q, kv, meta, lengths = attention_inputs(jax.random.key(B * T + ctx), B=B, T=T, ctx=ctx, page_size=page_size,
                                                ragged=ragged)
        keys = int(lengths.sum()) if ragged else B * ctx
        nbytes = 2 * keys * Hkv * Dh * kv.dtype.itemsize + 2 * q.nbytes
        s = Dh ** -0.5
        t_k = median_time(jax.jit(lambda q, kv, m: da.paged_decode_attention(q, kv, m, scale=s)), q, kv, meta, n=20)
        t_r = median_time(jax.jit(lambda q, kv, m: da.decode_attention_reference(q, kv, m, scale=s)), q, kv, meta,
                          n=20)
        record("time", {"section": "attention", "cache": cache, "B": B, "T": T, "ctx": ctx, "ragged": ragged,
                        "kernel_us": t_k * 1e6, "kernel_TBps": nbytes / t_k / 1e12, "reference_us": t_r * 1e6,
                        "reference_TBps": nbytes / t_r / 1e12, "speedup": t_r / t_k})

    items = [(f"paged{p}" if p else "dense", B, T, ctx) for ctx in ctxs for B in batches for T in (1, 4, 16)
             for p in (0, 16, 64)]
    items += [(c, batches[-1], 4, capacity, True) for c in ("dense", "paged16")]
    cases("attention", items, time_case, timing=True, budget=args.budget)


# --------------------------------------------------------------------------- mla

def mla_inputs_of(key, *, B, T, H, ctx, page_size=0, dtype=jnp.bfloat16, Tl=None, ragged=False, tree=False,
                  Dc=512, Dr=64):
    """q_lat, q_pe, latent buffer, meta: each row holds `ctx` slots (random in [Tl, ctx] when
    ragged), the last Tl of them the local block (a causal chain, or with tree=True a
    binary-ish tree: node j's parent is (j - 1) // 2); paged caches use shuffled pages."""
    Tl = Tl or T
    kq, kr, kc, kl, kp = jax.random.split(key, 5)
    lengths = jax.random.randint(kl, (B,), Tl, ctx + 1) if ragged else jnp.full((B,), ctx)
    prefix = (lengths - Tl).astype(jnp.int32)
    if tree:
        anc = np.eye(Tl, dtype=bool)
        depth = np.zeros(Tl, np.int32)
        for j in range(1, Tl):
            anc[j] |= anc[(j - 1) // 2]
            depth[j] = depth[(j - 1) // 2] + 1
        local, local_pos = jnp.asarray(anc), prefix[:, None] + jnp.asarray(depth)[None]
    else:
        local = jnp.tril(jnp.ones((Tl, Tl), bool))
        local_pos = prefix[:, None] + jnp.arange(Tl, dtype=jnp.int32)[None]
    meta = dict(positions=local_pos[:, Tl - T:], prefix_len=prefix,
                local_mask=jnp.broadcast_to(local[Tl - T:], (B, T, Tl)), local_positions=local_pos,
                write_index=jnp.zeros((B, T), jnp.int32))
    if page_size:
        Gp = -(-ctx // page_size)
        table = jax.random.permutation(kp, B * Gp).astype(jnp.int32).reshape(B, Gp)
        shape = (B * Gp + 1, page_size, Dc + Dr)  # + the trash page
        meta.update(page_table=table, page_size=page_size)
    else:
        shape = (B, ctx, Dc + Dr)
        meta.update(page_table=None)
    return (jax.random.normal(kq, (B, T, H, Dc), dtype), jax.random.normal(kr, (B, T, H, Dr), dtype),
            jax.random.normal(kc, shape, dtype), AttnMeta(**meta))


def loop_time(f, args, loop: int, reps: int = 5):
    """(seconds a call of f(*args), its output): median over `reps` runs of a jitted loop of
    `loop` calls, each call's first argument through an optimization barrier with the
    previous output (nothing hoisted), divided by `loop`."""
    q, rest = args[0], args[1:]
    out0 = jax.eval_shape(f, *args)

    @jax.jit
    def looped(q, *rest):
        def body(_, carry):
            q, o = jax.lax.optimization_barrier(carry)
            return q, f(q, *rest)
        return jax.lax.fori_loop(0, loop, body, (q, jnp.zeros(out0.shape, out0.dtype)))[1]

    out = jax.block_until_ready(looped(q, *rest))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(looped(q, *rest))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / loop, out


def mla(args):
    print("\n== mla: MLA decode/verify kernel", flush=True)
    dims = dict(Dc=32, Dr=16, dtype=jnp.float32) if args.smoke else {}  # XLA:CPU: no bf16 x bf16 -> f32 dot
    shrink = (lambda c: max(16, c // 64)) if args.smoke else (lambda c: c)
    checks = [  # name, inputs, kernel keywords
        ("dense T1 H16 B2", dict(B=2, T=1, H=16, ctx=1000), {}),
        ("dense T1 H128 B3 ragged", dict(B=3, T=1, H=128, ctx=4096, ragged=True), {}),
        ("paged16 T4 H16 tree ragged", dict(B=4, T=4, H=16, ctx=2048, page_size=16, ragged=True, tree=True), {}),
        ("paged1 T3 Tl7 H16 tree", dict(B=2, T=3, Tl=7, H=16, ctx=300, page_size=1, ragged=True, tree=True),
         dict(num_splits=3)),
        ("paged64 T16 H128 tree", dict(B=2, T=16, H=128, ctx=1024, page_size=64, tree=True, ragged=True), {}),
        ("dense T5 H16 splits1", dict(B=2, T=5, H=16, ctx=700, ragged=True), dict(num_splits=1)),
        ("dense T2 H128 rows64", dict(B=1, T=2, H=128, ctx=3000), dict(block_rows=64)),
        ("dense f32 T4 H16", dict(B=2, T=4, H=16, ctx=512, dtype=jnp.float32, tree=True), {}),
    ]

    def check(i, name, kw, kkw):
        q, r, c, meta = mla_inputs_of(jax.random.key(i), **{**kw, **dims, "ctx": shrink(kw["ctx"])})
        s = (q.shape[-1] + r.shape[-1]) ** -0.5
        out = jax.jit(lambda q, r, c, m: md.paged_mla_attention(q, r, c, m, scale=s, **kkw))(q, r, c, meta)
        with jax.default_matmul_precision("highest"):
            ref32 = md.mla_decode_reference(f32(q), f32(r), f32(c), meta, scale=s)
        ref = md.mla_decode_reference(q, r, c, meta, scale=s)  # the inputs' dtype, default precision
        checked("mla", name, rel(out, ref32), rel(ref, ref32), 1e-4 if q.dtype == jnp.float32 else 2e-2,
                shape_ok=out.shape == q.shape and out.dtype == jnp.float32)

    cases("mla", [(i,) + c for i, c in enumerate(checks)], check)
    if args.check:
        return

    def time_case(T, ctx, B, H):
        c_ = shrink(ctx)
        q, r, c, meta = mla_inputs_of(jax.random.key(B + H + c_), B=B, T=T, H=H, ctx=c_, tree=T > 1, **dims)
        s = (q.shape[-1] + r.shape[-1]) ** -0.5
        nbytes = B * c_ * c.shape[-1] * c.dtype.itemsize
        flops = 2 * B * T * H * c_ * (2 * q.shape[-1] + r.shape[-1])
        t_r, ref = loop_time(lambda q, r, c, m: md.mla_decode_reference(q, r, c, m, scale=s), (q, r, c, meta),
                             args.loop)
        t_k, out = loop_time(lambda q, r, c, m: md.paged_mla_attention(q, r, c, m, scale=s), (q, r, c, meta),
                             args.loop)
        record("time", {"section": "mla", "T": T, "B": B, "H": H, "ctx": c_, "kernel_us": t_k * 1e6,
                        "kernel_TBps": nbytes / t_k / 1e12, "kernel_TFps": flops / t_k / 1e12,
                        "reference_us": t_r * 1e6, "speedup": t_r / t_k, "rel_err": rel(out, ref)})

    items = [(16, 4096, 1, 16), (16, 4096, 1, 128)] if args.tree_rows else []
    items += [(1, ctx, B, H) for ctx in args.ctx for B in (1, 32) for H in (16, 128)]
    cases("mla", items, time_case, timing=True, budget=args.budget)


# --------------------------------------------------------------------------- moe

MOE_SHAPES = {  # E, k, D, Fm, shared experts
    "v2lite": (64, 6, 2048, 1408, 2), "v3": (256, 8, 7168, 2048, 1), "tiny": (16, 2, 64, 48, 1)}
CHECK_EXPERTS = {"v3": 32}  # experts in the correctness check (the float32 yardstick of all 256: 67 GB)


def expert_weights(E: int, D: int, Fm: int, seed: int = 0):
    """Random bf16 experts made on device: (gate_up [E, D, 2Fm], down [E, Fm, D])."""
    key = jax.random.key(seed)
    make = jax.jit(lambda k, shape, scale: (jax.random.normal(k, shape, jnp.bfloat16) * scale).astype(jnp.bfloat16),
                   static_argnums=(1, 2))
    return (jax.block_until_ready(make(key, (E, D, 2 * Fm), float(D) ** -0.5)),
            jax.block_until_ready(make(jax.random.fold_in(key, 1), (E, Fm, D), float(Fm) ** -0.5)))


def routing_table(rng, N: int, E: int, k: int, S: int):
    """Each of N tokens' k distinct routed experts, then the S shared ones (E..E+S-1):
    ids [N, KP] (KP a power of two; the slots past k+S unused)."""
    KP = 1 << (k + S - 1).bit_length()
    table = np.zeros((N, KP), np.int32)
    table[:, :k] = np.stack([rng.choice(E, k, replace=False) for _ in range(N)])
    table[:, k:k + S] = np.arange(E, E + S)
    return jnp.asarray(table)


def chain_time(f, x, id_sets, *ws, lo: int = 2, hi: int = 12) -> float:
    """Device seconds a call: f over `hi` and over `lo` id sets chained in one jitted
    program (other experts each call: no L2 reuse across calls), the difference of the
    two medians over hi - lo calls (cancels the dispatch and sync)."""
    def chain(x, id_sets, *ws, n):
        return [f(x, id_sets[r], *ws) for r in range(n)]
    t = {n: median_time(jax.jit(functools.partial(chain, n=n)), x, id_sets, *ws, n=10) for n in (lo, hi)}
    return (t[hi] - t[lo]) / (hi - lo)


def moe_check(name: str, smoke: bool):
    E, k, D, Fm, S = MOE_SHAPES[name]
    E = CHECK_EXPERTS.get(name, E)
    gu, dn = expert_weights(E, D, Fm)
    sgu, sdn = expert_weights(S, D, Fm, seed=1)
    rng = np.random.default_rng(0)

    def pairs(N):
        x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
        table = routing_table(rng, N, E, k, S)
        got = jax.jit(lambda *a: me.routed_experts(*a, k + S))(x, table, gu, dn, (sgu, sdn))
        ref = me.routed_experts_reference(x, table, gu, dn, (sgu, sdn), k + S)
        chain = me.routed_experts_reference(f32(x), table, f32(gu), f32(dn), (f32(sgu), f32(sdn)), k + S)
        checked("moe", f"pair kernel {name} N{N} (E {E}, {S} shared)", rel(got, chain), rel(ref, chain), 2e-2)
        # the first product alone (pairs of the routed experts) against its float32 reference
        ids = table[:, :k].reshape(-1)
        xp = jnp.repeat(x, k, axis=0)
        h = jax.jit(me.expert_matmul)(xp, ids, gu)
        checked("moe", f"expert_matmul {name} N{N}", rel(h, me.expert_matmul_reference(xp, ids, gu)), None, 1e-4)

    def grouped(N):
        x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
        ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32))
        got = jax.jit(mg.grouped_experts)(x, ids, gu, dn)
        ref = jax.jit(mg.grouped_experts_reference)(x, ids, gu, dn)
        with jax.default_matmul_precision("highest"):
            ref32 = mg.grouped_experts_reference(f32(x), ids, f32(gu), f32(dn))
        checked("moe", f"grouped kernel {name} N{N} (E {E})", rel(got, ref32), rel(ref, ref32), 2e-2)

    cases("moe", [(N,) for N in (1, 4)], pairs)
    cases("moe", [(N,) for N in ((8,) if smoke else (32,))], grouped)
    del gu, dn, sgu, sdn


def moe_time(name: str, args):
    E, k, D, Fm, S = MOE_SHAPES[name]
    gu, dn = expert_weights(E, D, Fm)
    per_expert = (gu.nbytes + dn.nbytes) // E
    rng = np.random.default_rng(1)

    def pairs(N):
        """The pair kernel against the gather reference (pairs of N tokens; 12 id sets)."""
        x = jnp.repeat(jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16), k, axis=0)  # [N*k, D]
        sets = [np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).reshape(-1) for _ in range(12)]
        distinct = float(np.mean([len(np.unique(s)) for s in sets]))
        sets = jnp.asarray(np.stack(sets).astype(np.int32))
        nbytes = distinct * per_expert
        row = {"section": "moe", "path": "pairs", "shape": name, "N": N, "pairs": N * k, "MB": nbytes / 1e6}
        t_k = chain_time(me.routed_experts, x, sets, gu, dn)
        big = N * k * per_expert > 2e9  # the reference gathers GBs a call: fewer in flight
        t_r = chain_time(me.routed_experts_reference, x, sets, gu, dn, lo=1 if big else 2, hi=2 if big else 12)
        record("time", dict(row, kernel_us=t_k * 1e6, kernel_TBps=nbytes / t_k / 1e12, reference_us=t_r * 1e6,
                            reference_TBps=nbytes / t_r / 1e12, speedup=t_r / t_k))

    def grouped(N):
        """The grouped kernel against ragged_dot: wall time of one call, kernel time (trace)."""
        sets = [(jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16),
                 jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)), gu, dn)
                for _ in range(4)]
        distinct = float(np.mean([len(np.unique(np.asarray(s[1]))) for s in sets]))
        row = {"section": "moe", "path": "grouped", "shape": name, "N": N, "pairs_per_expert": N * k / E,
               "MB": distinct * per_expert / 1e6}
        fk = jax.jit(mg.grouped_experts)
        row.update(kernel_us_wall=median_time(fk, *sets[0], n=20) * 1e6, kernel_us=kernel_time(fk, sets) * 1e6)
        if N * k * E <= 1 << 20:  # ragged_dot's GPU lowering holds memory in proportion to groups x pairs
            fr = jax.jit(mg.grouped_experts_reference)
            row.update(reference_us_wall=median_time(fr, *sets[0], n=20) * 1e6,
                       reference_us=kernel_time(fr, sets) * 1e6)
            if row["kernel_us"] > 0:  # off GPU a trace holds no kernels
                row["speedup"] = row["reference_us"] / row["kernel_us"]
        record("time", row)

    cases("moe", [(N,) for N in (1, 4, 16)], pairs, timing=True, budget=args.budget)
    cases("moe", [(N,) for N in ((8, 64) if args.smoke else (32, 1024))], grouped, timing=True, budget=args.budget)
    del gu, dn


def moe(args):
    print("\n== moe: the pair and grouped expert kernels", flush=True)
    names = ["tiny"] if args.smoke else args.moe_shapes.split(",")
    for name in names:
        moe_check(name, args.smoke)
        gc.collect()
    if not args.check:
        for name in names:
            moe_time(name, args)
            gc.collect()


# --------------------------------------------------------------------------- deepseek

def deepseek(args):
    print("\n== deepseek: mla_output, mla_inputs, moe_route, matvec", flush=True)
    Dc, Dv = (64, 16) if args.smoke else (512, 128)

    def mla_output(H, B, T, NS):
        rng = np.random.default_rng(H + B + T)
        R = -(-(T * H) // 64) * 64
        o = jnp.asarray(rng.standard_normal((B, NS, R, Dc)), jnp.float32)
        lse = jnp.asarray(rng.uniform(-2, 2, (B, NS, R)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((H, Dv, Dc)) / np.sqrt(Dc), jnp.bfloat16)
        got = jax.jit(lambda o, l, w: mo.mla_output(o, l, w, num_tokens=T))(o, lse, w)
        ref16 = mo.mla_output_reference(o, lse, w, num_tokens=T, dtype=jnp.bfloat16)
        ref32 = mo.mla_output_reference(o, lse, f32(w), num_tokens=T, dtype=jnp.float32)
        checked("deepseek", f"mla_output H{H} B{B} T{T} NS{NS}", rel(got, ref32), rel(ref16, ref32), 1e-2)

    shapes = [(4, 1, 1, 4), (4, 2, 4, 2)] if args.smoke else [(16, 1, 1, 16), (16, 32, 1, 8), (16, 1, 4, 16),
                                                              (128, 1, 1, 2), (128, 32, 4, 1)]
    cases("deepseek", shapes, mla_output)

    def mla_inputs(H, Dn, Dr, S, slot, slots):
        rng = np.random.default_rng(11)
        parts = jnp.asarray(rng.standard_normal((S, 1, H * (Dn + Dr) + Dc + Dr)) / 4, jnp.float32)
        angle = rng.uniform(0, 6, (1, Dr // 2))
        cos, sin = (jnp.asarray(f(angle), jnp.float32) for f in (np.cos, np.sin))
        norm = jnp.asarray(1 + 0.1 * rng.standard_normal(Dc), jnp.bfloat16)
        w_uk = jnp.asarray(rng.standard_normal((Dc, H, Dn)) / np.sqrt(Dc), jnp.bfloat16)
        qkv = jnp.sum(parts, axis=0).astype(jnp.bfloat16)
        Q = H * (Dn + Dr)
        for inter in (True, False):
            got = jax.jit(lambda *a: mi.mla_inputs(*a, interleaved=inter, eps=1e-6))(parts, cos, sin, norm, w_uk)
            ref = mi.mla_inputs_reference(qkv[:, :Q].reshape(1, H, -1), qkv[:, Q:], cos, sin, norm, w_uk,
                                          interleaved=inter, eps=1e-6)
            errs = [rel(f32(g), f32(r)) for g, r in zip(got, ref)]
            checked("deepseek", f"mla_inputs interleaved={inter}", max(errs), None, 1e-2, q_lat=errs[0],
                    q_pe=errs[1], rows=errs[2])
        # the row written into a latent cache [1, slots, Dc+Dr] (the buffer donated, so updated
        # in place) equals the rows output; every other slot unchanged
        cache = jnp.asarray(rng.standard_normal((1, slots, Dc + Dr)), jnp.bfloat16)
        want = np.asarray(cache, np.float32)
        rows = np.asarray(jax.jit(lambda *a: mi.mla_inputs(*a, interleaved=True, eps=1e-6))(
            parts, cos, sin, norm, w_uk)[2], np.float32)
        write = jax.jit(lambda c, *a: mi.mla_inputs(*a, interleaved=True, eps=1e-6, cache=c,
                                                    write_index=jnp.asarray([[slot]], jnp.int32))[2], donate_argnums=0)
        got = np.asarray(write(cache, parts, cos, sin, norm, w_uk), np.float32)
        want[0, slot] = rows[0]
        record("check", {"section": "deepseek", "name": "mla_inputs cache write", "ok": bool((got == want).all())})

    cases("deepseek", [(2, 16, 8, 4, 40, 64)] if args.smoke else [(16, 128, 64, 16, 1040, 1217)], mla_inputs)

    def route(name, r, N):
        rng = np.random.default_rng(N)
        logits = jnp.asarray(rng.standard_normal((N, r.num_experts)), jnp.float32)
        bias = jnp.asarray(rng.uniform(-0.1, 0.1, r.num_experts), jnp.float32) if r.scoring == "sigmoid" else None
        w, ids = jax.jit(lambda l, b: mr.route_kernel(r, l, b))(logits, bias)
        w_ref, ids_ref = mr.route_reference(r, logits, bias)
        same = bool((np.asarray(ids) == np.asarray(ids_ref)).all())
        record("check", {"section": "deepseek", "name": f"moe_route {name} N{N}", "ids_equal": same,
                         "weights_max_diff": float(jnp.abs(w - w_ref).max()), "ok": same})

    routings = (("v2lite", mr.Routing(64, 6, num_extra=2)),
                ("v3", mr.Routing(256, 8, scoring="sigmoid", method="noaux_tc", n_group=8, topk_group=4,
                                  norm_topk_prob=True, scaling=2.5, num_extra=1)))
    cases("deepseek", [(n, r, N) for n, r in routings for N in ((1, 4) if args.smoke else (1, 4, 64))], route)

    def matvec(name, K, N, norm):
        key = jax.random.key(5)
        x = (jax.random.normal(key, (1, K)) * 3).astype(jnp.bfloat16)
        w = jax.random.normal(jax.random.fold_in(key, 1), (K, N), jnp.bfloat16) / float(np.sqrt(K))
        nw = (1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (K,))).astype(jnp.bfloat16)
        got = jax.jit(lambda x, w, nw: me.matvec(x, w, (nw, 1e-6) if norm else None, float32_out=True))(x, w, nw)
        xin = me.rms_norm(x, nw, 1e-6) if norm else x
        ref = jnp.dot(f32(xin), f32(w), precision=jax.lax.Precision.HIGHEST)
        checked("deepseek", f"matvec {name}", rel(got, ref), None, 1e-5)

    mats = ([("small_norm", 256, 192, True), ("small", 256, 256, False)] if args.smoke else
            [("qkv_a", 2048, 3648, True), ("o_proj", 2048, 2048, False), ("v3_qkv_a", 7168, 2112, True)])
    cases("deepseek", mats, matvec)

    def dense_mlp(D, F):
        key = jax.random.key(6)
        x = jax.random.normal(key, (1, D), jnp.bfloat16)
        gu = jax.random.normal(jax.random.fold_in(key, 3), (1, D, 2 * F), jnp.bfloat16) / float(np.sqrt(D))
        dn = jax.random.normal(jax.random.fold_in(key, 4), (1, F, D), jnp.bfloat16) / float(np.sqrt(F))
        one = jnp.zeros((1,), jnp.int32)
        got = jax.jit(me.routed_experts)(x, one, gu, dn)
        ref = me.routed_experts_reference(x, one, gu, dn)
        chain = me.routed_experts_reference(f32(x), one, f32(gu), f32(dn))
        checked("deepseek", f"dense MLP as one expert D{D} F{F}", rel(got, chain), rel(ref, chain), 2e-2)

    cases("deepseek", [(128, 320)] if args.smoke else [(2048, 10944)], dense_mlp)


# --------------------------------------------------------------------------- engine

def engine(args):
    print("\n== engine: greedy generation with the kernels against the references", flush=True)
    mode = "auto" if jax.default_backend() == "gpu" else "pallas"  # pallas: interpret mode off GPU

    def generate(params, ps, **kw):
        outs = {}
        for m in ("reference", mode):
            with dispatch.use_backend(m):
                jspec.clear_caches()  # traces read the backend
                outs[m] = jspec.generate(params, ps, max_new_tokens=24 if args.smoke else 48, stop_token_ids=[],
                                         **kw).tokens
        return outs["reference"], outs[mode]

    def llama():
        cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=64)
        with jax.default_matmul_precision("highest"):
            a, b = generate(random_params(cfg), [list(range(5, 40)), list(range(100, 107))],
                            cache=jspec.CacheConfig("paged", page_size=16))
        record("check", {"section": "engine", "name": "Llama float32, paged16, 2 prompts", "ok": a == b})

    def deepseek_model():
        if args.smoke:
            cfg = V2_LITE.replace(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                                  moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                  n_shared_experts=1, dtype="float32")
        else:
            cfg = V2_LITE.replace(num_layers=4)
        with jax.default_matmul_precision("highest"):
            a, b = generate(random_params(cfg), prompts(1, cfg.vocab_size, ctx=64 if args.smoke else 1024))
        a, b = a[0], b[0]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        exact = cfg.dtype == "float32"  # bf16: near-ties between summation orders may flip
        record("check", {"section": "engine", "name": f"DeepSeek-V2-Lite shape, {cfg.num_layers} layers, {cfg.dtype}",
                         "identical": a == b, "first_difference": first, "tokens": len(a),
                         "ok": a == b or not exact})

    cases("engine", [()], llama)
    gc.collect()
    cases("engine", [()], deepseek_model)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sections", nargs="*", help=f"of {', '.join(SECTIONS)} (default: all)")
    ap.add_argument("--check", action="store_true", help="correctness only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (off GPU)")
    ap.add_argument("--ctx", default="1024,4096,16384,32768", type=lambda v: [int(x) for x in v.split(",")],
                    help="mla: table contexts")
    ap.add_argument("--tree-rows", action="store_true", help="mla: T=16 (tree) rows at B=1, ctx 4096")
    ap.add_argument("--loop", type=int, default=20, help="mla: calls per timed loop")
    ap.add_argument("--moe-shapes", default="v2lite,v3", help="moe: expert shapes, of v2lite, v3")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; no timing case starts after")
    args = ap.parse_args()
    sections = args.sections or list(SECTIONS)
    if set(sections) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; sections: {', '.join(SECTIONS)}")
    print(RES["env"], flush=True)
    jax.config.update("jax_default_prng_impl", "rbg")
    RES["argv"] = sys.argv[1:]
    for s in SECTIONS:
        if s in sections:
            globals()[s](args)
            gc.collect()
    failed = [c["name"] for c in RES["check"] if not c["ok"]]
    errors = [e for e in RES["errors"] if not e["error"].startswith("skipped")]
    RES.update(total_s=elapsed(), failed=failed)
    try:  # the most device memory the check held at once
        RES["peak_GB_in_use"] = jax.devices()[0].memory_stats()["peak_bytes_in_use"] / 1e9
        print(f"peak device memory in use: {RES['peak_GB_in_use']:.1f} GB", flush=True)
    except Exception:  # noqa: BLE001  (backends without memory_stats)
        pass
    print(f"\n{len(RES['check'])} checks, {len(failed)} failed {failed}; {len(errors)} errors, "
          f"{len(RES['errors']) - len(errors)} skipped; {elapsed():.0f} s; wrote {save_json('kernels.json', RES)}",
          flush=True)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
