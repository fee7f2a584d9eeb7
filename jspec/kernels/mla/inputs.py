"""Pallas (Triton) kernel that turns MLA's input projection into what the MLA decode kernel
and the latent cache take, in one pass (DeepSeek without `q_lora_rank`, one token a row).

The projection of the normed hidden state, [q | c | k_r] = x [q_proj | kv_a_proj_with_mqa]
(q: H heads of Dn "nope" and Dr rope values; c: the Dc latent values; k_r: the Dr rope
values of the key, shared by the heads), comes from `moe_experts.matvec` as its K splits
[S, N, W] float32 (W = H (Dn + Dr) + Dc + Dr). The model then needs, per token,
- q_lat[h] = q_nope[h] @ W_UK[:, h, :]^T [Dc] (the key up-projection absorbed),
- q_pe[h] = rope(q[h, Dn:]) [Dr],
- the cache row [RMSNorm(c) | rope(k_r)] [Dc + Dr],
with the splits' sum rounded to the activations' dtype first, as the product's output is
(`mla_inputs_reference`). In XLA that is four to five small kernels between the
projection and the MLA kernel (the split sum, the latent norm's reduction and product,
RoPE, the concatenation, the absorption product); at batch 1 each costs 1-2 us.

Kernel: grid (N, H, Dc / BC). Program (n, h, j) sums its head's Dn nope values over the
splits and multiplies them by W_UK's [BC, Dn] tile (W_UK stored [Dc, H, Dn], read as
[Dc, H*Dn]), writing q_lat[n, h, j*BC: (j+1)*BC]. Program (n, h, 0) also writes q_pe[n,
h]; program (n, 0, last) also writes the cache row: into a rows array [N, Dc+Dr], or
straight into the layer's latent cache at the token's slot (the cache aliased to the
output: no update kernel after this one; on the H200 that update was a 1.2 us kernel a
layer at batch 1). RoPE takes cos and sin [N, Dr/2]
float32 (the YaRN scale included); interleaved checkpoints rotate the pairs (x0, x1),
(x2, x3), ... in float32 and lay the result out [evens, odds] (DeepSeek-V2/V3's layout in
jspec, `models.deepseek.rope_pairs`); otherwise the halves are rotated in the
activations' dtype, as `models.layers.apply_rope` does.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels import dispatch
from jspec.kernels.moe.experts import rms_norm
from jspec.kernels.tiling import KERNEL_DTYPES, is_pow2


@dataclasses.dataclass(frozen=True)
class MlaInputsTiles:
    """Tiles of query absorption, RoPE and the cache row of one token (`Tuning.mla_inputs`)."""

    block_c: int = 64  # latent values of q_lat a program: [64, Dn] of W_UK
    num_warps: int = 4



# --------------------------------------------------------------------------- reference

def rotate(x, cos, sin, interleaved: bool):
    """RoPE of x [..., Dr] with cos, sin [..., Dr/2] float32 (broadcast against x's leading
    axes). interleaved: pairs (x0, x1), (x2, x3), ... rotated in float32, the result laid
    out [evens, odds]; else rotate-half in x's dtype (cos and sin rounded to it first)."""
    if interleaved:
        xf = x.astype(jnp.float32)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mla_inputs_reference(q, ckv, cos, sin, latent_norm, w_uk=None, *, interleaved: bool, eps: float):
    """q [N, H, Dn+Dr], ckv [N, Dc+Dr] (the projection's output, the activations' dtype),
    cos, sin [N, Dr/2] float32, latent_norm [Dc], w_uk [Dc, H, Dn] ->
    (q_lat [N, H, Dc] (q_nope [N, H, Dn] when w_uk is None), q_pe [N, H, Dr],
    rows [N, Dc+Dr]: the cache rows). Any leading axes in place of N."""
    Dr = cos.shape[-1] * 2
    Dc = ckv.shape[-1] - Dr
    Dn = q.shape[-1] - Dr
    q_nope = q[..., :Dn]
    q_pe = rotate(q[..., Dn:], cos[..., None, :], sin[..., None, :], interleaved)
    latent = rms_norm(ckv[..., :Dc], latent_norm, eps)
    rows = jnp.concatenate([latent, rotate(ckv[..., Dc:], cos, sin, interleaved)], axis=-1)
    if w_uk is None:
        return q_nope, q_pe, rows
    q_lat = jnp.einsum("...hn,chn->...hc", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q.dtype)
    return q_lat, q_pe, rows


# --------------------------------------------------------------------------- kernel

