"""Sparse MLA attention (DeepSeek-V3.2's DSA) over the latent cache: each token attends to
the Ki slots its lightning indexer selected (`models.deepseek.Indexer`), not to every slot
it sees, so a step reads Ki latent rows a token however long the context.

Same absorbed form as `jspec.kernels.mla.decode` (q_lat [B,T,H,Dc] scores the latent c,
q_pe [B,T,H,Dr] the roped key, both from one slot row [Dc + Dr]; the output is the
softmax-weighted latent o_lat [B,T,H,Dc] in float32), but the keys of token t are the
slots index[b, t, :] (slot numbers in sequence order; -1: none, e.g. fewer visible slots
than Ki), gathered through the page table, so any page size works.

`sparse_mla_reference` gathers the selected rows with XLA (also what runs off the GPU);
`sparse_mla_attention` is the Pallas (Triton) kernel: grid (row block, split, b*T + t):
one program takes BR query rows of one token (its heads, padded to a power of two >= 16)
and runs an online softmax over one contiguous share of that token's Ki selected slots,
BK at a time; `merge_splits` combines the splits. A row that selected nothing gets zeros.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.attention.decode import merge_splits, online_softmax_step
from jspec.kernels.meta import widened
from jspec.kernels.tiling import KERNEL_DTYPES, is_pow2, pow2_ceil

NEG_INF = -1e30
MIN_ROWS = 16


def _rows(latent_buf, page_table, index):
    """Flat pool rows [B,T,Ki] of the selected slots (clamped in range; -1 -> row 0)."""
    P = latent_buf.shape[1]
    slot = jnp.maximum(index, 0)
    if page_table is None:  # dense [B, S, E]: row b's slot s is flat row b*S + s
        B = index.shape[0]
        return jnp.arange(B, dtype=jnp.int32)[:, None, None] * P + jnp.minimum(slot, P - 1)
    G = page_table.shape[1]
    page = jnp.take_along_axis(page_table[:, None, :], jnp.clip(slot // P, 0, G - 1), axis=2)
    num_pages = latent_buf.shape[0]
    return jnp.clip(page, 0, num_pages - 1) * P + slot % P


def sparse_mla_reference(q_lat, q_pe, latent_buf, page_table, index, *, scale: float):
    """q_lat [B,T,H,Dc], q_pe [B,T,H,Dr]; latent_buf dense [B,S,Dc+Dr] (page_table None) or
    paged [pages,P,Dc+Dr] with page_table [B,G]; index [B,T,Ki] int32 selected slots (-1:
    none). -> o_lat [B,T,H,Dc] float32 (softmax in float32; zeros for a token with no slot)."""
    Dc = q_lat.shape[-1]
    flat = latent_buf.reshape((-1, latent_buf.shape[-1]))
    rows = widened(flat[_rows(latent_buf, page_table, index)], q_lat.dtype)  # [B,T,Ki,Dc+Dr]
    c, k_pe = rows[..., :Dc], rows[..., Dc:]
    s = (jnp.einsum("bthc,btkc->bthk", q_lat, c, preferred_element_type=jnp.float32)
         + jnp.einsum("bthr,btkr->bthk", q_pe, k_pe, preferred_element_type=jnp.float32)) * scale
    valid = (index >= 0)[:, :, None, :]
    s = jnp.where(valid, s, NEG_INF)
    p = jnp.where(valid, jax.nn.softmax(s, axis=-1), 0.0).astype(c.dtype)
    return jnp.einsum("bthk,btkc->bthc", p.astype(jnp.float32), c.astype(jnp.float32))


def _kernel(rows_ref, lat_ref, qc_ref, qr_ref, o_ref, lse_ref, *, scale: float, block_k: int, num_selected: int,
            num_splits: int, latent_dim: int):
    """One (row block r, split s, token bt). rows_ref [B*T, Ki] int32: the token's selected
    pool rows (-1: none); lat_ref [rows, Dc+Dr]; qc_ref [BR, Dc], qr_ref [BR, Dr]; o_ref
    [BR, Dc] float32 normalised over this split's keys; lse_ref [BR]."""
    s, bt = pl.program_id(1), pl.program_id(2)
    Dc = latent_dim
    Dr = qr_ref.shape[-1]
    nblk = pl.cdiv(num_selected, block_k)
    per_split = pl.cdiv(nblk, num_splits)
    lo = s * per_split
    hi = jnp.minimum(lo + per_split, nblk)
    qc, qr = qc_ref[...], qr_ref[...]
    BR = qc.shape[0]
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def body(blk, carry):
        k = blk * block_k + offs
        row = rows_ref[bt, jnp.minimum(k, num_selected - 1)]  # [BK]
        valid = (row >= 0) & (k < num_selected)
        row = jnp.maximum(row, 0)
        c, kr = lat_ref[row, pl.ds(0, Dc)], lat_ref[row, pl.ds(Dc, Dr)]
        nt = (((1,), (1,)), ((), ()))
        sc = (lax.dot_general(qc, c, nt, preferred_element_type=jnp.float32)
              + lax.dot_general(qr, kr, nt, preferred_element_type=jnp.float32)) * scale
        return online_softmax_step(sc, jnp.broadcast_to(valid[None, :], (BR, block_k)), c, carry)

    carry = (jnp.zeros((BR, Dc), jnp.float32), jnp.full((BR,), NEG_INF, jnp.float32), jnp.zeros((BR,), jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi, body, carry)
    seen = l > 0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)


