"""Dependent one-row products as hand-written CUDA kernels with and without programmatic
dependent launch (PDL), inside one XLA FFI call: what a hand-written per-layer kernel
sequence could gain over XLA's products for DeepSeek's batch-1 step.

`benchmarks/cuda_pdl_chain.cu` (built here with nvcc) runs L dependent products
y = W[l] y as L kernels launched in one FFI call; with `pdl` each kernel loads its first
weights, then waits for its predecessor. Cases: K x K bf16 weights (K = 1024, 1536, 2048:
2.1, 4.7, 8.4 MB each; L of them exceed L2), each product shape of a DeepSeek-V2-Lite MoE
layer at batch 1 repeated, and the products of two such layers in order (`V2LITE_LAYER`,
166 MB a layer: every weight the layer reads but the latent cache). Beside it, in the
same process: the same chain as XLA products (each one-row product padded to two rows as
`models.llama.pad_one_row` does).
All compiled with DeepSeek's command buffers (the FFI call is captured into the graph) and
without. Checked against a float32 chain in numpy.

Needs nvcc (CUDA 12.4+) and a Hopper GPU.
Run: PYTHONPATH=. python3 benchmarks/cuda_pdl_chain.py   (result $OUT/cuda_pdl_chain.json)
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import best_call_time, env_info, save_json
from jspec.models.deepseek import GPU_XLA_OPTIONS

NAME = "jspec_pdl_chain"


def build_and_register() -> None:
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_pdl_chain.cu")
    lib = "/tmp/jspec_cuda_pdl_chain.so"
    nvcc = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")
    cmd = [nvcc, "-O3", "-std=c++17", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-I", jax.ffi.include_dir(),
           src, "-o", lib]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed:\n{done.stderr[-3000:]}")
    handler = ctypes.cdll.LoadLibrary(lib).JspecPdlChain
    jax.ffi.register_ffi_target(NAME, jax.ffi.pycapsule(handler), platform="CUDA")


def cuda_chain(x, w_flat, *, shapes, pdl: bool):
    """shapes: the products' [out, in], in order; w_flat: their bf16 weights, packed."""
    ns = np.array([n for n, _ in shapes], np.int64)
    ks = np.array([k for _, k in shapes], np.int64)
    y, _ = jax.ffi.ffi_call(NAME, (jax.ShapeDtypeStruct((int(ns[-1]),), jnp.float32),
                                   jax.ShapeDtypeStruct((2 * int(ns.max()),), jnp.float32)))(
        x, w_flat, ns=ns, ks=ks, pdl=np.int32(pdl))
    return y


def fit(v, k):
    """v cut or zero-padded to length k (a product's input from the previous output)."""
    return v[..., :k] if v.shape[-1] >= k else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, k - v.shape[-1])])


def xla_chain(x, ws):
    """ws: the products' weights ([out, in]); each product padded to two rows."""
    rows = jnp.zeros((2, x.shape[0]), jnp.float32).at[0].set(x)
    for wl in ws:
        rows = jnp.dot(fit(rows, wl.shape[1]).astype(jnp.bfloat16), wl.T, preferred_element_type=jnp.float32)
    return rows[0]


def reference(x, ws):
    for wl in ws:
        wl = np.asarray(wl.astype(jnp.float32))
        x = wl @ np.asarray(fit(jnp.asarray(x), wl.shape[1]))
    return x


# The weights one DeepSeek-V2-Lite MoE layer reads at batch 1, as products [out, in]: the
# query and latent projections, W_UK's and W_UV's bytes, the output projection, the
# router, the 8 experts' first products as one (8 x 2816 rows), their second products as
# one (each row reads its 8 experts' 1408 inputs).
V2LITE_LAYER = ((3648, 2048), (2048, 512), (2048, 512), (2048, 2048), (64, 2048), (8 * 2816, 2048), (2048, 8 * 1408))


def cases():
    """(name, the products' shapes, how many layers or products the time is divided by)"""
    for k in (1024, 1536, 2048):
        count = max(16, (160 << 20) // (2 * k * k))
        yield f"square_{k}", ((k, k),) * count, count
    for n, k in sorted(set(V2LITE_LAYER)):
        count = min(80, max(2, (160 << 20) // (2 * n * k)))
        yield f"product_{n}x{k}", ((n, k),) * count, count
    yield "v2lite_layer", V2LITE_LAYER * 2, 2


def main():
    build_and_register()
    res = {"env": env_info(), "rows": []}
    for name, shapes, layers in cases():
        key = jax.random.key(len(shapes))
        widths = [min(k, n_in) for (_, k), n_in in zip(shapes, [shapes[0][1]] + [n for n, _ in shapes[:-1]])]
        ws = [(jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) / np.sqrt(width)).astype(
            jnp.bfloat16) for i, (shape, width) in enumerate(zip(shapes, widths))]
        w_flat = jnp.concatenate([wl.reshape(-1) for wl in ws])
        x = jax.random.normal(jax.random.key(1), (shapes[0][1],), jnp.float32)
        want = reference(np.asarray(x), ws)
        scale = float(np.max(np.abs(want)))
        for options_name, options in (("command_buffers", dict(GPU_XLA_OPTIONS)),
                                      ("no_command_buffers", {"xla_gpu_enable_command_buffer": ""})):
            for way in ("xla", "cuda_serial", "cuda_pdl"):
                if way == "xla":
                    f, args = jax.jit(xla_chain).lower(x, ws).compile(options), (x, ws)
                else:
                    f = jax.jit(functools.partial(cuda_chain, shapes=shapes, pdl=way == "cuda_pdl")).lower(
                        x, w_flat).compile(options)
                    args = (x, w_flat)
                t, out = best_call_time(f, *args)
                err = float(np.max(np.abs(np.asarray(out) - want))) / scale
                row = {"case": name, "products": len(shapes), "mb": round(2 * w_flat.size / 1e6, 1),
                       "options": options_name, "way": way, "us_per_product": round(t / len(shapes) * 1e6, 2),
                       "us_per_layer": round(t / layers * 1e6, 2), "tb_per_s": round(2 * w_flat.size / t / 1e12, 3),
                       "rel_err": err}
                res["rows"].append(row)
                print(row, flush=True)
        del ws, w_flat
    save_json("cuda_pdl_chain.json", res)


if __name__ == "__main__":
    main()
