"""One-off probe of the H200 machine: versions, copy bandwidth, Pallas backends, and a
Llama-3.1-8B-shaped decode step in plain XLA (unrolled layers), standalone and in a loop."""
import functools, json, os, sys, time
import jax, jax.numpy as jnp
import numpy as np

out = os.environ.get("OUT", "/tmp")
res = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
print(res, flush=True)

def bench(f, *args, n=20):
    r = f(*args); jax.block_until_ready(r)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); r = f(*args); jax.block_until_ready(r); ts.append(time.perf_counter() - t)
    return float(np.median(ts))

# copy bandwidth
x = jnp.ones((1024, 1024, 1024), jnp.bfloat16)  # 2 GiB
t = bench(jax.jit(lambda a: a * 1.5), x)
res["copy_TBps"] = 2 * x.nbytes / t / 1e12
print("copy TB/s", res["copy_TBps"], flush=True)
del x

# Pallas triton smoke
try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt
    def k(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0
    y = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((256,), jnp.float32),
                       compiler_params=plt.CompilerParams(num_warps=4))(jnp.arange(256, dtype=jnp.float32))
    res["pallas_triton"] = bool(jnp.allclose(y, 2 * jnp.arange(256)))
except Exception as e:
    res["pallas_triton"] = repr(e)[:500]
print("triton", res["pallas_triton"], flush=True)
try:
    from jax.experimental.pallas.ops.gpu import decode_attention as da
    B, H, S, D = 32, 32, 1024, 128
    q = jax.random.normal(jax.random.key(0), (B, H, D), jnp.bfloat16)
    kk = jax.random.normal(jax.random.key(1), (B, S, 8, D), jnp.bfloat16)
    vv = jax.random.normal(jax.random.key(2), (B, S, 8, D), jnp.bfloat16)
    f = jax.jit(functools.partial(da.gqa, k_splits=16))
    o = f(q, kk, vv)
    ref = da.gqa_reference(q, kk, vv)
    err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))))
    t = bench(f, q, kk, vv)
    res["stock_gqa_decode"] = {"err": err, "ms": t * 1e3, "TBps": 2 * kk.nbytes / t / 1e12}
    t = bench(jax.jit(da.gqa_reference), q, kk, vv)
    res["stock_gqa_reference_ms"] = t * 1e3
except Exception as e:
    res["stock_gqa_decode"] = repr(e)[:800]
print("gqa", res.get("stock_gqa_decode"), res.get("stock_gqa_reference_ms"), flush=True)
try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    res["mosaic_gpu_import"] = True
except Exception as e:
    res["mosaic_gpu_import"] = repr(e)[:300]

# 8B-shaped decode step
D, F, L, H, Hkv, Dh, V = 4096, 14336, 32, 32, 8, 128, 128256
dt = jnp.bfloat16
def init(key):
    ks = jax.random.split(key, 4 * L + 2)
    layers = []
    for i in range(L):
        layers.append(dict(
            qkv=jax.random.normal(ks[4*i], (D, (H + 2*Hkv) * Dh), dt) * 0.02,
            o=jax.random.normal(ks[4*i+1], (H * Dh, D), dt) * 0.02,
            gu=jax.random.normal(ks[4*i+2], (D, 2 * F), dt) * 0.02,
            down=jax.random.normal(ks[4*i+3], (F, D), dt) * 0.02,
            n1=jnp.ones((D,), dt), n2=jnp.ones((D,), dt)))
    return dict(layers=layers, emb=jax.random.normal(ks[-2], (V, D), dt) * 0.02,
                head=jax.random.normal(ks[-1], (D, V), dt) * 0.02, norm=jnp.ones((D,), dt))
w = jax.jit(init)(jax.random.key(0))
nbytes = sum(a.nbytes for a in jax.tree.leaves(w)) - w["emb"].nbytes
res["weight_bytes_read"] = nbytes