def _check(q_lat, q_pe, latent_buf, index) -> None:
    if q_lat.ndim != 4 or q_pe.shape[:3] != q_lat.shape[:3] or latent_buf.ndim != 3 or index.ndim != 3:
        raise ValueError(f"expected q_lat [B,T,H,Dc], q_pe [B,T,H,Dr], a latent cache [..,..,Dc+Dr] and index "
                         f"[B,T,Ki], got {q_lat.shape}, {q_pe.shape}, {latent_buf.shape}, {index.shape}")
    for name, arr in (("q_lat", q_lat), ("q_pe", q_pe), ("latent cache", latent_buf)):
        if jnp.dtype(arr.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"{name} dtype {arr.dtype} is not float32, bfloat16 or float16")
    if not q_lat.dtype == q_pe.dtype == latent_buf.dtype:
        raise TypeError("q_lat, q_pe and the latent cache must share a dtype")
    Dc, Dr = q_lat.shape[-1], q_pe.shape[-1]
    for name, d in (("latent rank Dc", Dc), ("rope dim Dr", Dr)):
        if not (is_pow2(d) and d >= 16):
            raise ValueError(f"{name} {d} is not a power of two >= 16 (Triton tiles)")
    if latent_buf.shape[2] != Dc + Dr:
        raise ValueError(f"latent cache rows hold {latent_buf.shape[2]} values, expected Dc + Dr = {Dc + Dr}")


def is_supported(q_lat, q_pe, latent_buf, index) -> bool:
    try:
        _check(q_lat, q_pe, latent_buf, index)
    except (TypeError, ValueError):
        return False
    return True


def sparse_mla_attention(q_lat, q_pe, latent_buf, page_table, index, *, scale: float, interpret: bool | None = None,
                         block_k: int = 32, block_rows: int = 64, num_splits: int | None = None,
                         num_warps: int | None = None, num_stages: int = 2, target_programs: int = 264):
    """The kernel for `sparse_mla_reference` (same arguments and result). block_k: selected
    slots a step (power of two >= 16); block_rows: query rows (one token's heads) a
    program; num_splits: splits of a token's Ki slots (default: enough programs to fill
    the GPU, `target_programs`); interpret None: interpret mode off the GPU."""
    _check(q_lat, q_pe, latent_buf, index)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a static float, got {scale!r}")
    if not (is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k!r}")
    B, T, H, Dc = q_lat.shape
    Dr, Ki = q_pe.shape[-1], index.shape[-1]
    BR = min(max(MIN_ROWS, block_rows), max(MIN_ROWS, pow2_ceil(H)))
    Hp = pl.cdiv(H, BR) * BR
    qc, qr = q_lat.reshape(B * T, H, Dc), q_pe.reshape(B * T, H, Dr)
    if Hp != H:
        qc = jnp.pad(qc, ((0, 0), (0, Hp - H), (0, 0)))
        qr = jnp.pad(qr, ((0, 0), (0, Hp - H), (0, 0)))
    rows = jnp.where(index >= 0, _rows(latent_buf, page_table, index), -1).reshape(B * T, Ki).astype(jnp.int32)
    nblk = pl.cdiv(Ki, block_k)
    if num_splits is None:
        num_splits = max(1, min(nblk, pl.cdiv(target_programs, B * T * (Hp // BR))))
    num_splits = max(1, min(int(num_splits), nblk))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=num_warps or (4 if BR * Dc <= 16 * 512 else 8), num_stages=num_stages)
    kernel = functools.partial(_kernel, scale=float(scale), block_k=block_k, num_selected=Ki, num_splits=num_splits,
                               latent_dim=Dc)
    whole = pl.BlockSpec()
    o, lse = pl.pallas_call(
        kernel,
        grid=(Hp // BR, num_splits, B * T),
        in_specs=[whole, whole,
                  pl.BlockSpec((None, BR, Dc), lambda r, s, bt: (bt, r, 0)),
                  pl.BlockSpec((None, BR, Dr), lambda r, s, bt: (bt, r, 0))],
        out_specs=[pl.BlockSpec((None, None, BR, Dc), lambda r, s, bt: (bt, s, r, 0)),
                   pl.BlockSpec((None, None, BR), lambda r, s, bt: (bt, s, r))],
        out_shape=[jax.ShapeDtypeStruct((B * T, num_splits, Hp, Dc), jnp.float32),
                   jax.ShapeDtypeStruct((B * T, num_splits, Hp), jnp.float32)],
        interpret=interpret, compiler_params=params, name="jspec_mla_sparse",
    )(rows, latent_buf.reshape((-1, Dc + Dr)), qc, qr)
    if num_splits == 1:
        out = o[:, 0]
    else:
        out = merge_splits(o[:, None], lse[:, None])[:, 0]  # [B*T, Hp, Dc]
    return out[:, :H].reshape(B, T, H, Dc)
