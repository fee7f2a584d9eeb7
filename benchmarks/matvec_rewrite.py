"""One-row products [1, K] x [K, N] (bf16, weights [in, out]) on a GPU, chained over 16
distinct matrices in one program: XLA as it is against the row padded to two rows.

XLA's GPU compiler rewrites a one-row product whose operands hold fewer than 10M elements
(`IsMatrixMultiplicationTooSmallForRewriting`) as a multiply plus a reduction; with two
rows it stays a matrix product. Prints wall-clock us per product (launch included), the
kind of kernel the compiled program holds and the error against float32.

Run: PYTHONPATH=. python3 benchmarks/matvec_rewrite.py   (output: results/matvec_rewrite_h200.txt)
"""
import re, time
import jax, jax.numpy as jnp, numpy as np

SHAPES = [(2048, 3072), (2048, 2048), (2816, 2048), (2048, 576), (2048, 4096), (2048, 64), (512, 2048), (4096, 4096)]
R = 16

def plain(x, w):
    return jnp.dot(x, w)

def pad_zero(x, w):
    return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w)[:1]

def pad_half(x, w):
    return jnp.dot(jnp.concatenate([x, x * 0.5]), w)[:1]

def chain(fn):
    def f(x, ws):
        outs = []
        for i in range(R):
            outs.append(fn(x, ws[i]))
        return jnp.concatenate(outs, axis=1)
    return jax.jit(f)

for K, N in SHAPES:
    ws = [jax.random.normal(jax.random.key(i), (K, N), jnp.bfloat16) for i in range(R)]
    x = jax.random.normal(jax.random.key(99), (1, K), jnp.bfloat16)
    ref = None
    row = []
    for name, fn in (("plain", plain), ("pad_zero", pad_zero), ("pad_half", pad_half)):
        c = chain(fn).lower(x, ws).compile()
        txt = c.as_text()
        kinds = "gemm" if re.search(r"gemm_fusion|__cublas|triton_gemm", txt) else "reduce"
        y = np.asarray(c(x, ws), np.float32)
        if ref is None:
            ref = np.asarray(jnp.concatenate([jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)) for w in ws], 1))
        err = float(np.abs(y - ref).max() / np.abs(ref).max())
        for _ in range(3):
            c(x, ws).block_until_ready()
        ts = []
        for _ in range(20):
            t = time.perf_counter(); c(x, ws).block_until_ready(); ts.append(time.perf_counter() - t)
        us = np.median(ts) / R * 1e6
        row.append(f"{name} {us:6.1f} us ({K*N*2/us/1e6:4.2f} TB/s, {kinds}, err {err:.1e})")
    print(f"K={K:5d} N={N:5d}: " + " | ".join(row), flush=True)
