"""The Pallas decode/verify attention kernel on one GPU: correctness against the reference
(bf16, relative error), then time and achieved bandwidth against the reference (XLA
einsum; paged caches gathered first) for decode shapes, then a small tuning sweep.

    python benchmarks/kernels_h200.py        # writes $OUT/kernels_h200.json (OUT=/tmp)
    KERNELS_SMOKE=1 python benchmarks/kernels_h200.py   # tiny shapes, interpret mode (CPU)
    KERNELS_CHECK_ONLY=1 ...                            # the correctness section only

Every case runs in its own try/except, and sections are skipped once the time budget is
spent, so one failure or a slow compile does not lose the rest.
"""
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.cache.layout import AttnMeta  # noqa: E402
from jspec.kernels import decode_attention as da  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
BUDGET_S = 150  # start no new case after this (the whole script must stay under 3 min)
SMOKE = bool(os.environ.get("KERNELS_SMOKE"))  # check the script itself off GPU
INTERPRET = SMOKE
CTXS, BATCHES, CAPACITY = ((64, 256), (1, 2), 256) if SMOKE else ((1024, 4096), (1, 32), 4096)
T0 = time.perf_counter()
Hkv, Gq, Dh = 8, 4, 128
res = {"jax": jax.__version__, "backend": jax.default_backend(),
       "devices": [str(d) for d in jax.devices()], "check": [], "bench": [], "sweep": [],
       "errors": []}
print(json.dumps({k: res[k] for k in ("jax", "backend", "devices")}), flush=True)


def elapsed():
    return time.perf_counter() - T0


def save():
    """Writes what there is so far (also after each section, in case the run is cut short)."""
    res["total_s"] = elapsed()
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "kernels_h200.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    return path


def make_inputs(key, *, B, T, ctx, page_size=0, dtype=jnp.bfloat16, Tl=None, ragged=False,
                capacity=None, Hkv=Hkv, Gq=Gq, Dh=Dh):
    """Decode/verify inputs: each row holds `ctx` keys (random in [T, capacity] when ragged),
    the last T new (causal chain); paged caches use shuffled pages."""
    capacity = capacity or ctx
    Tl = Tl or T
    kq, kk, kl, kp = jax.random.split(key, 4)
    if ragged:
        lengths = jax.random.randint(kl, (B,), Tl, capacity + 1)
    else:
        lengths = jnp.full((B,), ctx)
    prefix = (lengths - Tl).astype(jnp.int32)
    local_pos = prefix[:, None] + jnp.arange(Tl, dtype=jnp.int32)[None]
    local_mask = jnp.broadcast_to(jnp.tril(jnp.ones((Tl, Tl), bool))[Tl - T:], (B, T, Tl))
    meta = dict(positions=local_pos[:, Tl - T:], prefix_len=prefix, local_mask=local_mask,
                local_positions=local_pos, write_index=jnp.zeros((B, T), jnp.int32))
    if page_size:
        Gp = -(-capacity // page_size)
        num_pages = B * Gp
        table = jax.random.permutation(kp, num_pages).astype(jnp.int32).reshape(B, Gp)
        shape = (num_pages, page_size, 2, Hkv, Dh)
        meta.update(page_table=table, page_size=page_size)
    else:
        shape = (B, capacity, 2, Hkv, Dh)
        meta.update(page_table=None)
    q = jax.random.normal(kq, (B, T, Hkv * Gq, Dh), dtype)
    kv = jax.random.normal(kk, shape, dtype)  # keys and values (jspec.cache.kv layout)
    return q, kv, AttnMeta(**meta), lengths


def kernel_fn(window=0, **kw):
    return jax.jit(lambda q, kv, m: da.paged_decode_attention(
        q, kv, m, window=window, scale=Dh ** -0.5, interpret=INTERPRET, **kw))


def reference_fn(window=0):
    return jax.jit(lambda q, kv, m: da.decode_attention_reference(
        q, kv, m, window=window, scale=Dh ** -0.5))


def bench(f, *args, n=20):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), first


def record_error(section, case, e):
    msg = f"{type(e).__name__}: {e}"
    print(f"  ERROR {section} {case}: {msg[:1500]}", flush=True)
    res["errors"].append({"section": section, "case": case, "error": msg[:4000],
                          "trace": traceback.format_exc()[-4000:]})


