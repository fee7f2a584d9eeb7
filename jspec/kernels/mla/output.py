"""Pallas (Triton) kernel that finishes MLA attention: it merges the MLA kernel's key
splits and applies the value up-projection W_UV, in one pass.

After `jspec.kernels.mla.decode` each query row (token t, head h) holds NS partial
results: the softmax-weighted latent o_lat [Dc] normalised over one split's keys, and the
log of that split's softmax denominator lse. The model then needs
    o[t, h] = round(merge(o_lat)) @ W_UV[h]    -> [Dv]
(rounded to the activations' dtype first, as `mla_output_reference` does). In XLA that is
three kernels for the merge (the weights, the weighted sum, a transpose) and two for the
product (a one-row product per head of a 1M-element weight, which XLA rewrites as a
multiply writing the whole [Dc, H, Dv] product and a reduction reading it back): five
kernels of 1-2.5 us each at batch 1 on the H200.

Kernel: grid (B, rows, Dv tiles), rows = T*H in the MLA kernel's order (row r: token
r // H, head r % H). A program loads the lse of its row's NS splits as one vector (padded
to a power of two), weighs the splits as `decode_attention.merge_splits` does, and walks
the latent in chunks (`latent_chunk`): it loads that chunk of every split at once (a
[NS, chunk] tile: no loop of dependent loads), merges and rounds it, and multiplies it by
the chunk of its head's BN rows W_UV[h, n0:n0+BN, :] (w_uv is stored [H, Dv, Dc], so a
program reads BN contiguous rows), accumulating [BN] in float32. A row that saw
no key (every lse NEG_INF) gets zeros, as the reference's merge gives. Dv not a multiple
of BN: the last tile starts at Dv - BN and overlaps its neighbour (both write the same
values).

Tiles and the token limit are `MlaOutputTiles` (below; `Tuning.mla_output`), taken
as `tiles=` (None: the defaults, with the measurements behind them).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.attention.decode import merge_splits
from jspec.kernels.tiling import (
    KERNEL_DTYPES,
    in_order_fold,
    is_pow2,
    pow2_ceil,
    pow2_floor,
)


@dataclasses.dataclass(frozen=True)
class MlaOutputTiles:
    """Tiles of the merge of the MLA kernel's key splits and W_UV (`Tuning.mla_output`)."""

    block_n: int = 16  # output columns a program: 16 x Dc=512 float32 weights, 64 a thread
    num_warps: int = 4
    # A program per (query row, column tile) re-reads its head's W_UV tile for every token:
    # (B*T) x 2 MB of L2 reads a layer at DeepSeek's shapes. Past this many tokens XLA's
    # batched product (W_UV read once) is faster: on the H200 a batch-32 V2-Lite step took
    # 12.93 ms with the kernel, 12.29 without (docs/experiments.md).
    kernel_max_tokens: int = 16
    # The latent is walked in chunks of split_tile // NSP values (at least min_chunk, at
    # most Dc), NSP the splits as a power of two: the [NSP, chunk] float32 tile of the
    # splits stays about split_tile values. At V2-Lite's batch-1 decode (19 splits, NSP 32:
    # one 512-wide chunk) that took 3.5 us against 6.3 us with 128-wide chunks
    # (mla_b1_configs, a probe at 3bf4f68, H200); 128 or more splits keep 128-wide chunks.
    split_tile: int = 16384
    min_chunk: int = 128
    # `mla_output(ordered=True)` (`kernels.row.mla`) unrolls its walk over up to this many
    # splits (their loads issued together) and loops over more; the same sums either way.
    # Unrolled: V2-Lite's 4-layer batch-1 profile took the kernel from 17.9 to 11.6 us a step
    # (H100, 2026-11-26, docs/experiments.md).
    unroll_splits: int = 32

NEG_INF = -1e30


# --------------------------------------------------------------------------- reference

def up_project(o_lat, w_uv, dtype):
    """o_lat [B,T,H,Dc] float32, w_uv [H, Dv, Dc] -> [B,T,H,Dv] in `dtype`: o_lat rounded to
    `dtype`, then the product (float32 accumulation)."""
    return jnp.einsum("bthc,hvc->bthv", o_lat.astype(dtype), w_uv.astype(dtype),
                      preferred_element_type=jnp.float32).astype(dtype)


