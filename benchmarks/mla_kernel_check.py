"""The Pallas MLA decode/verify kernel (jspec.kernels.mla_decode) on one GPU: correctness
against the reference, then a timing table against the reference (XLA einsums) for
DeepSeek shapes (Dc=512, Dr=64, bf16, dense cache, T=1 unless --T), optionally with other
kernel tile configurations side by side (--configs).

    PYTHONPATH=. python3 benchmarks/mla_kernel_check.py --check   # correctness only (asserts)
    PYTHONPATH=. python3 benchmarks/mla_kernel_check.py           # timing table
    PYTHONPATH=. python3 benchmarks/mla_kernel_check.py --configs 16/4/64/2,64/8/64/2
    PYTHONPATH=. python3 benchmarks/mla_kernel_check.py --smoke --check --table  # CPU, tiny

Times are device times: a jitted loop runs --loop calls back to back (each call's queries
pass through an optimization barrier with the previous output, so nothing is hoisted),
and the median over --reps runs of the loop is divided by --loop. The table also checks
every configuration against the reference (bf16 reference on GPU; max relative error).
Every case runs in its own try/except and no new case starts after --budget seconds.
Results also go to $OUT/mla_kernel_check.json (OUT defaults to /tmp).
"""
from __future__ import annotations

import argparse
import functools
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
from jspec.kernels import mla_decode as md  # noqa: E402

DC, DR = 512, 64
T0 = time.perf_counter()


def elapsed():
    return time.perf_counter() - T0


def make_inputs(key, **kw):
    """q_lat, q_pe, latent buffer, meta, lengths (see `_make_inputs`), made by one program."""
    return jax.jit(functools.partial(_make_inputs, **kw))(key)