# --------------------------------------------------------------------------- correctness

CHECKS = [  # name, make_inputs kwargs, window, kernel kwargs
    ("dense T1 S1000", dict(B=2, T=1, ctx=1000), 0, {}),
    ("dense T16 ragged", dict(B=3, T=16, ctx=1024, ragged=True), 0, dict(num_splits=4)),
    ("paged16 T4 ragged", dict(B=4, T=4, ctx=2048, page_size=16, ragged=True), 0, {}),
    ("paged3 T16 Tl24", dict(B=2, T=16, Tl=24, ctx=300, page_size=3, ragged=True), 0, {}),
    ("paged64 T4 window128", dict(B=2, T=4, ctx=1024, page_size=64), 128, {}),
    ("paged1 T1 Gq1 Dh64", dict(B=2, T=1, ctx=100, page_size=1, Gq=1, Dh=64), 0, {}),
    ("dense f32 T4", dict(B=2, T=4, ctx=512, dtype=jnp.float32), 0, {}),
]
print("\n== correctness (relative error vs a float32 reference of the same inputs)", flush=True)
for i, (name, kw, window, kkw) in enumerate(CHECKS):
    try:
        q, kv, meta, _ = make_inputs(jax.random.key(i), **kw)
        d = q.shape[-1]
        f = jax.jit(lambda q, kv, m: da.paged_decode_attention(
            q, kv, m, window=window, scale=d ** -0.5, interpret=INTERPRET, **kkw))
        out = f(q, kv, meta).astype(jnp.float32)
        up = lambda x: x.astype(jnp.float32)
        with jax.default_matmul_precision("highest"):  # no TF32 in the yardstick
            ref32 = da.decode_attention_reference(up(q), up(kv), meta, window=window,
                                                  scale=d ** -0.5)
        ref = da.decode_attention_reference(q, kv, meta, window=window,
                                            scale=d ** -0.5).astype(jnp.float32)
        scale_ = float(jnp.max(jnp.abs(ref32)))
        err = float(jnp.max(jnp.abs(out - ref32))) / scale_
        ref_err = float(jnp.max(jnp.abs(ref - ref32))) / scale_
        tol = 1e-4 if q.dtype == jnp.float32 else 3e-2
        ok = bool(err <= max(tol, 4 * ref_err)) and bool(jnp.all(jnp.isfinite(out)))
        row = dict(name=name, rel_err=err, ref_rel_err=ref_err, ok=ok)
        res["check"].append(row)
        print(f"  {name:24s} kernel {err:.2e}  reference-in-dtype {ref_err:.2e}  "
              f"{'ok' if ok else 'MISMATCH'}", flush=True)
    except Exception as e:  # noqa: BLE001
        record_error("check", name, e)

save()
if os.environ.get("KERNELS_CHECK_ONLY"):
    print("saved", save())
    sys.exit(0)

# --------------------------------------------------------------------------- timing

print("\n== decode timing (Hkv=8, Gq=4 query heads per kv head, H=32, Dh=128, bf16; "
      "median of 20)", flush=True)
hdr = f"  {'cache':8s} {'B':>3s} {'T':>3s} {'ctx':>5s} | {'kernel us':>9s} {'TB/s':>5s} | " \
      f"{'ref us':>8s} {'TB/s':>5s} | {'speedup':>7s} | {'compile s':>9s}"
print(hdr, flush=True)
for ctx in CTXS:
    for B in BATCHES:
        for T in (1, 4, 16):
            for page_size in (0, 16, 64):
                cache = f"paged{page_size}" if page_size else "dense"
                case = dict(cache=cache, B=B, T=T, ctx=ctx)
                if elapsed() > BUDGET_S:
                    res["errors"].append({"section": "bench", "case": case,
                                          "error": "skipped: budget"})
                    continue
                try:
                    q, kv, meta, _ = make_inputs(jax.random.key(B * T + ctx), B=B, T=T, ctx=ctx,
                                                   page_size=page_size)
                    nbytes = 2 * B * ctx * Hkv * Dh * kv.dtype.itemsize + 2 * q.nbytes
                    t_k, c_k = bench(kernel_fn(), q, kv, meta)
                    t_r, c_r = bench(reference_fn(), q, kv, meta)
                    row = dict(case, kernel_us=t_k * 1e6, kernel_TBps=nbytes / t_k / 1e12,
                               ref_us=t_r * 1e6, ref_TBps=nbytes / t_r / 1e12,
                               speedup=t_r / t_k, kernel_first_call_s=c_k, bytes=nbytes)
                    res["bench"].append(row)
                    print(f"  {cache:8s} {B:3d} {T:3d} {ctx:5d} | {t_k * 1e6:9.1f} "
                          f"{row['kernel_TBps']:5.2f} | {t_r * 1e6:8.1f} {row['ref_TBps']:5.2f} | "
                          f"{row['speedup']:7.2f} | {c_k:9.2f}", flush=True)
                    del q, kv, meta
                except Exception as e:  # noqa: BLE001
                    record_error("bench", case, e)

