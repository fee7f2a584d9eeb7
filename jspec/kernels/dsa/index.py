"""DeepSeek-V3.2's lightning-indexer scores over the cached indexer keys, for decoding and
tree verification: for each new token t of row b and each slot s the row can address,

    score[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, s] * scale)

(q [B,T,Hi,Di] the roped indexer queries, w [B,T,Hi] the per-head weights, k the keys in
the layer's indexer buffer, `jspec.cache.latent`), in float32. The caller masks the slots
a token does not see and takes the top Ki (`models.deepseek.Indexer`).

`index_scores_reference` reads the keys with XLA and keeps the [B,T,Hi,Sk] per-head
scores; `index_scores` is the Pallas (Triton) kernel: grid (key block, b*T + t), one
program gathers BK keys through the page table (any page size; a dense buffer is one page
a row), multiplies them by the token's Hi queries (padded to a power of two >= 16 with
zero weights) and reduces over the heads before writing [BK] scores: the per-head scores
never leave the program.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels import dispatch
from jspec.kernels.meta import pool_rows, read_kv
from jspec.kernels.tiling import KERNEL_DTYPES, is_pow2, pow2_ceil

MIN_ROWS = 16


REFERENCE_BLOCK = 4096  # slots the reference scores at a time: its per-head scores are [B,T,Hi,REFERENCE_BLOCK]


def index_scores_reference(q, w, key_buf, page_table, *, scale: float, block: int = REFERENCE_BLOCK):
    """q [B,T,Hi,Di], w [B,T,Hi] float32; key_buf dense [B,S,Di] (page_table None) or paged
    [pages,P,Di] with page_table [B,G] -> scores [B,T,Sk] float32 (Sk = S or G*P). Slots
    are scored `block` at a time (a loop), so memory beyond the result stays bounded at any
    context."""
    keys = read_kv(key_buf, page_table)  # [B,Sk,Di]
    qf, wf = q.astype(jnp.float32), w.astype(jnp.float32)

    def scored(k):  # [B,BK,Di] -> [B,T,BK]
        s = jax.nn.relu(jnp.einsum("bthd,bsd->bths", qf, k.astype(jnp.float32)) * scale)
        return jnp.einsum("bth,bths->bts", wf, s)
    B, Sk, Di = keys.shape
    if Sk <= block:
        return scored(keys)
    n = pl.cdiv(Sk, block)
    keys = jnp.pad(keys, ((0, 0), (0, n * block - Sk), (0, 0))).reshape(B, n, block, Di)
    out = lax.map(scored, jnp.moveaxis(keys, 1, 0))  # [n,B,T,BK]
    return jnp.moveaxis(out, 0, 2).reshape(B, q.shape[1], n * block)[:, :, :Sk]


def _kernel(table_ref, key_ref, q_ref, w_ref, o_ref, *, scale: float, block_k: int, page_size: int, dense: bool,
            num_pages: int, num_keys: int, num_tokens: int):
    blk, bt = pl.program_id(0), pl.program_id(1)
    b = bt // num_tokens
    slot = jnp.minimum(blk * block_k + jnp.arange(block_k, dtype=jnp.int32), num_keys - 1)
    row = pool_rows(table_ref, b, slot, page_size=page_size, num_pages=num_pages, dense=dense)
    k = key_ref[row, :]  # [BK, Di]
    q = q_ref[...]  # [Hp, Di]
    nt = (((1,), (1,)), ((), ()))
    s = jnp.maximum(lax.dot_general(q, k, nt, preferred_element_type=jnp.float32) * scale, 0.0)  # [Hp, BK]
    o_ref[...] = jnp.sum(s * w_ref[...][:, None], axis=0)


def _check(q, w, key_buf) -> None:
    if q.ndim != 4 or w.shape != q.shape[:3] or key_buf.ndim != 3 or key_buf.shape[-1] != q.shape[-1]:
        raise ValueError(f"expected q [B,T,Hi,Di], w [B,T,Hi] and a key buffer [..,..,Di], got {q.shape}, "
                         f"{w.shape}, {key_buf.shape}")
    if jnp.dtype(q.dtype) not in map(jnp.dtype, KERNEL_DTYPES) or q.dtype != key_buf.dtype:
        raise TypeError(f"q and the key buffer must share a float32, bfloat16 or float16 dtype, got {q.dtype}, "
                        f"{key_buf.dtype}")
    Di = q.shape[-1]
    if not (is_pow2(Di) and Di >= 16):
        raise ValueError(f"index head dim {Di} is not a power of two >= 16 (Triton tiles)")


def is_supported(q, w, key_buf) -> bool:
    try:
        _check(q, w, key_buf)
    except (TypeError, ValueError):
        return False
    return True


def uses_kernel(q, w, key_buf) -> bool:
    """Whether `scores` runs the kernel for these arguments (see jspec.kernels.dispatch)."""
    mode = dispatch.backend()
    return mode != "reference" and dispatch.want_pallas(mode == "pallas" or is_supported(q, w, key_buf))


def scores(q, w, key_buf, page_table, *, scale: float):
    """Dispatch: the kernel where it runs (`uses_kernel`), else the reference."""
    if uses_kernel(q, w, key_buf):
        return index_scores(q, w, key_buf, page_table, scale=scale)
    return index_scores_reference(q, w, key_buf, page_table, scale=scale)


def index_scores(q, w, key_buf, page_table, *, scale: float, interpret: bool | None = None, block_k: int = 64,
                 num_warps: int = 4, num_stages: int = 2):
    """The kernel for `index_scores_reference` (same arguments and result). block_k: slots
    a program (a power of two >= 16); interpret None: interpret mode off the GPU."""
    _check(q, w, key_buf)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a static float, got {scale!r}")
    if not (is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k!r}")
    B, T, Hi, Di = q.shape
    P = key_buf.shape[1]
    table = jnp.arange(B, dtype=jnp.int32)[:, None] if page_table is None else page_table.astype(jnp.int32)
    num_keys = table.shape[1] * P
    Hp = max(MIN_ROWS, pow2_ceil(Hi))
    qp = jnp.pad(q.reshape(B * T, Hi, Di), ((0, 0), (0, Hp - Hi), (0, 0)))
    wp = jnp.pad(w.astype(jnp.float32).reshape(B * T, Hi), ((0, 0), (0, Hp - Hi)))  # zero weights: no score
    nblk = pl.cdiv(num_keys, block_k)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(_kernel, scale=float(scale), block_k=block_k, page_size=P,
                               dense=page_table is None, num_pages=key_buf.shape[0], num_keys=num_keys,
                               num_tokens=T)
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        kernel, grid=(nblk, B * T),
        in_specs=[whole, whole, pl.BlockSpec((None, Hp, Di), lambda k, bt: (bt, 0, 0)),
                  pl.BlockSpec((None, Hp), lambda k, bt: (bt, 0))],
        out_specs=pl.BlockSpec((None, block_k), lambda k, bt: (bt, k)),
        out_shape=jax.ShapeDtypeStruct((B * T, nblk * block_k), jnp.float32),
        interpret=interpret, compiler_params=params, name="jspec_dsa_index",
    )(table, key_buf.reshape((-1, Di)), qp, wp)
    return out[:, :num_keys].reshape(B, T, num_keys)