def _kernel(parts_ref, cos_ref, sin_ref, norm_ref, wuk_ref, where_ref, *refs, num_heads: int,
            dn: int, dr: int, dc: int, block_c: int, interleaved: bool, eps: float):
    """One (token n, head h, latent tile j); see the module docstring. parts_ref [S, N, W]
    float32, cos_ref / sin_ref [N, Dr/2], norm_ref [Dc], wuk_ref [Dc, H*Dn], where_ref [N]
    int32 (the row of rows_ref that takes token n's cache row); outputs q_lat [N, H, Dc],
    q_pe [N, H, Dr], rows [R, Dc+Dr] (whole arrays; with a cache, its rows, aliased to an
    input that refs holds first)."""
    qlat_ref, qpe_ref, rows_ref = refs[-3:]
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dtype = qlat_ref.dtype
    half = dr // 2

    def rnd(v):  # float32 v rounded to the activations' dtype
        return v.astype(dtype).astype(jnp.float32)

    def summed(start, size, stride=1):  # the splits' sum of `size` values from `start`, rounded
        idx = pl.ds(start, size) if stride == 1 else pl.ds(start, size, stride)
        return rnd(sum(parts_ref[jnp.int32(s), n, idx] for s in range(parts_ref.shape[0])))

    def rope(start, out_ref, *at):  # rotate the Dr values from `start`; store at out_ref[*at, off:]
        *lead, off = at
        cos, sin = cos_ref[n, :], sin_ref[n, :]
        if interleaved:
            x1, x2 = summed(start, half, 2), summed(start + 1, half, 2)
            first, second = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        else:  # in the activations' dtype: each product and sum rounded
            x1, x2, cos, sin = summed(start, half), summed(start + half, half), rnd(cos), rnd(sin)
            first, second = rnd(x1 * cos) - rnd(x2 * sin), rnd(x2 * cos) + rnd(x1 * sin)
        out_ref[(*lead, pl.ds(off, half))] = first.astype(dtype).astype(out_ref.dtype)
        out_ref[(*lead, pl.ds(off + half, half))] = second.astype(dtype).astype(out_ref.dtype)

    q0 = h * (dn + dr)
    c0 = j * block_c
    q_nope = summed(q0, dn)  # [Dn]
    w = wuk_ref[pl.ds(c0, block_c), pl.ds(h * dn, dn)].astype(jnp.float32)  # [BC, Dn]
    qlat_ref[n, h, pl.ds(c0, block_c)] = jnp.sum(w * q_nope[None, :], axis=1).astype(dtype)

    @pl.when(j == 0)
    def _():
        rope(q0 + dn, qpe_ref, n, h, 0)

    @pl.when((h == 0) & (j == pl.num_programs(2) - 1))
    def _():
        start = num_heads * (dn + dr)
        latent = summed(start, dc)
        rstd = lax.rsqrt(jnp.sum(latent * latent) / dc + eps)
        row = where_ref[n]
        rows_ref[row, pl.ds(0, dc)] = (norm_ref[...].astype(jnp.float32) * rnd(latent * rstd)).astype(dtype).astype(
            rows_ref.dtype)
        rope(start + dc, rows_ref, row, dc)