save()

# --------------------------------------------------------------------------- ragged

Bmax = BATCHES[-1]
print(f"\n== ragged lengths (B={Bmax}, T=4, capacity {CAPACITY}, "
      f"lengths uniform in [4, {CAPACITY}])", flush=True)
for page_size in (0, 16):
    case = dict(cache=f"paged{page_size}" if page_size else "dense", B=Bmax, T=4, capacity=CAPACITY)
    if elapsed() > BUDGET_S:
        continue
    try:
        q, kv, meta, lengths = make_inputs(jax.random.key(7), B=Bmax, T=4, ctx=CAPACITY,
                                             page_size=page_size, ragged=True)
        nbytes = 2 * int(lengths.sum()) * Hkv * Dh * 2
        t_k, _ = bench(kernel_fn(), q, kv, meta)
        t_r, _ = bench(reference_fn(), q, kv, meta)
        row = dict(case, kernel_us=t_k * 1e6, kernel_TBps=nbytes / t_k / 1e12, ref_us=t_r * 1e6,
                   speedup=t_r / t_k)
        res["bench"].append(row)
        print(f"  {case['cache']:8s} kernel {t_k * 1e6:8.1f} us ({row['kernel_TBps']:.2f} TB/s of "
              f"live keys)  reference {t_r * 1e6:8.1f} us  speedup {row['speedup']:.2f}",
              flush=True)
    except Exception as e:  # noqa: BLE001
        record_error("ragged", case, e)

save()

# --------------------------------------------------------------------------- tuning sweep

print(f"\n== sweep (paged16, ctx {CAPACITY}): block_k, num_splits, num_warps, num_stages",
      flush=True)
SWEEP = []
for B, T in ((1, 1), (Bmax, 16)):
    for bk, ns, nw, st in ((32, None, 4, 2), (64, None, 4, 3), (64, None, 8, 2), (128, None, 4, 2),
                           (128, None, 8, 2), (64, 1, 4, 2), (64, 16, 4, 2)):
        SWEEP.append((B, T, bk, ns, nw, st))
inputs = {}
for B, T, bk, ns, nw, st in SWEEP:
    case = dict(B=B, T=T, block_k=bk, num_splits=ns, num_warps=nw, num_stages=st)
    if elapsed() > BUDGET_S:
        res["errors"].append({"section": "sweep", "case": case, "error": "skipped: budget"})
        continue
    try:
        if (B, T) not in inputs:
            inputs.clear()
            inputs[(B, T)] = make_inputs(jax.random.key(3), B=B, T=T, ctx=CAPACITY, page_size=16)
        q, kv, meta, _ = inputs[(B, T)]
        nbytes = 2 * B * CAPACITY * Hkv * Dh * 2
        t_k, c_k = bench(kernel_fn(block_k=bk, num_splits=ns, num_warps=nw, num_stages=st),
                         q, kv, meta, n=10)
        row = dict(case, us=t_k * 1e6, TBps=nbytes / t_k / 1e12)
        res["sweep"].append(row)
        print(f"  B={B:2d} T={T:2d} bk={bk:3d} splits={str(ns):4s} warps={nw} stages={st}: "
              f"{t_k * 1e6:8.1f} us {row['TBps']:5.2f} TB/s", flush=True)
    except Exception as e:  # noqa: BLE001
        record_error("sweep", case, e)

path = save()
print(f"\n{len(res['errors'])} errors/skips; {res['total_s']:.0f} s; wrote {path}", flush=True)