def mla_output_reference(o, lse, w_uv, *, num_tokens: int, dtype):
    """The reference for `mla_output`: o [B, NS, R, Dc] float32 and lse [B, NS, R] float32
    (the MLA kernel's splits, R >= T*H rows), w_uv [H, Dv, Dc] -> [B, T, H, Dv] in `dtype`."""
    B, _, _, Dc = o.shape
    H = w_uv.shape[0]
    rows = num_tokens * H
    o_lat = merge_splits(o[:, None, :, :rows], lse[:, None, :, :rows])[:, 0]  # [B, rows, Dc]
    return up_project(o_lat.reshape(B, num_tokens, H, Dc), w_uv, dtype)


# --------------------------------------------------------------------------- kernel

def _kernel(o_ref, lse_ref, w_ref, out_ref, *, num_splits: int, num_heads: int, num_rows: int,
            block_n: int, dv: int, chunk: int, ordered: bool, unroll_splits: int):
    """One (batch row b, query row r, column tile j).

    o_ref [B * NS * R, Dc] float32 and lse_ref [B * NS, R] float32: the splits (whole
    arrays; split s of row r of batch row b is row (b * NS + s) * R + r); w_ref [H, Dv, Dc]
    (whole); out_ref [B, rows, Dv] (this program writes [b, r, n0:n0+BN]). ordered: the
    splits added one after another in split order (`mla_output`)."""
    b, r, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h = lax.rem(r, num_heads)
    n0 = j * block_n
    if dv % block_n:  # the last tile overlaps its neighbour instead of running past Dv
        n0 = jnp.minimum(n0, dv - block_n)
    split = jnp.arange(_split_rows(num_splits), dtype=jnp.int32)
    valid = split < num_splits
    first = b * num_splits + jnp.minimum(split, num_splits - 1)  # [NSP], clamped in range
    lse = jnp.where(valid, lse_ref[first, r], NEG_INF)
    m = jnp.max(lse)
    w = jnp.where(valid, jnp.exp(lse - m), 0.0)  # [NSP]
    if ordered:  # up to unroll_splits splits unrolled (their loads issued together), else a loop
        def weight(s):
            return jnp.exp(lse_ref[b * num_splits + s, r] - m)

        def in_order(term, zero):  # term(0) + term(1) + ... + term(NS - 1), added in that order
            return in_order_fold(num_splits, term, zero, unroll_splits)
        inv_l = 1.0 / in_order(weight, jnp.float32(0.0))
    else:
        inv_l = 1.0 / jnp.sum(w)
    out = jnp.zeros((block_n,), jnp.float32)
    for c0 in range(0, o_ref.shape[-1], chunk):  # the latent in chunks: independent loads
        if ordered:
            x = in_order(lambda s: weight(s) * o_ref[(b * num_splits + s) * num_rows + r, pl.ds(c0, chunk)],
                         jnp.zeros((chunk,), jnp.float32)) * inv_l
        else:
            o = o_ref[first * num_rows + r, pl.ds(c0, chunk)]  # [NSP, chunk]
            x = jnp.sum(w[:, None] * o, axis=0) * inv_l  # the merged latent's chunk
        x = x.astype(w_ref.dtype).astype(jnp.float32)  # rounded as the reference's
        wt = w_ref[h, pl.ds(n0, block_n), pl.ds(c0, chunk)].astype(jnp.float32)  # [BN, chunk]
        out = out + jnp.sum(wt * x[None, :], axis=1)
    out_ref[b, r, pl.ds(n0, block_n)] = out.astype(out_ref.dtype)


def _split_rows(num_splits: int) -> int:
    """NSP: the splits as a power-of-two tile (at least 2)."""
    return max(2, pow2_ceil(num_splits))


