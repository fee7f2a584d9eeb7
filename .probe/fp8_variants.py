"""Probe: which FP8 product kernel structure reaches the H200's bandwidth at decode rows."""
import functools, json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
sys.path.insert(0, '.')
from jspec.kernels.tiling import in_order_sum
from jspec.kernels.fp8 import matmul as fm
from jspec.quantization import GROUP, quantize_kernel
from benchmarks.common import best_call_time, env_info, save_json

GPU = jax.default_backend() == "gpu"


def quantize_rows(x):
    M, K = x.shape
    g = x.astype(jnp.float32).reshape(M, K // GROUP, GROUP)
    s = jnp.maximum(jnp.abs(g).max(-1), 1e-10) / 448.0
    return (g / s[..., None]).astype(jnp.float8_e4m3fn).reshape(M, K), s


def tc_kernel(*refs, BM, BN, steps, rows, mode, evict, per=1):
    if mode == "w8a8":
        x_ref, xs_ref, w_ref, s_ref, o_ref = refs
    else:
        x_ref, w_ref, s_ref, o_ref = refs
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = i * BM, j * BN
    real = m0 + lax.broadcasted_iota(jnp.int32, (BM, 1), 0) < rows
    realx = jnp.broadcast_to(real, (BM, GROUP))

    def one(g, acc):
        k0 = pl.multiple_of(g * GROUP, GROUP)
        if mode == "w8a8":  # FP8 rows: no mask (the padding rows are zeros in memory)
            xv = x_ref[pl.ds(m0, BM), pl.ds(k0, GROUP)]
        else:
            xv = plt.load(x_ref.at[pl.ds(m0, BM), pl.ds(k0, GROUP)], mask=realx, other=0)
        wv = plt.load(w_ref.at[pl.ds(k0, GROUP), pl.ds(n0, BN)], eviction_policy="evict_first" if evict else None)
        if mode == "bf16":
            wv = wv.astype(xv.dtype)
        elif mode == "f16":
            xv, wv = xv.astype(jnp.float16), wv.astype(jnp.float16)
        part = lax.dot_general(xv, wv, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        part = part * s_ref[g, pl.ds(n0, BN)][None, :]
        if mode == "w8a8":
            xs = xs_ref[pl.ds(m0, BM), g]
            part = part * xs[:, None]
        return acc + part

    def step(t, acc):
        for u in range(per):
            acc = one(s * steps + t * per + u, acc)
        return acc

    acc = lax.fori_loop(0, steps // per, step, jnp.zeros((BM, BN), jnp.float32))
    plt.store(o_ref.at[s, pl.ds(m0, BM), pl.ds(n0, BN)], acc, mask=jnp.broadcast_to(real, (BM, BN)))


def cc_kernel(x_ref, w_ref, s_ref, o_ref, *, BN, BK, steps, rows, via16=False):
    """CUDA cores, any few rows: acc [rows, BK, BN] elementwise, one reduction at the end."""
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = j * BN
    sub = GROUP // BK

    def step(t, acc):
        g = s * steps + t
        sc = s_ref[g, pl.ds(n0, BN)][None, :]
        for u in range(sub):
            k0 = pl.multiple_of(g * GROUP + u * BK, BK)
            w = plt.load(w_ref.at[pl.ds(k0, BK), pl.ds(n0, BN)], eviction_policy="evict_first")
            w = (w.astype(jnp.float16) if via16 else w).astype(jnp.float32) * sc
            acc = tuple(a + x_ref[r, pl.ds(k0, BK)].astype(jnp.float32)[:, None] * w for r, a in enumerate(acc))
        return acc

    zero = tuple(jnp.zeros((BK, BN), jnp.float32) for _ in range(rows))
    acc = lax.fori_loop(0, steps, step, zero)
    for r in range(rows):
        o_ref[s, r, pl.ds(n0, BN)] = jnp.sum(acc[r], axis=0)


def splits(G, programs, target):
    want = max(1, min(-(-target // programs), G // 2))
    return max(d for d in range(1, want + 1) if G % d == 0)


def tc(x, w, sc, *, BN=128, warps=4, stages=3, target=528, mode="bf16", evict=True, per=1, bm=None):
    M, K = x.shape
    N = w.shape[1]
    BM = bm or min(max(16, 1 << (M - 1).bit_length()), 64)
    Mp = -(-M // BM) * BM
    G = K // GROUP
    S = splits(G, (Mp // BM) * (N // BN), target)
    if (G // S) % per:
        raise ValueError("steps not a multiple of per")
    if mode == "w8a8":
        xq, xs = quantize_rows(x)
        args = (jnp.pad(xq, ((0, Mp - M), (0, 0))), jnp.pad(xs, ((0, Mp - M), (0, 0))), w, sc)
    else:
        args = (jnp.pad(x, ((0, Mp - M), (0, 0))), w, sc)
    params = plt.CompilerParams(num_warps=warps, num_stages=stages) if GPU else None
    parts = pl.pallas_call(
        functools.partial(tc_kernel, BM=BM, BN=BN, steps=G // S, rows=M, mode=mode, evict=evict, per=per),
        grid=(Mp // BM, N // BN, S), in_specs=[pl.BlockSpec()] * len(args), out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((S, Mp, N), jnp.float32), interpret=not GPU, compiler_params=params,
    )(*args)
    return in_order_sum(parts[:, :M]).astype(x.dtype)


def cc(x, w, sc, *, BN=256, BK=32, warps=4, stages=3, target=528, via16=False):
    M, K = x.shape
    N = w.shape[1]
    G = K // GROUP
    S = splits(G, N // BN, target)
    params = plt.CompilerParams(num_warps=warps, num_stages=stages) if GPU else None
    parts = pl.pallas_call(
        functools.partial(cc_kernel, BN=BN, BK=BK, steps=G // S, rows=M, via16=via16),
        grid=(N // BN, S), in_specs=[pl.BlockSpec()] * 3, out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((S, M, N), jnp.float32), interpret=not GPU, compiler_params=params,
    )(x, w, sc)
    return in_order_sum(parts).astype(x.dtype)


def variants(rows):
    v = {"bf16": None, "jspec": lambda x, q, s: fm.fp8_matmul(x, q, s)}
    v["tc_f16_128_4_3"] = functools.partial(tc, BN=128, warps=4, stages=3, mode="f16")
    for bn, wp, st in ((128, 4, 3), (128, 8, 3), (256, 8, 3), (64, 4, 4), (128, 4, 5)):
        v[f"tc_w8a8_{bn}_{wp}_{st}"] = functools.partial(tc, BN=bn, warps=wp, stages=st, mode="w8a8")
    v["tc_w8a8_128_4_3_bm64"] = functools.partial(tc, BN=128, warps=4, stages=3, mode="w8a8", bm=64)
    v["tc_w8a8_128_4_3_per2_t264"] = functools.partial(tc, BN=128, warps=4, stages=3, mode="w8a8", per=2, target=264)
    if rows <= 4:
        v["cc_256_32_4_3"] = functools.partial(cc, BN=256, BK=32, warps=4, stages=3)
        v["cc16_256_32_4_3"] = functools.partial(cc, BN=256, BK=32, warps=4, stages=3, via16=True)
        v["cc16_256_32_8_4"] = functools.partial(cc, BN=256, BK=32, warps=8, stages=4, via16=True)
    return v


def main():
    tiny = not GPU
    shapes = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672), "down_proj": (14336, 4096)}
    rows_list = [1, 4, 16, 32] if GPU else [1, 3]
    if GPU:
        shapes = {k: shapes[k] for k in ("gate_up_proj", "down_proj", "qkv_proj")}
    copies = 6 if GPU else 1
    key = jax.random.key(0)
    res = {"env": env_info(), "rows": []}
    print(res["env"], flush=True)
    for name, (K, N) in shapes.items():
        if tiny:
            K, N = K // 16, N // 16
        ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02 for i in range(copies)]
        qs = [jax.jit(quantize_kernel)(w) for w in ws]
        for rows in rows_list:
            x = jax.random.normal(jax.random.fold_in(key, 99), (rows, K), jnp.bfloat16)
            row = {"product": name, "rows": rows, "K": K, "N": N}
            ref = None
            for vname, fn in variants(rows).items():
                if fn is None:
                    many = lambda x, ws, qs: tuple(jnp.dot(x, w) for w in ws)
                else:
                    many = lambda x, ws, qs, fn=fn: tuple(fn(x, q, s) for q, s in qs)
                try:
                    t, outs = best_call_time(jax.jit(many), x, ws, qs, calls=20 if GPU else 1)
                except Exception as e:  # noqa: BLE001
                    row[vname] = repr(e)[:200]
                    print(name, rows, vname, repr(e)[:300], flush=True)
                    continue
                row[vname] = round(t / copies * 1e6, 2)
                if fn is not None and vname == "jspec":
                    ref = np.asarray(outs[0], np.float32)
                elif ref is not None:
                    err = float(np.abs(np.asarray(outs[0], np.float32) - ref).max() / np.abs(ref).max())
                    row[vname + "_err"] = round(err, 4)
            fp8_bytes = K * N
            best = min((k for k in row if isinstance(row[k], float) and not k.endswith("_err")), key=row.get)
            row["best"] = best
            row["best_TBps"] = round(fp8_bytes / (row[best] * 1e-6) / 1e12, 2)
            row["bf16_TBps"] = round(2 * fp8_bytes / (row["bf16"] * 1e-6) / 1e12, 2)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            save_json("fp8_variants.json", res)


if __name__ == "__main__":
    main()
