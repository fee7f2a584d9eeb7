"""Dependent one-row products as hand-written CUDA kernels with and without programmatic
dependent launch (PDL), inside one XLA FFI call: what a hand-written per-layer kernel
sequence could gain over XLA's products for DeepSeek's batch-1 step.

`benchmarks/cuda_pdl_chain.cu` (built here with nvcc) runs L dependent products
y = W[l] y of K x K bf16 weights (K = 1024, 1536, 2048: 2.1, 4.7, 8.4 MB each; L of them
exceed L2) as L kernels launched in one FFI call; with `pdl` each kernel loads its weights,
then waits for its predecessor. Beside it, in the same process: the same chain as XLA
products (each one-row product padded to two rows as `models.llama.pad_one_row` does).
All compiled with DeepSeek's command buffers (the FFI call is captured into the graph) and
without. Checked against a float32 chain in jnp.

Needs nvcc (CUDA 12.4+) and a Hopper GPU.
Run: PYTHONPATH=. python3 benchmarks/cuda_pdl_chain.py   (result $OUT/cuda_pdl_chain.json)
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import env_info, save_json
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


def cuda_chain(x, w, *, pdl: bool):
    k = x.shape[0]
    y, _ = jax.ffi.ffi_call(NAME, (jax.ShapeDtypeStruct((k,), jnp.float32),
                                   jax.ShapeDtypeStruct((2, k), jnp.float32)))(x, w, pdl=np.int32(pdl))
    return y


def xla_chain(x, ws):
    """ws: L separate [K, K] weights ([out, in]); each product padded to two rows."""
    rows = jnp.zeros((2, x.shape[0]), jnp.float32).at[0].set(x)
    for wl in ws:
        rows = jnp.dot(rows.astype(jnp.bfloat16), wl.T, preferred_element_type=jnp.float32)
    return rows[0]


def reference(x, w):
    for wl in np.asarray(w.astype(jnp.float32)):
        x = wl @ x
    return x


def timed(f, *args, calls: int = 50) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main():
    build_and_register()
    res = {"env": env_info(), "rows": []}
    for k in (1024, 1536, 2048):
        layers = max(16, (160 << 20) // (2 * k * k))
        w = (jax.random.normal(jax.random.key(k), (layers, k, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        ws = [w[i] + 0 for i in range(layers)]
        x = jax.random.normal(jax.random.key(1), (k,), jnp.float32)
        want = reference(np.asarray(x), w)
        scale = float(np.max(np.abs(want)))
        for options_name, options in (("command_buffers", dict(GPU_XLA_OPTIONS)),
                                      ("no_command_buffers", {"xla_gpu_enable_command_buffer": ""})):
            for way in ("xla", "cuda_serial", "cuda_pdl"):
                if way == "xla":
                    f, args = jax.jit(xla_chain).lower(x, ws).compile(options), (x, ws)
                else:
                    f = jax.jit(functools.partial(cuda_chain, pdl=way == "cuda_pdl")).lower(x, w).compile(options)
                    args = (x, w)
                t = timed(f, *args)
                err = float(np.max(np.abs(np.asarray(f(*args)) - want))) / scale
                row = {"k": k, "mb_per_product": round(2 * k * k / 1e6, 2), "products": layers,
                       "options": options_name, "way": way, "us_per_product": round(t / layers * 1e6, 2),
                       "tb_per_s": round(w.nbytes / t / 1e12, 3), "rel_err": err}
                res["rows"].append(row)
                print(row, flush=True)
    save_json("cuda_pdl_chain.json", res)


if __name__ == "__main__":
    main()