def _make_inputs(key, *, B, T, H, ctx, page_size=0, dtype=jnp.bfloat16, Tl=None, ragged=False,
                 tree=False, Dc=DC, Dr=DR):
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
        local = jnp.asarray(anc)
        local_pos = prefix[:, None] + jnp.asarray(depth)[None]
    else:
        local = jnp.tril(jnp.ones((Tl, Tl), bool))
        local_pos = prefix[:, None] + jnp.arange(Tl, dtype=jnp.int32)[None]
    meta = dict(positions=local_pos[:, Tl - T:], prefix_len=prefix,
                local_mask=jnp.broadcast_to(local[Tl - T:], (B, T, Tl)),
                local_positions=local_pos, write_index=jnp.zeros((B, T), jnp.int32))
    if page_size:
        Gp = -(-ctx // page_size)
        num_pages = B * Gp
        table = jax.random.permutation(kp, num_pages).astype(jnp.int32).reshape(B, Gp)
        shape = (num_pages + 1, page_size, Dc + Dr)  # + the trash page
        meta.update(page_table=table, page_size=page_size)
    else:
        shape = (B, ctx, Dc + Dr)
        meta.update(page_table=None)
    q_lat = jax.random.normal(kq, (B, T, H, Dc), dtype)
    q_pe = jax.random.normal(kr, (B, T, H, Dr), dtype)
    buf = jax.random.normal(kc, shape, dtype)
    return q_lat, q_pe, buf, AttnMeta(**meta), lengths


def kernel_fn(interpret, **kw):
    return jax.jit(lambda q, r, c, m: md.paged_mla_attention(
        q, r, c, m, scale=(DC + DR) ** -0.5, interpret=interpret, **kw))


def reference_fn():
    return jax.jit(lambda q, r, c, m: md.mla_decode_reference(q, r, c, m, scale=(DC + DR) ** -0.5))


def device_time(f, args, loop: int, reps: int):
    """(seconds per call of f(*args), its output): median over `reps` runs of a jitted loop
    of `loop` calls, divided by `loop`."""
    q, rest = args[0], args[1:]
    out0 = jax.eval_shape(f, *args)

    @jax.jit
    def looped(q, *rest):
        def body(_, carry):
            q, o = jax.lax.optimization_barrier(carry)  # q now depends on the last call
            return q, f(q, *rest)
        return jax.lax.fori_loop(0, loop, body, (q, jnp.zeros(out0.shape, out0.dtype)))[1]

    out = jax.block_until_ready(looped(q, *rest))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(looped(q, *rest))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / loop, out


def _parse_config(text: str) -> dict:
    """"block_rows/num_warps/block_k/num_stages[/num_splits]" -> paged_mla_attention kwargs."""
    vals = [int(v) for v in text.strip().split("/")]
    keys = ("block_rows", "num_warps", "block_k", "num_stages", "num_splits")
    if not 4 <= len(vals) <= 5:
        raise ValueError(f"config {text!r}: want block_rows/num_warps/block_k/num_stages[/num_splits]")
    return dict(zip(keys, vals))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="correctness section; exit 1 on a mismatch")
    ap.add_argument("--table", action="store_true", help="timing table (default without --check)")
    ap.add_argument("--configs", default="", help="more kernel configs for the table, comma-separated "
                    "block_rows/num_warps/block_k/num_stages[/num_splits]")
    ap.add_argument("--ctx", default="1024,4096,16384,32768", type=lambda v: [int(x) for x in v.split(",")],
                    help="table contexts")
    ap.add_argument("--tree-rows", action="store_true", help="add T=16 (tree) rows at B=1, ctx 4096")
    ap.add_argument("--loop", type=int, default=20, help="calls per timed loop")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (off GPU)")
    ap.add_argument("--T", type=int, default=1, help="query tokens per row in the table")
    ap.add_argument("--page-size", type=int, default=0, help="table cache: 0 dense, else paged")
    ap.add_argument("--reps", type=int, default=5, help="timed runs of the loop")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; no new case after")
    args = ap.parse_args()
    if not (args.check or args.table):
        args.table = True
    smoke, interpret = args.smoke, args.smoke
    res = {"jax": jax.__version__, "backend": jax.default_backend(),
           "devices": [str(d) for d in jax.devices()], "date": time.strftime("%Y-%m-%d"),
           "argv": sys.argv[1:], "check": [], "table": [], "errors": []}
    print(json.dumps({k: res[k] for k in ("jax", "backend", "devices", "date")}), flush=True)

    def record_error(section, case, e):
        msg = f"{type(e).__name__}: {e}"
        print(f"  ERROR {section} {case}: {msg[:1500]}", flush=True)
        res["errors"].append({"section": section, "case": str(case), "error": msg[:4000],
                              "trace": traceback.format_exc()[-3000:]})

    def save():
        res["total_s"] = elapsed()
        out = os.environ.get("OUT", "/tmp")
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "mla_kernel_check.json")
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
        return path

    dims = dict(Dc=32, Dr=16, dtype=jnp.float32) if smoke else {}  # XLA:CPU: no bf16 reference
    scale_ctx = (lambda c: max(16, c // 64)) if smoke else (lambda c: c)

    # ----------------------------------------------------------------------- correctness
    ok_all = True
    if args.check:
        checks = [  # name, make_inputs kwargs, kernel kwargs
            ("dense T1 H16 B2", dict(B=2, T=1, H=16, ctx=1000), {}),
            ("dense T1 H128 B3 ragged", dict(B=3, T=1, H=128, ctx=4096, ragged=True), {}),
            ("paged16 T4 H16 tree ragged", dict(B=4, T=4, H=16, ctx=2048, page_size=16, ragged=True,
                                                tree=True), {}),
            ("paged1 T3 Tl7 H16 tree", dict(B=2, T=3, Tl=7, H=16, ctx=300, page_size=1, ragged=True,
                                            tree=True), dict(num_splits=3)),
            ("paged64 T16 H128 tree", dict(B=2, T=16, H=128, ctx=1024, page_size=64, tree=True,
                                           ragged=True), {}),
            ("dense T5 H16 splits1", dict(B=2, T=5, H=16, ctx=700, ragged=True), dict(num_splits=1)),
            ("dense T2 H128 rows64", dict(B=1, T=2, H=128, ctx=3000), dict(block_rows=64)),
            ("dense f32 T4 H16", dict(B=2, T=4, H=16, ctx=512, dtype=jnp.float32, tree=True), {}),
        ]
        print("\n== correctness (relative error vs a float32 reference of the same inputs)", flush=True)
        for i, (name, kw, kkw) in enumerate(checks):
            try:
                kw = dict(kw, ctx=scale_ctx(kw["ctx"]), **dims)
                q, r, c, meta, _ = make_inputs(jax.random.key(i), **kw)
                s = (q.shape[-1] + r.shape[-1]) ** -0.5
                out = jax.jit(lambda q, r, c, m: md.paged_mla_attention(
                    q, r, c, m, scale=s, interpret=interpret, **kkw))(q, r, c, meta)
                up = lambda x: x.astype(jnp.float32)
                with jax.default_matmul_precision("highest"):  # no TF32 in the yardstick
                    ref32 = md.mla_decode_reference(up(q), up(r), up(c), meta, scale=s)
                ref = md.mla_decode_reference(q, r, c, meta, scale=s) if not smoke else ref32
                mag = float(jnp.max(jnp.abs(ref32)))
                err = float(jnp.max(jnp.abs(out - ref32))) / mag
                ref_err = float(jnp.max(jnp.abs(ref - ref32))) / mag
                tol = 1e-4 if q.dtype == jnp.float32 else 2e-2
                ok = (out.dtype == jnp.float32 and out.shape == q.shape
                      and bool(err <= max(tol, 4 * ref_err)) and bool(jnp.all(jnp.isfinite(out))))
                ok_all &= ok
                res["check"].append(dict(name=name, rel_err=err, ref_rel_err=ref_err, ok=ok))
                print(f"  {name:28s} kernel {err:.2e}  reference-in-dtype {ref_err:.2e}  "
                      f"{'ok' if ok else 'MISMATCH'}", flush=True)
            except Exception as e:  # noqa: BLE001
                ok_all = False
                record_error("check", name, e)
        save()

    # ----------------------------------------------------------------------- table
    if args.table:
        cache = f"paged{args.page_size}" if args.page_size else "dense"
        configs = [None] + [_parse_config(c) for c in args.configs.split(",") if c.strip()]
        names = ["default"] + [c.strip() for c in args.configs.split(",") if c.strip()]
        print(f"\n== timing ({cache}, T={args.T} (tree rows: T=16), Dc={DC}, Dr={DR}, bf16; us per call, device time: "
              f"median over {args.reps} runs of a jitted loop of {args.loop} calls)", flush=True)
        print("   kernel configs: " + ", ".join(
            f"k{i}={n}" for i, n in enumerate(names)) + " (block_rows/num_warps/block_k/num_stages"
              "[/num_splits]); TB/s: cache bytes / time of k0; TF/s: 2*B*T*H*ctx*(2*Dc+Dr) / time "
              "of k0; err: max |k - ref| / max |ref| over all configs", flush=True)
        print(f"  {'T':>2s} {'B':>3s} {'H':>4s} {'ctx':>6s} | "
              + " ".join(f"{'k%d us' % i:>8s}" for i in range(len(configs)))
              + f" | {'TB/s':>5s} {'TF/s':>6s} | {'ref us':>8s} {'TB/s':>5s} | {'speedup':>7s} | {'err':>7s} | "
              f"{'t s':>4s}", flush=True)
        rows = [(args.T, ctx, B, H) for ctx in args.ctx for B in (1, 32) for H in (16, 128)]
        if args.tree_rows:  # verification of a 16-node tree at batch 1 (first: rows past the budget drop)
            rows = [(16, 4096, 1, 16), (16, 4096, 1, 128)] + rows
        for T, ctx, B, H in rows:
            c_ = scale_ctx(ctx)
            case = dict(cache=cache, B=B, T=T, H=H, ctx=c_)
            if elapsed() > args.budget:
                res["errors"].append({"section": "table", "case": str(case), "error": "skipped: budget"})
                continue
            try:
                q, r, c, meta, _ = make_inputs(jax.random.key(B + H + c_), B=B, T=T, H=H,
                                               ctx=c_, page_size=args.page_size, tree=T > 1,
                                               **dims)
                nbytes = B * c_ * c.shape[-1] * c.dtype.itemsize
                flops = 2 * B * T * H * c_ * (2 * q.shape[-1] + r.shape[-1])
                t_r, ref = device_time(reference_fn(), (q, r, c, meta), args.loop, args.reps)
                mag = float(jnp.max(jnp.abs(ref)))
                row = dict(case, ref_us=t_r * 1e6, ref_TBps=nbytes / t_r / 1e12, kernels=[])
                err = 0.0
                for name, cfg in zip(names, configs):
                    try:
                        t_k, out = device_time(kernel_fn(interpret, **(cfg or {})), (q, r, c, meta),
                                               args.loop, args.reps)
                        e = float(jnp.max(jnp.abs(out - ref))) / mag
                        err = max(err, e)
                        row["kernels"].append(dict(config=name, us=t_k * 1e6, rel_err=e))
                    except Exception as e:  # noqa: BLE001
                        record_error("table", dict(case, config=name), e)
                        row["kernels"].append(dict(config=name, us=float("nan")))
                t_k = row["kernels"][0]["us"] * 1e-6
                row.update(kernel_us=t_k * 1e6, kernel_TBps=nbytes / t_k / 1e12,
                           kernel_TFps=flops / t_k / 1e12, speedup=t_r / t_k, max_rel_err=err)
                ok_all &= bool(err < 3e-2)
                res["table"].append(row)
                print(f"  {T:2d} {B:3d} {H:4d} {c_:6d} | " + " ".join(f"{k['us']:8.1f}" for k in row["kernels"])
                      + f" | {row['kernel_TBps']:5.2f} {row['kernel_TFps']:6.1f} | {t_r * 1e6:8.1f} "
                      f"{row['ref_TBps']:5.2f} | {row['speedup']:7.2f} | {err:7.1e} | {elapsed():4.0f}",
                      flush=True)
                del q, r, c, meta, ref
            except Exception as e:  # noqa: BLE001
                record_error("table", case, e)
        save()

    path = save()
    print(f"\n{len(res['errors'])} errors/skips; {res['total_s']:.0f} s; wrote {path}", flush=True)
    if args.check and not ok_all:
        sys.exit(1)


if __name__ == "__main__":
    main()