def latent_chunk(num_splits: int, latent_dim: int, tiles: MlaOutputTiles | None = None) -> int:
    """Latent values a step of the kernel's walk for `num_splits` splits: about
    `tiles.split_tile` values of the splits at once, at least `tiles.min_chunk`, at most the
    latent (see `MlaOutputTiles`; None: the defaults)."""
    t = MlaOutputTiles() if tiles is None else tiles
    return min(latent_dim, max(t.min_chunk, pow2_floor(max(1, t.split_tile // _split_rows(num_splits)))))


def _check_args(o, lse, w_uv, num_tokens) -> None:
    """Raises ValueError / TypeError for arguments `mla_output` does not take."""
    if getattr(o, "ndim", None) != 4 or getattr(lse, "ndim", None) != 3 or getattr(w_uv, "ndim", None) != 3:
        raise ValueError(f"mla_output needs o [B, NS, R, Dc], lse [B, NS, R] and w_uv [H, Dv, Dc], got "
                         f"{getattr(o, 'shape', o)}, {getattr(lse, 'shape', lse)}, {getattr(w_uv, 'shape', w_uv)}")
    B, NS, R, Dc = o.shape
    H, Dv, Dc_w = w_uv.shape
    if lse.shape != (B, NS, R):
        raise ValueError(f"lse {lse.shape} does not match o {o.shape} (want {(B, NS, R)})")
    if Dc_w != Dc:
        raise ValueError(f"w_uv takes {Dc_w} latent values, o has {Dc}")
    if not isinstance(num_tokens, int) or num_tokens < 1 or num_tokens * H > R:
        raise ValueError(f"num_tokens {num_tokens!r} x {H} heads does not fit the {R} rows of o")
    if Dc < 16 or not is_pow2(Dc):
        raise ValueError(f"latent rank Dc {Dc} is not a power of two >= 16 (Triton tiles)")
    if Dv < 16:
        raise ValueError(f"Dv must be >= 16 (Triton tiles), got {Dv}")
    if o.dtype != jnp.float32 or lse.dtype != jnp.float32:
        raise TypeError(f"o and lse must be float32, got {o.dtype} and {lse.dtype}")
    if jnp.dtype(w_uv.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
        raise TypeError(f"w_uv dtype {w_uv.dtype} is not float32, bfloat16 or float16")


def is_supported(o, lse, w_uv, num_tokens, tiles: MlaOutputTiles | None = None) -> bool:
    """Whether `mla_output` takes these arguments and pays (at most
    `tiles.kernel_max_tokens` tokens in all; None: the defaults)."""
    t = MlaOutputTiles() if tiles is None else tiles
    try:
        _check_args(o, lse, w_uv, num_tokens)
    except (TypeError, ValueError):
        return False
    return o.shape[0] * num_tokens <= t.kernel_max_tokens


def mla_output(o, lse, w_uv, *, num_tokens: int, block_n: int | None = None,
               num_warps: int | None = None, interpret: bool | None = None, tiles: MlaOutputTiles | None = None,
               ordered: bool = False):
    """Merges the MLA kernel's splits and up-projects the values: o [B, NS, R, Dc] float32
    (split s of row r normalised over its keys; row r is token r // H, head r % H; rows
    from T*H on are padding), lse [B, NS, R] float32, w_uv [H, Dv, Dc] -> [B, T, H, Dv] in
    w_uv's dtype (see `mla_output_reference`). block_n: output columns a program (a power
    of two, capped at Dv); num_warps: Triton's; each None: `tiles`' (`MlaOutputTiles`,
    which also sets the latent's chunks, `latent_chunk`; None: the defaults). interpret
    None: interpret mode unless the default backend is a GPU. ordered (`kernels.row.mla`):
    a row's splits are weighed and added one after another in split order, latent chunks
    of `latent_chunk(1, Dc)`, so a split that saw nothing (lse NEG_INF, o zeros) adds exact
    zeros and the number of splits does not change the result (the walk unrolled up to
    `tiles.unroll_splits` splits)."""
    _check_args(o, lse, w_uv, num_tokens)
    B, NS, R, Dc = o.shape
    H, Dv, _ = w_uv.shape
    t = MlaOutputTiles() if tiles is None else tiles
    block_n = t.block_n if block_n is None else block_n
    if not is_pow2(block_n):
        raise ValueError(f"block_n must be a power of two, got {block_n!r}")
    BN = min(block_n, pow2_floor(Dv))
    rows = num_tokens * H
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps if num_warps is None else num_warps, num_stages=1)
    kernel = functools.partial(_kernel, num_splits=NS, num_heads=H, num_rows=R, block_n=BN, dv=Dv,
                               chunk=latent_chunk(1 if ordered else NS, Dc, t), ordered=bool(ordered),
                               unroll_splits=t.unroll_splits)
    whole = pl.BlockSpec()  # whole arrays, indexed inside the kernel
    out = pl.pallas_call(
        kernel,
        grid=(B, rows, pl.cdiv(Dv, BN)),
        in_specs=[whole] * 3,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((B, rows, Dv), w_uv.dtype),
        interpret=interpret,
        compiler_params=params,
        name="jspec_mla_output",
    )(o.reshape(B * NS * R, Dc), lse.reshape(B * NS, R), w_uv)
    return out.reshape(B, num_tokens, H, Dv)