def _check_args(parts, cos, sin, latent_norm, w_uk, cache=None, write_index=None) -> None:
    """Raises ValueError / TypeError for arguments `mla_inputs` does not take."""
    if getattr(parts, "ndim", None) != 3 or getattr(w_uk, "ndim", None) != 3 or getattr(cos, "ndim", None) != 2:
        raise ValueError(f"mla_inputs needs parts [S, N, W], cos/sin [N, Dr/2] and w_uk [Dc, H, Dn], got "
                         f"{getattr(parts, 'shape', parts)}, {getattr(cos, 'shape', cos)}, "
                         f"{getattr(w_uk, 'shape', w_uk)}")
    S, N, W = parts.shape
    Dc, H, Dn = w_uk.shape
    Dr = 2 * cos.shape[1]
    if cos.shape != (N, Dr // 2) or getattr(sin, "shape", None) != cos.shape:
        raise ValueError(f"cos {cos.shape} and sin {getattr(sin, 'shape', sin)} must both be [{N}, Dr/2]")
    if W != H * (Dn + Dr) + Dc + Dr:
        raise ValueError(f"parts hold {W} values a token; H={H} heads of Dn={Dn} + Dr={Dr}, then Dc={Dc} + Dr "
                         f"need {H * (Dn + Dr) + Dc + Dr}")
    if getattr(latent_norm, "shape", None) != (Dc,):
        raise ValueError(f"latent_norm must be [{Dc}], got {getattr(latent_norm, 'shape', latent_norm)}")
    for name, v in (("Dn", Dn), ("Dr/2", Dr // 2), ("Dc", Dc)):
        if not is_pow2(v):
            raise ValueError(f"{name} = {v} is not a power of two (Triton tiles)")
    if parts.dtype != jnp.float32 or cos.dtype != jnp.float32 or sin.dtype != jnp.float32:
        raise TypeError(f"parts, cos and sin must be float32, got {parts.dtype}, {cos.dtype}, {sin.dtype}")
    if jnp.dtype(w_uk.dtype) not in map(jnp.dtype, KERNEL_DTYPES) or latent_norm.dtype != w_uk.dtype:
        raise TypeError(f"w_uk and latent_norm must share a float dtype, got {w_uk.dtype} and {latent_norm.dtype}")
    if (cache is None) != (write_index is None):
        raise ValueError("cache and write_index go together")
    if cache is not None:
        if getattr(cache, "ndim", 0) < 2 or cache.shape[-1] != Dc + Dr:
            raise ValueError(f"cache must be a latent buffer [..., {Dc + Dr}], got {getattr(cache, 'shape', cache)}")
        if jnp.dtype(cache.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"cache dtype {cache.dtype} is not float32, bfloat16 or float16")
        if getattr(write_index, "size", None) != N or not jnp.issubdtype(write_index.dtype, jnp.integer):
            raise ValueError(f"write_index must hold {N} integer slots, got {getattr(write_index, 'dtype', '')} "
                             f"{getattr(write_index, 'shape', write_index)}")


def is_supported(parts, cos, sin, latent_norm, w_uk, cache=None, write_index=None) -> bool:
    try:
        _check_args(parts, cos, sin, latent_norm, w_uk, cache, write_index)
    except (TypeError, ValueError):
        return False
    return True


def uses_kernel(parts, cos, sin, latent_norm, w_uk, cache=None, write_index=None) -> bool:
    """Whether `mla_inputs` takes the kernel (see `jspec.kernels.dispatch`)."""
    if dispatch.backend() == "reference":
        return False
    return dispatch.want_pallas(dispatch.backend() == "pallas"
                                or is_supported(parts, cos, sin, latent_norm, w_uk, cache, write_index))


def mla_inputs(parts, cos, sin, latent_norm, w_uk, *, interleaved: bool, eps: float, cache=None, write_index=None,
               block_c: int | None = None, num_warps: int | None = None, interpret: bool | None = None):
    """parts [S, N, W] float32 (K splits of the projection [q | c | k_r], see the module
    docstring), cos, sin [N, Dr/2] float32, latent_norm [Dc] and w_uk [Dc, H, Dn] of the
    activations' dtype -> (q_lat [N, H, Dc], q_pe [N, H, Dr], rows [N, Dc+Dr]) in that
    dtype, as `mla_inputs_reference` computes them from the splits' rounded sum.

    cache (a layer's latent buffer [..., Dc+Dr], dense or paged) with write_index [N] (or
    [B, T]: flat slots, in bounds, as `jspec.cache.kv.write_kv` takes them): the kernel
    writes each token's row into the cache itself (the buffer is aliased to the output,
    so XLA updates it in place where it may) and returns the cache instead of the rows.

    block_c: q_lat values a program (a power of two, capped at Dc); num_warps: Triton's;
    each None: `MlaInputsTiles`' default. interpret None: interpret mode
    unless the default backend is a GPU."""
    _check_args(parts, cos, sin, latent_norm, w_uk, cache, write_index)
    S, N, W = parts.shape
    Dc, H, Dn = w_uk.shape
    Dr = 2 * cos.shape[1]
    t = MlaInputsTiles()
    block_c = t.block_c if block_c is None else block_c
    if not is_pow2(block_c):
        raise ValueError(f"block_c must be a power of two, got {block_c!r}")
    BC = min(block_c, Dc)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps if num_warps is None else num_warps, num_stages=1)
    kernel = functools.partial(_kernel, num_heads=H, dn=Dn, dr=Dr, dc=Dc, block_c=BC, interleaved=bool(interleaved),
                               eps=float(eps))
    dt = w_uk.dtype
    args = [parts, cos, sin, latent_norm, w_uk.reshape(Dc, H * Dn)]
    if cache is None:
        args.append(jnp.arange(N, dtype=jnp.int32))
        rows_shape = jax.ShapeDtypeStruct((N, Dc + Dr), dt)
    else:
        args += [write_index.reshape(N).astype(jnp.int32), cache.reshape(-1, Dc + Dr)]
        rows_shape = jax.ShapeDtypeStruct(args[-1].shape, cache.dtype)
    whole = pl.BlockSpec()  # whole arrays, indexed inside the kernel
    q_lat, q_pe, rows = pl.pallas_call(
        kernel,
        grid=(N, H, Dc // BC),
        in_specs=[whole] * len(args),
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((N, H, Dc), dt), jax.ShapeDtypeStruct((N, H, Dr), dt), rows_shape],
        input_output_aliases={} if cache is None else {len(args) - 1: 2},
        interpret=interpret,
        compiler_params=params,
        name="jspec_mla_inputs",
    )(*args)
    return q_lat, q_pe, rows if cache is None else rows.reshape(cache.shape)