def rms(x, g):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)).astype(dt) * g

def step(w, kc, vc, tok, pos):
    B = tok.shape[0]
    x = w["emb"][tok]  # [B, D]
    S = kc[0].shape[1]
    for i, lw in enumerate(w["layers"]):
        h = rms(x, lw["n1"])
        qkv = h @ lw["qkv"]
        q = qkv[:, :H*Dh].reshape(B, Hkv, H // Hkv, Dh)
        k = qkv[:, H*Dh:(H+Hkv)*Dh].reshape(B, Hkv, Dh)
        v = qkv[:, (H+Hkv)*Dh:].reshape(B, Hkv, Dh)
        kci = jax.lax.dynamic_update_slice(kc[i], k[:, None].astype(dt), (0, pos, 0, 0))
        vci = jax.lax.dynamic_update_slice(vc[i], v[:, None].astype(dt), (0, pos, 0, 0))
        kc[i], vc[i] = kci, vci
        s = jnp.einsum("bkgd,bskd->bkgs", q, kci, preferred_element_type=jnp.float32) / np.sqrt(Dh)
        s = jnp.where(jnp.arange(S) <= pos, s, -1e30)
        p = jax.nn.softmax(s, -1).astype(dt)
        a = jnp.einsum("bkgs,bskd->bkgd", p, vci).reshape(B, H * Dh)
        x = x + a @ lw["o"]
        h = rms(x, lw["n2"])
        gu = h @ lw["gu"]
        x = x + (jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ lw["down"]
    logits = rms(x, w["norm"]) @ w["head"]
    return jnp.argmax(logits, -1).astype(jnp.int32), kc, vc

for B in (1, 32):
    S = 1024 + 64
    kc = [jnp.zeros((B, S, Hkv, Dh), dt) for _ in range(L)]
    vc = [jnp.zeros((B, S, Hkv, Dh), dt) for _ in range(L)]
    tok = jnp.zeros((B,), jnp.int32)
    f1 = jax.jit(step, donate_argnums=(1, 2))
    # single step timing
    tok, kc, vc = f1(w, kc, vc, tok, jnp.int32(1024)); jax.block_until_ready(tok)
    ts = []
    for it in range(20):
        t = time.perf_counter(); tok, kc, vc = f1(w, kc, vc, tok, jnp.int32(1024)); jax.block_until_ready(tok); ts.append(time.perf_counter() - t)
    single = float(np.median(ts))
    kv_bytes = 2 * L * B * 1024 * Hkv * Dh * 2
    # loop timing
    def loop(w, kc, vc, tok, n):
        def body(c):
            i, tok, kc, vc = c
            tok, kc, vc = step(w, kc, vc, tok, 1024 + (i % 32))
            return i + 1, tok, kc, vc
        return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), tok, kc, vc))
    fl = jax.jit(loop, donate_argnums=(1, 2))
    r = fl(w, kc, vc, tok, jnp.int32(2)); jax.block_until_ready(r); _, tok, kc, vc = r
    t = time.perf_counter(); r = fl(w, kc, vc, tok, jnp.int32(64)); jax.block_until_ready(r); t64 = time.perf_counter() - t; _, tok, kc, vc = r
    t = time.perf_counter(); r = fl(w, kc, vc, tok, jnp.int32(8)); jax.block_until_ready(r); t8 = time.perf_counter() - t; _, tok, kc, vc = r
    per = (t64 - t8) / 56
    res[f"b{B}"] = {"single_ms": single * 1e3, "loop_ms": per * 1e3,
                    "single_TBps": (nbytes + kv_bytes) / single / 1e12,
                    "loop_TBps": (nbytes + kv_bytes) / per / 1e12}
    print(B, res[f"b{B}"], flush=True)
    del kc, vc
json.dump(res, open(f"{out}/probe.json", "w"), indent=1)
print(json.dumps(res, indent=1))
