"""Pallas (Triton) kernels of the gated delta rule (Qwen3-Next / Qwen3.5 linear attention)
for verification, decoding and prefill, and the entry points that dispatch between them
and the jnp references of `jspec.kernels.gated_delta.reference`.

The rule per value head h (reading key head h // (Hv / Hk)), q and k L2-normalised in
float32 and q scaled by Dk^-0.5, state S [Dk, Dv] float32:
    S_t = exp(g_t) S_parent + k_t (beta_t (v_t - (exp(g_t) S_parent)^T k_t))^T,  o_t = S_t^T q_t

Entry points (inputs q, k [B, T, Hk, Dk] of any float dtype, v [B, T, Hv, Dv], g, beta
[B, T, Hv], state [B, Hv, Dk, Dv] float32; outputs float32):
- `gated_delta_verify(..., parents)` -> out [B, T, Hv, Dv]: a tree of T = N nodes (each
  node continues its parent's state; -1: the incoming one), reading the state once and
  writing no state: the closed (WY) form of `gated_delta.gated_delta_tree_chunk_reference`,
  nodes padded to M (a power of two >= 16, Triton's smallest product) with no-op nodes.
  With X = (I + L)^-1 (unit lower triangular, inverted row by row in registers, M steps),
  u = X beta (V - exp(G) K S0) and o = exp(G) Q S0 + Aqk u. Default (verify_split): two
  kernels, `_verify_prep_kernel` per (row, value head) computing everything that does not
  read the state as o = P S0 + R (P = exp(G) Q - Aqk X diag(beta exp(G)) K, R = Aqk X
  diag(beta) V), then `_verify_state_kernel` per (row, value head, Dv tile): P S0 + R.
  `_verify_kernel` does it all per Dv tile in one kernel (the solve repeated per tile).
- `gated_delta_step(..., count)` -> (out or None, state after count[b] steps): T steps one
  after the other (decode: T = 1; a commit's replay of the accepted path: T = S + 1, count
  = accept length), the state tile in registers throughout. Kernel `_step_kernel`, one
  program per (row, value head, Dv tile): elementwise products and reductions over Dk, no
  matrix units (exact float32); steps t >= count[b] are no-ops (g = 0, beta = 0: the
  state passes unchanged and out[t] reads it). The state input is aliased to the state
  output (updated in place when the caller donates it).
- `gated_delta_prefill(..., lengths)` -> (out, state after lengths[b] tokens): the chunked
  WY form (flash-linear-attention's chunk_gated_delta_rule, chunks of 64) over
  right-padded prompts; tokens t >= lengths[b] are no-ops; the outputs rounded once to
  out_dtype (the model's compute dtype). Two forms (`GatedDeltaTiles.prefill_form`):
  "scan", two kernels: `_chunk_prep_kernel`, one program per (row, value
  head, chunk), all in parallel: the chunk's (I + L)^-1 (16-row diagonal blocks by forward
  substitution, merged by products) and its decayed causal q.k products Aqk [BT, BT];
  `_chunk_scan_kernel`, one program per (row, value head, Dv tile), walking the chunks in
  order with the state tile in registers: u = (I + L)^-1 beta (V - exp(G) K S), o =
  exp(G) Q S + Aqk u, S <- exp(G_last) S + (K exp(G_last - G))^T u (five products a chunk
  on the serial chain).
  "split" (the default), FLA's decomposition: a parallel prep per (row, value head,
  chunk): W = X diag(beta exp(G)) K, U = X diag(beta) V (X = (I + L)^-1), the keys
  decayed to the chunk's end Kd and the chunk's summed log decay G_last, in one kernel
  (`_split_prep_kernel`) or two (`_split_solve_kernel` writing X, `_split_wu_kernel` the
  rest; by default with it each key head's normalised keys and the decays to the chunk's
  end instead of Kd); `_split_state_kernel` per (row, value head, Dv tile), the only
  serial part: u = U - W S, S <- exp(G_last) S + Kd^T u (two products a chunk), writing u
  and each chunk's starting state S_c; `_split_out_kernel` per (row, value head, chunk, Dv
  tile) in parallel, looping over the key dim: o = exp(G) Q S_c + Aqk u. The
  intermediates (X, W, U, Kd, u, S_c) are float32 or bfloat16 (`prefill_split_dtype`;
  by default bfloat16, with one-pass bf16 products, FLA's numerics, for 16-bit inputs).

Dispatch: `dispatch.want_pallas(supported)`: the kernels on a GPU, the references
elsewhere; JSPEC_KERNELS=pallas forces the kernels (interpret mode off GPU). Dk and Dv that
are not powers of two >= 16 are zero-padded (a copy; the models' 128 need none). Matrix
products in the kernels take `GatedDeltaTiles.precision` (default bf16x3: each float32
operand as a sum of two bf16 numbers, three bf16 products accumulated in float32; relative
errors about 6e-6 on the GPU, see `GatedDeltaTiles`; the prefill's `prefill_precision`,
by default one bf16 pass over bfloat16 intermediates); elementwise work and accumulation
are float32 throughout. Interpret mode computes the products in float32, except "bf16"
(operands rounded to bfloat16, one product: FLA's), which it rounds as the GPU does.
Tiles are `GatedDeltaTiles` (`tiles=`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels import dispatch
from jspec.kernels.gated_delta import reference as gd
from jspec.kernels.tiling import KERNEL_DTYPES, is_pow2, pow2_ceil


@dataclasses.dataclass(frozen=True)
class GatedDeltaTiles:
    """Tiles of the gated delta kernels (`Tuning.gated_delta`; part of a compile key: frozen, hashable). The
    defaults are the fastest of `benchmarks/qwen35.py gated_delta`'s sweep on an H200 (jax 0.11.2,
    2026-11-26; docs/benchmarks.md) among the variants within 2e-5 of the reference, except
    the prefill of 16-bit inputs, which takes FLA's numerics (errors about 3e-3, as FLA's).

    *_block_v: Dv columns per program (powers of two; verify and prefill >= 16, Triton's
    smallest product); *_warps, *_stages: Triton's num_warps and num_stages (stages > 1
    pipeline the loads of a loop's next step; prefill_stages applies to 16-bit q, k, v
    only: float32 inputs overflowed the shared memory at 3); prefill_chunk: tokens per
    chunk (16, 32 or 64); prefill_blocked: the chunk's solve as FLA's (16-row diagonal
    blocks inverted together, then merged by products) rather than row by row over the
    whole chunk; prefill_w: the prep kernel also writes W = X diag(beta exp(G)) K, so that
    the scan's u = X (beta V) - W S (one product on the chain from one chunk's state to
    the next, not two); verify_split: verification in two kernels (per head: everything
    that does not read the state, as o = P S0 + R; then per Dv tile: the product with the
    state); verify_state_xla: that product by XLA, float32; precision: the matrix
    products' ("ieee"; "tf32x3", "bf16x6", "bf16x3": float32 split into 3 TF32 or 6 or 3
    bf16 products; "tf32"; "bf16": operands rounded to bf16, one product, as FLA; interpret
    mode takes float32's, bf16's rounding included). bf16x3 keeps about 16 bits of each
    operand (relative errors about 6e-6 against the float32 rule, measured) at a fraction
    of tf32x3's time; bf16 about 4e-3 (interpret mode); the step kernel has no products
    (exact float32).

    The prefill's form: prefill_form "scan" (prep kernel, then one serial kernel with
    five products a chunk, on Dv tiles of prefill_block_v, None: 32) or "split" (the
    default since 2026-11-28: 1.34-1.67x faster than the scan on an H200 at the same
    precision, docs/benchmarks.md; FLA's: parallel prep of W, U and the decayed keys, a
    serial state kernel with two products a chunk on Dv tiles of prefill_block_v with
    prefill_warps, then a parallel output kernel on Dv tiles of prefill_out_block_v with
    prefill_out_warps; the one-kernel prep takes chunk_prep_warps and prefill_blocked);
    prefill_split_dtype: the split form's intermediates in HBM ("float32" or "bfloat16":
    half the bytes, errors about 3e-3; None: "bfloat16" for 16-bit q, k and v, FLA's
    numerics, else "float32"). The split form's other settings, None: chosen by
    `_split_choices` from the intermediates' dtype and the grid, as measured on an H200
    (docs/benchmarks.md, "The prep in two kernels", "The output kernel's loop over the
    key dim"): prefill_prep_split: the prep as FLA's
    two kernels, `_split_solve_kernel` writing X = (I + L)^-1 [BT, BT] a chunk on
    prefill_solve_warps (1: at FLA's precision, T = 32k, Hv = 48, the solve took 406 us on
    one warp, 618 on 2, 1090 on 4) and `_split_wu_kernel` computing W, U and Kd from it in
    products over the whole chunk on prefill_wu_warps, instead of one kernel summing [16,
    16] blocks' products (None: with bfloat16 intermediates; with float32 ones the one
    kernel is the faster); prefill_kd_transposed: the decayed keys stored as Kd^T [Dk, BT]
    a chunk, so that the state kernel's update Kd^T u is a product of untransposed
    operands; prefill_block_v None: 64 over Kd^T where Dv tiles of 32 would give more
    programs than the GPU has SMs at bfloat16 intermediates (Hv = 48: 192 programs of
    32, 96 of 64; the state kernel 1226 -> 996 us at 32k), else 32 (at Hv = 32, 64 lost
    9-11%); prefill_state_stages: the state kernel's pipeline stages (2: two programs an
    SM in Triton 3.5's compile for sm_90, 82-90 KB of shared memory; None: 3 where the
    programs fit the SMs at bfloat16 intermediates: at Hv = 32, T = 4k, 134 -> 89 us);
    prefill_raw_keys: with the prep in two kernels, the state kernel reads each key head's
    normalised keys and decays u to the chunk's end, FLA's form, instead of a value head's
    decayed keys Kd (a third of the bytes at Hv = 3 Hk; None: with the prep in two
    kernels, where on an H200 at FLA's precision the prefill was 2-8% faster, its errors
    FLA's, docs/benchmarks.md, "The state kernel on raw keys"); the output kernel:
    prefill_out_block_v Dv columns a program, a loop over the key dim in blocks of
    prefill_out_block_k with prefill_out_stages pipeline stages (None: 128 columns, key
    blocks of 32, 3 stages with bfloat16 intermediates, the output kernel 949 -> 657 us at
    32k, Hv = 48; 64 columns, the whole key dim, 1 stage with float32 ones, where 128
    columns lost 10%);
    prefill_precision: the prefill's products (None: "bf16", FLA's, over the split form's
    bfloat16 intermediates, else precision)."""
    step_block_v: int = 64
    step_warps: int = 4
    step_stages: int = 1
    verify_block_v: int = 32
    verify_warps: int = 4
    verify_stages: int = 1
    verify_split: bool = True
    verify_state_xla: bool = False
    verify_prep_warps: int = 2
    prefill_chunk: int = 64
    prefill_block_v: int | None = None
    prefill_warps: int = 4
    prefill_stages: int = 3
    prefill_blocked: bool = True
    prefill_w: bool = False
    chunk_prep_warps: int = 4
    prefill_form: str = "split"
    prefill_split_dtype: str | None = None
    prefill_state_stages: int | None = None
    prefill_kd_transposed: bool | None = None
    prefill_prep_split: bool | None = None
    prefill_solve_warps: int = 1
    prefill_raw_keys: bool | None = None
    prefill_wu_warps: int = 8
    prefill_out_block_v: int | None = None
    prefill_out_warps: int = 4
    prefill_out_block_k: int | None = None
    prefill_out_stages: int | None = None
    prefill_precision: str | None = None
    precision: str = "bf16x3"

_EPS = 1e-6  # l2norm's, as transformers and FLA
MAX_VERIFY_NODES = 128  # the verify kernel's [M, M] tiles live in registers


DEFAULT_TILES = GatedDeltaTiles()
_PRECISIONS = ("ieee", "tf32x3", "bf16x6", "bf16x3", "tf32", "bf16")
_BF16_PASS = lax.DotAlgorithmPreset.BF16_BF16_F32  # "bf16": operands rounded to bfloat16, one product
PREFILL_FORMS = ("scan", "split")
SPLIT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _dot_precision(name: str, interpret: bool):
    if name not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {name!r}")
    if name == "bf16":  # rounded by `_dot` itself, so that interpret mode shows its error too
        return _BF16_PASS
    if interpret or name == "ieee":
        return lax.Precision.HIGHEST  # the Triton lowering's IEEE float32 product
    presets = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
               "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3}
    return presets.get(name, lax.Precision.DEFAULT)  # DEFAULT: TF32


# --------------------------------------------------------------------------- kernel pieces

def _dot(a, b, prec, *, ta: bool = False, tb: bool = False):
    """a @ b in float32 (ta, tb: a or b transposed) -> [M, N]. prec `_BF16_PASS`: both
    operands rounded to bfloat16 here (one bf16 product, float32 sums); otherwise operands of
    two dtypes (a bfloat16 intermediate and a float32 one) are both taken as float32."""
    if prec == _BF16_PASS:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    elif a.dtype != b.dtype:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _rownorm(x):
    """x [M, D] float32 -> x / sqrt(|row|^2 + eps) (`gated_delta.l2norm`)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=1)[:, None] + _EPS)


def _grid2(m: int):
    """Row and column indices of an [m, m] tile -> (r, c) int32 [m, m]."""
    return lax.broadcasted_iota(jnp.int32, (m, m), 0), lax.broadcasted_iota(jnp.int32, (m, m), 1)


def _unit_lower_inverses(Ls, transposed: bool = True):
    """(I + L)^-1 for each L [m, m] strictly lower triangular -> tuple of [m, m], by forward
    substitution a row at a time: X_i = e_i - sum_{j < i} L_ij X_j (rows j < i final). The
    independent solves share one loop (their steps interleave). L's row i is read as
    column i of L^T, a sum along rows, which leaves it indexed by row as the product with
    X needs (no layout change a step); transposed False: row i of L itself, as a sum over
    rows (no [m, m] transpose, less shared memory for the chunk's whole 64 x 64)."""
    m = Ls[0].shape[0]
    r, c = _grid2(m)
    eye = jnp.where(r == c, 1.0, 0.0)
    LTs = [L.T if transposed else L for L in Ls]

    def row(i, Xs):
        out = []
        for LT, X in zip(LTs, Xs):
            if transposed:
                l_i = jnp.sum(jnp.where(c == i, LT, 0.0), axis=1)  # [m]: L[i, :]
            else:
                l_i = jnp.sum(jnp.where(r == i, LT, 0.0), axis=0)
            x_i = -jnp.sum(l_i[:, None] * X, axis=0)  # [m]: -L[i, :] @ X
            out.append(jnp.where(r == i, x_i[None, :] + eye, X))
        return tuple(out)

    return lax.fori_loop(1, m, row, tuple(eye for _ in Ls))


def _unit_lower_inverse(L, transposed: bool = True):
    """(I + L)^-1 for one strictly lower triangular L [M, M] (`_unit_lower_inverses`)."""
    return _unit_lower_inverses([L], transposed)[0]


# --------------------------------------------------------------------------- step kernel

def _step_kernel(count_ref, *refs, steps: int, rep: int, block_v: int, scale: float, with_out: bool):
    """One (row b, value head h, Dv tile j) over T steps, the state tile [Dk, BV] in registers.

    count_ref [B] int32 (steps t >= count[b] are no-ops); q_ref [B, T, Hk, Dk] (with_out
    only), k_ref [B, T, Hk, Dk], v_ref [B, T, Hv, Dv], g_ref, beta_ref [B, T, Hv] float32,
    s_ref [B, Hv, Dk, Dv] float32 (the incoming state); outputs: o_ref [B, T, Hv, Dv] float32
    (with_out), so_ref [B, Hv, Dk, Dv] float32 (aliased with s_ref). Whole arrays: each
    program reads and writes only its own [Dk, BV] state tile and out columns."""
    if with_out:
        q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, so_ref = refs
    else:
        k_ref, v_ref, g_ref, beta_ref, s_ref, so_ref = refs
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk, v0 = h // rep, j * block_v
    count = count_ref[b]

    def step(t, s):  # s [Dk, BV]: the state before step t
        on = t < count
        g = jnp.where(on, g_ref[b, t, h], 0.0)
        beta = jnp.where(on, beta_ref[b, t, h], 0.0)
        kt = k_ref[b, t, hk, :].astype(jnp.float32)  # [Dk]
        kt = kt * lax.rsqrt(jnp.sum(kt * kt) + _EPS)
        vt = v_ref[b, t, h, pl.ds(v0, block_v)].astype(jnp.float32)  # [BV]
        s = s * jnp.exp(g)
        delta = jnp.where(on, beta * (vt - jnp.sum(s * kt[:, None], axis=0)), 0.0)  # [BV]
        s = s + kt[:, None] * delta[None, :]
        if with_out:
            qt = q_ref[b, t, hk, :].astype(jnp.float32)
            qt = qt * (lax.rsqrt(jnp.sum(qt * qt) + _EPS) * scale)
            o_ref[b, t, h, pl.ds(v0, block_v)] = jnp.sum(s * qt[:, None], axis=0)
        return s

    s = lax.fori_loop(0, steps, step, s_ref[b, h, :, pl.ds(v0, block_v)])
    so_ref[b, h, :, pl.ds(v0, block_v)] = s


# --------------------------------------------------------------------------- verify kernel

def _verify_kernel(anc_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, *, rep: int, block_v: int,
                   scale: float, prec):
    """One (row b, value head h, Dv tile j) over the M (padded) nodes of a tree.

    anc_ref [B, M, M] int32 (1 where column a is row t or an ancestor of t); q_ref, k_ref
    [B, M, Hk, Dk]; v_ref [B, M, Hv, Dv]; g_ref, beta_ref [B, M, Hv] float32; s_ref [B, Hv,
    Dk, Dv] float32 (read once); o_ref [B, M, Hv, Dv] float32 (this program: [b, :, h, tile])."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk, v0 = h // rep, j * block_v
    anc = anc_ref[b] > 0  # [M, M]
    M = anc.shape[0]
    r, c = _grid2(M)
    qn = _rownorm(q_ref[b, :, hk, :].astype(jnp.float32)) * scale  # [M, Dk]
    kn = _rownorm(k_ref[b, :, hk, :].astype(jnp.float32))  # [M, Dk]
    v = v_ref[b, :, h, pl.ds(v0, block_v)].astype(jnp.float32)  # [M, BV]
    g, beta = g_ref[b, :, h], beta_ref[b, :, h]  # [M]
    s0 = s_ref[b, h, :, pl.ds(v0, block_v)]  # [Dk, BV]
    G = jnp.sum(jnp.where(anc, g[None, :], 0.0), axis=1)  # [M]: log decay along each node's path
    decay = jnp.where(anc, jnp.exp(jnp.minimum(G[:, None] - G[None, :], 0.0)), 0.0)  # [M, M]
    L = jnp.where(anc & (r != c), beta[:, None] * _dot(kn, kn, prec, tb=True) * decay, 0.0)
    eG = jnp.exp(G)[:, None]
    rhs = beta[:, None] * (v - eG * _dot(kn, s0, prec))  # [M, BV]
    u = _dot(_unit_lower_inverse(L, transposed=M <= 32), rhs, prec)
    o = eG * _dot(qn, s0, prec) + _dot(decay * _dot(qn, kn, prec, tb=True), u, prec)
    o_ref[b, :, h, pl.ds(v0, block_v)] = o


def _verify_prep_kernel(anc_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, p_ref, r_ref, *, rep: int, scale: float,
                        prec):
    """One (row b, value head h): verification's part that does not read the state.

    With X = (I + L)^-1, W = X diag(beta exp(G)) K, U0 = X diag(beta) V and Aqk = decay *
    (Q K^T): u = U0 - W S0 and o = exp(G) Q S0 + Aqk u = P S0 + R, where P = exp(G) Q -
    Aqk W and R = Aqk U0. anc_ref .. beta_ref as `_verify_kernel`; outputs p_ref [B, Hv, M,
    Dk] float32, r_ref [B, M, Hv, Dv] float32 (`_verify_state_kernel` adds P S0 in place)."""
    b, h = pl.program_id(0), pl.program_id(1)
    hk = h // rep
    anc = anc_ref[b] > 0  # [M, M]
    M = anc.shape[0]
    r, c = _grid2(M)
    qn = _rownorm(q_ref[b, :, hk, :].astype(jnp.float32)) * scale  # [M, Dk]
    kn = _rownorm(k_ref[b, :, hk, :].astype(jnp.float32))
    v = v_ref[b, :, h, :].astype(jnp.float32)  # [M, Dv]
    g, beta = g_ref[b, :, h], beta_ref[b, :, h]  # [M]
    G = jnp.sum(jnp.where(anc, g[None, :], 0.0), axis=1)
    decay = jnp.where(anc, jnp.exp(jnp.minimum(G[:, None] - G[None, :], 0.0)), 0.0)
    L = jnp.where(anc & (r != c), beta[:, None] * _dot(kn, kn, prec, tb=True) * decay, 0.0)
    X = _unit_lower_inverse(L, transposed=M <= 32)
    eG = jnp.exp(G)[:, None]
    W = _dot(X, (beta[:, None] * eG) * kn, prec)  # [M, Dk]
    U0 = _dot(X, beta[:, None] * v, prec)  # [M, Dv]
    aqk = decay * _dot(qn, kn, prec, tb=True)  # [M, M]
    p_ref[b, h] = eG * qn - _dot(aqk, W, prec)
    r_ref[b, :, h, :] = _dot(aqk, U0, prec)


def _verify_state_kernel(p_ref, r_ref, s_ref, o_ref, *, block_v: int, prec):
    """One (row b, value head h, Dv tile j): o = P S0 + R on the tile. p_ref [B, Hv, M, Dk],
    r_ref [B, M, Hv, Dv] (aliased with o_ref), s_ref [B, Hv, Dk, Dv], all float32."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    o_ref[b, :, h, cols] = _dot(p_ref[b, h], s_ref[b, h, :, cols], prec) + r_ref[b, :, h, cols]


# --------------------------------------------------------------------------- prefill kernels

def _chunk_inputs(len_ref, g_ref, beta_ref, b, h, t0, chunk: int):
    """The chunk's no-op mask and masked gates -> (valid [BT] bool, g, beta [BT] float32)."""
    valid = t0 + lax.broadcasted_iota(jnp.int32, (chunk,), 0) < len_ref[b]
    g = jnp.where(valid, g_ref[b, pl.ds(t0, chunk), h], 0.0)
    beta = jnp.where(valid, beta_ref[b, pl.ds(t0, chunk), h], 0.0)
    return valid, g, beta


_BC = 16  # rows of the diagonal blocks of the prefill's blocked solve


def _blocked_solve(len_ref, k_ref, g_ref, beta_ref, b, h, hk, t0, chunk: int, bc: int, prec):
    """The chunk's (I + L)^-1 in [bc, bc] blocks (nb = chunk / bc of them; bc = chunk: one
    block, solved row by row). The diagonal blocks' inverses X_ii by one interleaved forward
    substitution (bc steps), then X_ij = -X_ii sum_{j<=m<i} L_im X_mj for i > j
    (flash-linear-attention's solve_tril merge). The rows are loaded block by block ->
    (valids [nb] of [bc] bool, ks [nb] of [bc, Dk] float32 (normalised keys, zero past
    lengths[b]), Gs [nb] of [bc] (the log decay summed from the chunk's start), betas [nb]
    of [bc], g_last (G at the chunk's last token, a scalar), X {(i, j): [bc, bc]} for j <= i)."""
    nb = chunk // bc
    valids, ks, Gs, betas, G_end = [], [], [], [], 0.0
    for i in range(nb):
        v_i, g_i, beta_i = _chunk_inputs(len_ref, g_ref, beta_ref, b, h, t0 + i * bc, bc)
        valids.append(v_i)
        ks.append(jnp.where(v_i[:, None], _rownorm(k_ref[b, pl.ds(t0 + i * bc, bc), hk, :].astype(jnp.float32)), 0.0))
        Gs.append(G_end + jnp.cumsum(g_i))
        betas.append(beta_i)
        G_end = G_end + jnp.sum(g_i)
    rb, cb = _grid2(bc)

    def L_block(i, j):  # [bc, bc]: L's block (i, j), j <= i
        d = jnp.exp(jnp.minimum(Gs[i][:, None] - Gs[j][None, :], 0.0))
        if i == j:
            d = jnp.where(rb > cb, d, 0.0)
        return betas[i][:, None] * _dot(ks[i], ks[j], prec, tb=True) * d

    Ls = {(i, j): L_block(i, j) for i in range(nb) for j in range(i + 1)}
    diag = _unit_lower_inverses([Ls[i, i] for i in range(nb)], transposed=bc <= 32)
    X = {(i, i): diag[i] for i in range(nb)}
    for i in range(1, nb):
        for j in range(i - 1, -1, -1):
            acc = _dot(Ls[i, j], X[j, j], prec)
            for m in range(j + 1, i):
                acc = acc + _dot(Ls[i, m], X[m, j], prec)
            X[i, j] = -_dot(X[i, i], acc, prec)
    return valids, ks, Gs, betas, G_end, X


def _chunk_prep_kernel(len_ref, q_ref, k_ref, g_ref, beta_ref, ainv_ref, aqk_ref, *w_ref, chunk: int, rep: int,
                       scale: float, prec, blocked: bool):
    """One (row b, value head h, chunk c): the chunk's solve and its intra-chunk products.

    len_ref [B] int32; q_ref, k_ref [B, T, Hk, Dk]; g_ref, beta_ref [B, T, Hv] float32;
    outputs ainv_ref, aqk_ref [B, Hv, NT, BT, BT] float32: (I + L)^-1 with L[t, a] = beta_t
    exp(G_t - G_a) k_t.k_a (a < t), and Aqk[t, a] = exp(G_t - G_a) q_t.k_a (a <= t), G the
    chunk's cumulative log decay; tokens past lengths[b] masked to no-ops; w_ref (optional)
    [B, Hv, NT, BT, Dk] float32: W = (I + L)^-1 diag(beta exp(G)) K.
    blocked: L in [BC, BC] blocks (BC = 16); the diagonal blocks' inverses X_ii by one
    interleaved forward substitution (BC steps, not BT), then X_ij = -X_ii sum_{j<=m<i}
    L_im X_mj for i > j (flash-linear-attention's solve_tril merge)."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk, t0 = h // rep, c * chunk
    valid, g, beta = _chunk_inputs(len_ref, g_ref, beta_ref, b, h, t0, chunk)
    kn = jnp.where(valid[:, None], _rownorm(k_ref[b, pl.ds(t0, chunk), hk, :].astype(jnp.float32)), 0.0)
    qn = _rownorm(q_ref[b, pl.ds(t0, chunk), hk, :].astype(jnp.float32)) * scale  # [BT, Dk]
    G = jnp.cumsum(g)  # [BT]
    r, col = _grid2(chunk)
    decay = jnp.where(r >= col, jnp.exp(jnp.minimum(G[:, None] - G[None, :], 0.0)), 0.0)  # [BT, BT]
    aqk_ref[b, h, c] = decay * _dot(qn, kn, prec, tb=True)
    if not blocked or chunk <= _BC:
        L = jnp.where(r > col, beta[:, None] * _dot(kn, kn, prec, tb=True) * decay, 0.0)
        X = _unit_lower_inverse(L, transposed=chunk <= _BC)
        ainv_ref[b, h, c] = X
        if w_ref:
            w_ref[0][b, h, c] = _dot(X, (beta * jnp.exp(G))[:, None] * kn, prec)
        return
    nb = chunk // _BC
    _, ks, Gs, betas, _, X = _blocked_solve(len_ref, k_ref, g_ref, beta_ref, b, h, hk, t0, chunk, _BC, prec)
    zero = jnp.zeros((_BC, _BC), jnp.float32)
    for i in range(nb):
        for j in range(nb):
            ainv_ref[b, h, c, pl.ds(i * _BC, _BC), pl.ds(j * _BC, _BC)] = X[i, j] if j <= i else zero
    if w_ref:
        bk = [(betas[j] * jnp.exp(Gs[j]))[:, None] * ks[j] for j in range(nb)]  # [BC, Dk] each
        for i in range(nb):
            w_i = _dot(X[i, 0], bk[0], prec)
            for j in range(1, i + 1):
                w_i = w_i + _dot(X[i, j], bk[j], prec)
            w_ref[0][b, h, c, pl.ds(i * _BC, _BC), :] = w_i


def _chunk_scan_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, ainv_ref, aqk_ref, *refs, chunk: int,
                       chunks: int, rep: int, block_v: int, scale: float, prec, with_w: bool):
    """One (row b, value head h, Dv tile j), walking the NT chunks in order with the state
    tile [Dk, BV] in registers.

    len_ref [B] int32; q_ref, k_ref [B, T, Hk, Dk]; v_ref [B, T, Hv, Dv]; g_ref, beta_ref
    [B, T, Hv] float32; ainv_ref, aqk_ref [B, Hv, NT, BT, BT] float32 (`_chunk_prep_kernel`);
    with_w: w_ref [B, Hv, NT, BT, Dk] float32 (idem); s_ref [B, Hv, Dk, Dv] float32; outputs
    o_ref [B, T, Hv, Dv] float32, so_ref [B, Hv, Dk, Dv] float32 (aliased with s_ref)."""
    w_ref, s_ref, o_ref, so_ref = refs if with_w else (None, *refs)
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk, v0 = h // rep, j * block_v

    def one_chunk(c, s):  # s [Dk, BV]: the state before chunk c
        t0 = c * chunk
        valid, g, beta = _chunk_inputs(len_ref, g_ref, beta_ref, b, h, t0, chunk)
        kn = jnp.where(valid[:, None], _rownorm(k_ref[b, pl.ds(t0, chunk), hk, :].astype(jnp.float32)), 0.0)
        qn = _rownorm(q_ref[b, pl.ds(t0, chunk), hk, :].astype(jnp.float32)) * scale  # [BT, Dk]
        v = jnp.where(valid[:, None], v_ref[b, pl.ds(t0, chunk), h, pl.ds(v0, block_v)].astype(jnp.float32), 0.0)
        G = jnp.cumsum(g)  # [BT]
        g_last = jnp.sum(g)  # G at the chunk's last token
        eG = jnp.exp(G)[:, None]
        if with_w:  # u = X beta V - W S: one product on the chain
            u = _dot(ainv_ref[b, h, c], beta[:, None] * v, prec) - _dot(w_ref[b, h, c], s, prec)
        else:
            u = _dot(ainv_ref[b, h, c], beta[:, None] * (v - eG * _dot(kn, s, prec)), prec)  # [BT, BV]
        o_ref[b, pl.ds(t0, chunk), h, pl.ds(v0, block_v)] = eG * _dot(qn, s, prec) + _dot(aqk_ref[b, h, c], u, prec)
        k_end = kn * jnp.exp(g_last - G)[:, None]  # [BT, Dk]: keys decayed to the chunk's end
        return jnp.exp(g_last) * s + _dot(k_end, u, prec, ta=True)

    s = lax.fori_loop(0, chunks, one_chunk, s_ref[b, h, :, pl.ds(v0, block_v)])
    so_ref[b, h, :, pl.ds(v0, block_v)] = s


# ------------------------------------------------------------ prefill, split form (three kernels)
#
# flash-linear-attention's decomposition: with X = (I + L)^-1 per chunk, W = X diag(beta
# exp(G)) K, U = X diag(beta) V and Kd = diag(exp(G_last - G)) K (keys decayed to the
# chunk's end), a chunk starting from state S has u = U - W S (the new values), outputs
# o = exp(G) Q S + Aqk u, and leaves exp(G_last) S + Kd^T u. Only the state recurrence
# (two products a chunk) is sequential: `_split_prep_kernel` computes W, U and Kd for every
# chunk in parallel, `_split_state_kernel` walks the chunks writing u and each chunk's
# starting state, `_split_out_kernel` computes the outputs of every chunk in parallel.

def _chunk_gates(len_ref, g_ref, b, h, t0, chunk: int):
    """The chunk's no-op mask and masked log decays -> (valid [BT] bool, g [BT] float32)."""
    valid = t0 + lax.broadcasted_iota(jnp.int32, (chunk,), 0) < len_ref[b]
    return valid, jnp.where(valid, g_ref[b, pl.ds(t0, chunk), h], 0.0)


def _split_prep_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gl_ref, *, chunk: int, bc: int,
                       rep: int, prec, kd_t: bool):
    """One (row b, value head h, chunk c): the chunk's part that does not read the state.

    len_ref [B] int32; k_ref [B, T, Hk, Dk]; v_ref [B, T, Hv, Dv]; g_ref, beta_ref [B, T, Hv]
    float32; outputs (the intermediates' dtype) w_ref [B, Hv, NT, BT, Dk]: W = X diag(beta
    exp(G)) K; u_ref [B, Hv, NT, BT, Dv]: U = X diag(beta) V; kd_ref [B, Hv, NT, BT, Dk]:
    Kd = diag(exp(G_last - G)) K (kd_t: kd_ref [B, Hv, NT, Dk, BT], Kd^T, so that the state
    kernel's Kd^T u is a product of untransposed operands); gl_ref [B, Hv, NT] float32:
    G_last, the chunk's log decay summed over its tokens before lengths[b] (so that the
    state kernel loads one number a chunk rather than summing the chunk's gates). X = (I +
    L)^-1 in [bc, bc] blocks (`_blocked_solve`), so that W's and U's block rows are sums of
    [bc, bc] x [bc, D] products; tokens past lengths[b] have zero keys, values and beta (rows
    of zeros in W, U and Kd)."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk, t0 = h // rep, c * chunk
    valids, ks, Gs, betas, g_last, X = _blocked_solve(len_ref, k_ref, g_ref, beta_ref, b, h, hk, t0, chunk, bc, prec)
    gl_ref[b, h, c] = g_last
    nb = len(ks)
    rows = [pl.ds(i * bc, bc) for i in range(nb)]
    for i in range(nb):
        kd_i = jnp.exp(g_last - Gs[i])[:, None] * ks[i]  # [bc, Dk]
        if kd_t:
            kd_ref[b, h, c, :, rows[i]] = kd_i.T.astype(kd_ref.dtype)
        else:
            kd_ref[b, h, c, rows[i], :] = kd_i.astype(kd_ref.dtype)

    def block_rows(out_ref, xs):  # out's block row i = sum_{j <= i} X_ij xs_j
        for i in range(nb):
            acc = _dot(X[i, 0], xs[0], prec)
            for j in range(1, i + 1):
                acc = acc + _dot(X[i, j], xs[j], prec)
            out_ref[b, h, c, rows[i], :] = acc.astype(out_ref.dtype)

    block_rows(w_ref, [(betas[j] * jnp.exp(Gs[j]))[:, None] * ks[j] for j in range(nb)])  # [bc, Dk] each
    block_rows(u_ref, [jnp.where(valids[j][:, None], betas[j][:, None] * v_ref[b, pl.ds(t0 + j * bc, bc), h, :]
                                 .astype(jnp.float32), 0.0) for j in range(nb)])  # [bc, Dv] each


def _split_solve_kernel(len_ref, k_ref, g_ref, beta_ref, x_ref, *, chunk: int, bc: int, rep: int, prec):
    """One (row b, value head h, chunk c): X = (I + L)^-1 (`_blocked_solve`), written whole
    for `_split_wu_kernel`: x_ref [B, Hv, NT, BT, BT] (the intermediates' dtype), zeros
    above the diagonal blocks. Inputs as `_split_prep_kernel`'s."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    X = _blocked_solve(len_ref, k_ref, g_ref, beta_ref, b, h, h // rep, c * chunk, chunk, bc, prec)[-1]
    nb = chunk // bc
    for i in range(nb):
        for j in range(nb):
            block = X[i, j] if j <= i else jnp.zeros((bc, bc), jnp.float32)
            x_ref[b, h, c, pl.ds(i * bc, bc), pl.ds(j * bc, bc)] = block.astype(x_ref.dtype)


def _split_wu_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, x_ref, w_ref, u_ref, kd_ref, gl_ref, *dec_ref,
                     chunk: int, rep: int, prec, kd_t: bool, raw_keys: bool):
    """One (row b, value head h, chunk c): `_split_prep_kernel`'s outputs (W, U, Kd, G_last)
    from the solved X [BT, BT] (`_split_solve_kernel`), each a product over the whole chunk
    ([BT, BT] x [BT, D]) rather than a sum of [bc, bc] blocks' products. raw_keys: instead
    of Kd a value head's, kd_ref [B, Hk, NT, BT, Dk] (kd_t: [B, Hk, NT, Dk, BT]) holds the
    normalised keys of its key head (written by the key head's first value head) and
    dec_ref [B, Hv, NT, BT] float32 the decays to the chunk's end exp(G_last - G), which the
    state kernel applies to u instead (FLA's form: a third of Kd's bytes at Hv = 3 Hk)."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk, t0 = h // rep, c * chunk
    valid, g, beta = _chunk_inputs(len_ref, g_ref, beta_ref, b, h, t0, chunk)
    G, g_last = jnp.cumsum(g), jnp.sum(g)  # [BT], a scalar
    gl_ref[b, h, c] = g_last
    kn = jnp.where(valid[:, None], _rownorm(k_ref[b, pl.ds(t0, chunk), hk, :].astype(jnp.float32)), 0.0)  # [BT, Dk]
    x = x_ref[b, h, c]  # [BT, BT]
    w_ref[b, h, c] = _dot(x, (beta * jnp.exp(G))[:, None] * kn, prec).astype(w_ref.dtype)
    vb = jnp.where(valid[:, None], beta[:, None] * v_ref[b, pl.ds(t0, chunk), h, :].astype(jnp.float32), 0.0)
    u_ref[b, h, c] = _dot(x, vb, prec).astype(u_ref.dtype)
    if raw_keys:
        dec_ref[0][b, h, c] = jnp.exp(g_last - G)

        @pl.when(h % rep == 0)
        def _():
            kd_ref[b, hk, c] = (kn.T if kd_t else kn).astype(kd_ref.dtype)
    else:
        kd = jnp.exp(g_last - G)[:, None] * kn  # [BT, Dk]
        kd_ref[b, h, c] = (kd.T if kd_t else kd).astype(kd_ref.dtype)


def _split_state_kernel(gl_ref, *refs, chunks: int, block_v: int, prec, kd_t: bool, rep: int, raw_keys: bool):
    """One (row b, value head h, Dv tile j), walking the NT chunks in order with the state
    tile [Dk, BV] float32 in registers: per chunk u = U - W S, S <- exp(G_last) S + Kd^T u.

    gl_ref [B, Hv, NT] float32 (G_last of each chunk); w_ref [B, Hv, NT, BT, Dk], kd_ref [B,
    Hv, NT, BT, Dk] (kd_t: [B, Hv, NT, Dk, BT], Kd^T), u_ref [B, Hv, NT, BT, Dv]
    (`_split_prep_kernel`; u_ref aliased with vn_ref); s_ref [B, Hv, Dk, Dv] float32 (the
    incoming state, aliased with so_ref); outputs vn_ref [B, Hv, NT, BT, Dv]: the new values
    u; sc_ref [B, Hv, NT, Dk, Dv]: the state before each chunk (both in the intermediates'
    dtype); so_ref [B, Hv, Dk, Dv] float32: the state after the last. raw_keys: refs start
    with dec_ref [B, Hv, NT, BT] float32 and kd_ref holds the key heads' normalised keys
    (`_split_wu_kernel`): the update is K^T (diag(dec) u)."""
    dec_ref, refs = (refs[0], refs[1:]) if raw_keys else (None, refs)
    w_ref, u_ref, kd_ref, s_ref, vn_ref, sc_ref, so_ref = refs
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols, hk = pl.ds(j * block_v, block_v), (h // rep if raw_keys else h)

    def one_chunk(c, carry):  # s [Dk, BV]: the state before chunk c; gl: G_last of chunk c
        s, gl = carry
        gl_next = gl_ref[b, h, jnp.minimum(c + 1, chunks - 1)]  # loaded a chunk ahead, off the chain
        sc_ref[b, h, c, :, cols] = s.astype(sc_ref.dtype)
        u = u_ref[b, h, c, :, cols].astype(jnp.float32) - _dot(w_ref[b, h, c], s, prec)  # [BT, BV]
        vn_ref[b, h, c, :, cols] = u.astype(vn_ref.dtype)
        if raw_keys:
            u = dec_ref[b, h, c][:, None] * u
        upd = _dot(kd_ref[b, hk, c], u, prec) if kd_t else _dot(kd_ref[b, hk, c], u, prec, ta=True)
        return jnp.exp(gl) * s + upd, gl_next

    s, _ = lax.fori_loop(0, chunks, one_chunk, (s_ref[b, h, :, cols], gl_ref[b, h, 0]))
    so_ref[b, h, :, cols] = s


def _split_out_kernel(len_ref, q_ref, k_ref, g_ref, sc_ref, vn_ref, o_ref, *, chunk: int, rep: int, block_v: int,
                      block_k: int, scale: float, prec):
    """One (row b, value head h, chunk c, Dv tile j): o = exp(G) Q S_c + Aqk u, with Aqk[t, a]
    = exp(G_t - G_a) q_t.k_a (a <= t) computed here. A loop over the key dim in blocks of
    block_k sums the raw rows' products Q K^T and Q S_c and their squared norms; the norms
    divide the sums after it (qn.kn = q.k / (|q| |k|)), so that no whole [BT, Dk] row
    block is held and the next block's loads can be pipelined.

    len_ref [B] int32; q_ref, k_ref [B, T, Hk, Dk]; g_ref [B, T, Hv] float32; sc_ref [B, Hv,
    NT, Dk, Dv], vn_ref [B, Hv, NT, BT, Dv] (`_split_state_kernel`); o_ref [B, T, Hv, Dv]
    (the caller's out_dtype: o is rounded once, here, as the model would round it)."""
    b, h, c, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    hk, t0, cols = h // rep, c * chunk, pl.ds(j * block_v, block_v)
    valid, g = _chunk_gates(len_ref, g_ref, b, h, t0, chunk)
    tokens = pl.ds(t0, chunk)

    def one_block(i, sums):  # qk [BT, BT], qs [BT, BV], q2, k2 [BT]: the sums over the key blocks before i
        qk, qs, q2, k2 = sums
        keys = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        qb = q_ref[b, tokens, hk, keys].astype(jnp.float32)  # [BT, BK]
        kb = jnp.where(valid[:, None], k_ref[b, tokens, hk, keys].astype(jnp.float32), 0.0)
        return (qk + _dot(qb, kb, prec, tb=True), qs + _dot(qb, sc_ref[b, h, c, keys, cols], prec),
                q2 + jnp.sum(qb * qb, axis=1), k2 + jnp.sum(kb * kb, axis=1))

    zeros = jnp.zeros((chunk,), jnp.float32)
    sums = (jnp.zeros((chunk, chunk), jnp.float32), jnp.zeros((chunk, block_v), jnp.float32), zeros, zeros)
    qk, qs, q2, k2 = lax.fori_loop(0, q_ref.shape[-1] // block_k, one_block, sums)
    rq, rk = lax.rsqrt(q2 + _EPS) * scale, lax.rsqrt(k2 + _EPS)  # [BT] each: 1 / |row| (`_rownorm`)
    G = jnp.cumsum(g)  # [BT]
    r, col = _grid2(chunk)
    decay = jnp.where(r >= col, jnp.exp(jnp.minimum(G[:, None] - G[None, :], 0.0)), 0.0)  # [BT, BT]
    aqk = decay * (qk * rq[:, None] * rk[None, :])
    o = (jnp.exp(G) * rq)[:, None] * qs + _dot(aqk, vn_ref[b, h, c, :, cols], prec)
    o_ref[b, tokens, h, cols] = o.astype(o_ref.dtype)


# --------------------------------------------------------------------------- wrappers

def _check(name, q, k, v, g, beta, state, *, q_optional: bool = False):
    """Raises ValueError / TypeError for arguments the entry points do not take."""
    arrays = {"k": k, "v": v, "g": g, "beta": beta, "state": state} | ({} if q is None else {"q": q})
    if q is None and not q_optional:
        raise ValueError(f"{name}: q must be an array [B, T, Hk, Dk], got None")
    for key, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{name}: {key} must be an array, got {type(a).__name__}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name}: {key} must be a float array, got {a.dtype}")
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{name}: k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv], got {k.shape} and {v.shape}")
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if q is not None and q.shape != k.shape:
        raise ValueError(f"{name}: q {q.shape} and k {k.shape} differ")
    if v.shape[:2] != (B, T) or Hk < 1 or Hv % Hk:
        raise ValueError(f"{name}: v {v.shape} must be [B, T, Hv, Dv] with Hv a multiple of k's Hk ({k.shape})")
    for key, a in (("g", g), ("beta", beta)):
        if a.shape != (B, T, Hv):
            raise ValueError(f"{name}: {key} must be [B, T, Hv] = {(B, T, Hv)}, got {a.shape}")
    if state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"{name}: state must be [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}, got {state.shape}")
    if state.dtype != jnp.float32:
        raise TypeError(f"{name}: state must be float32, got {state.dtype}")
    for key, a in arrays.items():
        if key != "state" and jnp.dtype(a.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"{name}: {key} dtype {a.dtype} is not float32, bfloat16 or float16")


def _check_rows(name, key, a, B: int, T: int | None):
    """Integer [B, T] (T None: [B]) or raises."""
    shape = (B,) if T is None else (B, T)
    if not hasattr(a, "shape") or tuple(a.shape) != shape or not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{name}: {key} must be an integer array of shape {shape}, got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def _padded_dim(d: int) -> int:
    return max(16, pow2_ceil(d))


def _pad(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _pad_heads(q, k, v, state):
    """Zero-pads Dk and Dv to powers of two >= 16 (no copy when they are) -> (q, k, v,
    state, Dv): zero key columns and state rows change no norm and no product."""
    Dk, Dv = k.shape[-1], v.shape[-1]
    Dkp, Dvp = _padded_dim(Dk), _padded_dim(Dv)
    q = None if q is None else _pad(q, 3, Dkp)
    return q, _pad(k, 3, Dkp), _pad(v, 3, Dvp), _pad(_pad(state, 2, Dkp), 3, Dvp), Dv


def _block_v(block_v: int, Dv: int, minimum: int) -> int:
    if not is_pow2(block_v) or block_v < minimum:
        raise ValueError(f"block_v must be a power of two >= {minimum}, got {block_v!r}")
    return min(block_v, Dv)


def _compiler_params(interpret: bool, num_warps: int, num_stages: int = 1):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plt
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _sm_count() -> int:
    """The first device's multiprocessors (GPUs; 132 elsewhere: an H100's or H200's)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 132) or 132)
    except Exception:  # noqa: BLE001
        return 132


def _interpret(interpret):
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def _tiles(tiles: GatedDeltaTiles | None, overrides: dict) -> GatedDeltaTiles:
    """tiles (None: the defaults) with some fields replaced (e.g. step_block_v=8)."""
    t = DEFAULT_TILES if tiles is None else tiles
    return dataclasses.replace(t, **overrides) if overrides else t


def gated_delta_step_kernel(q, k, v, g, beta, state, count=None, *, tiles: GatedDeltaTiles | None = None,
                            interpret: bool | None = None, **overrides):
    """`gated_delta_step` with the Pallas kernel (no dispatch); tiles: `GatedDeltaTiles`
    (None: the defaults), its fields replaced by `overrides` (step_block_v=..);
    interpret None: interpret mode unless the default backend is a GPU."""
    _check("gated_delta_step", q, k, v, g, beta, state, q_optional=True)
    B, T, Hk, Dk = k.shape
    Hv = v.shape[2]
    count = jnp.full((B,), T, jnp.int32) if count is None else count
    _check_rows("gated_delta_step", "count", count, B, None)
    t = _tiles(tiles, overrides)
    interpret = _interpret(interpret)
    q, k, v, state, Dv0 = _pad_heads(q, k, v, state)
    Dv = v.shape[-1]
    BV = _block_v(t.step_block_v, Dv, 1)
    with_out = q is not None
    kernel = functools.partial(_step_kernel, steps=T, rep=Hv // Hk, block_v=BV, scale=Dk ** -0.5,
                               with_out=with_out)
    state_shape = jax.ShapeDtypeStruct(state.shape, jnp.float32)
    out_shape = ((jax.ShapeDtypeStruct((B, T, Hv, Dv), jnp.float32),) if with_out else ()) + (state_shape,)
    args = (count.astype(jnp.int32),) + ((q,) if with_out else ()) + (k, v, g.astype(jnp.float32),
                                                                       beta.astype(jnp.float32), state)
    res = pl.pallas_call(
        kernel, grid=(B, Hv, Dv // BV), out_shape=out_shape,
        input_output_aliases={len(args) - 1: len(out_shape) - 1}, interpret=interpret,
        compiler_params=_compiler_params(interpret, t.step_warps, t.step_stages), name="jspec_gated_delta_step",
    )(*args)
    out, last = (res[0], res[1]) if with_out else (None, res[0])
    if Dv != Dv0 or last.shape[2] != Dk:
        last = last[:, :, :Dk, :Dv0]
        out = None if out is None else out[..., :Dv0]
    return out, last


def gated_delta_verify_kernel(q, k, v, g, beta, state, parents, *, tiles: GatedDeltaTiles | None = None,
                              interpret: bool | None = None, **overrides):
    """`gated_delta_verify` with the Pallas kernel(s) (no dispatch); tiles, interpret and
    overrides as `gated_delta_step_kernel`."""
    _check("gated_delta_verify", q, k, v, g, beta, state)
    B, T, Hk, Dk = k.shape
    Hv = v.shape[2]
    _check_rows("gated_delta_verify", "parents", parents, B, T)
    M = max(16, pow2_ceil(T))
    if M > MAX_VERIFY_NODES:
        raise ValueError(f"gated_delta_verify's kernel takes at most {MAX_VERIFY_NODES} nodes, got {T}")
    t = _tiles(tiles, overrides)
    interpret = _interpret(interpret)
    prec = _dot_precision(t.precision, interpret)
    q, k, v, state, Dv0 = _pad_heads(q, k, v, state)
    Dv = v.shape[-1]
    BV = _block_v(t.verify_block_v, Dv, 16)
    # M - T no-op nodes after the tree (roots: g = beta = 0, zero inputs): no real node's ancestor.
    anc = gd.ancestor_matrix(_pad(jnp.asarray(parents, jnp.int32), 1, M, -1)).astype(jnp.int32)  # [B, M, M]
    q, k, v = (_pad(x, 1, M) for x in (q, k, v))
    g, beta = (_pad(x.astype(jnp.float32), 1, M) for x in (g, beta))
    rep, scale = Hv // Hk, Dk ** -0.5
    params = _compiler_params(interpret, t.verify_warps, t.verify_stages)
    o_shape = jax.ShapeDtypeStruct((B, M, Hv, Dv), jnp.float32)
    if not t.verify_split:
        out = pl.pallas_call(
            functools.partial(_verify_kernel, rep=rep, block_v=BV, scale=scale, prec=prec),
            grid=(B, Hv, Dv // BV), out_shape=o_shape, interpret=interpret, compiler_params=params,
            name="jspec_gated_delta_verify",
        )(anc, q, k, v, g, beta, state)
        return out[:, :T, :, :Dv0]
    P, R = pl.pallas_call(
        functools.partial(_verify_prep_kernel, rep=rep, scale=scale, prec=prec),
        grid=(B, Hv), out_shape=(jax.ShapeDtypeStruct((B, Hv, M, q.shape[-1]), jnp.float32), o_shape),
        interpret=interpret, compiler_params=_compiler_params(interpret, t.verify_prep_warps),
        name="jspec_gated_delta_verify_prep",
    )(anc, q, k, v, g, beta)
    if t.verify_state_xla:
        out = jnp.einsum("bhmd,bhdv->bmhv", P, state, precision=lax.Precision.HIGHEST) + R
        return out[:, :T, :, :Dv0]
    out = pl.pallas_call(
        functools.partial(_verify_state_kernel, block_v=BV, prec=prec),
        grid=(B, Hv, Dv // BV), out_shape=o_shape, input_output_aliases={1: 0}, interpret=interpret,
        compiler_params=params, name="jspec_gated_delta_verify_state",
    )(P, R, state)
    return out[:, :T, :, :Dv0]


def gated_delta_prefill_kernel(q, k, v, g, beta, state, lengths=None, *, tiles: GatedDeltaTiles | None = None,
                               out_dtype=jnp.float32, interpret: bool | None = None, **overrides):
    """`gated_delta_prefill` with the Pallas kernels (no dispatch); tiles, interpret and
    overrides as `gated_delta_step_kernel`; out_dtype as `gated_delta_prefill`."""
    _check("gated_delta_prefill", q, k, v, g, beta, state)
    B, T, Hk, Dk = k.shape
    Hv = v.shape[2]
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths
    _check_rows("gated_delta_prefill", "lengths", lengths, B, None)
    t = _prefill_numerics(_tiles(tiles, overrides), q, k, v)
    BT = t.prefill_chunk
    if BT not in (16, 32, 64):
        raise ValueError(f"prefill_chunk must be 16, 32 or 64, got {BT!r}")
    if t.prefill_form not in PREFILL_FORMS:
        raise ValueError(f"prefill_form must be one of {PREFILL_FORMS}, got {t.prefill_form!r}")
    if t.prefill_split_dtype not in SPLIT_DTYPES:
        raise ValueError(f"prefill_split_dtype must be one of {tuple(SPLIT_DTYPES)}, got {t.prefill_split_dtype!r}")
    interpret = _interpret(interpret)
    prec = _dot_precision(t.prefill_precision, interpret)
    q, k, v, state, Dv0 = _pad_heads(q, k, v, state)
    Dv = v.shape[-1]
    NT = pl.cdiv(T, BT)
    lengths = jnp.minimum(lengths.astype(jnp.int32), T)  # padding tokens: past every length
    q, k, v = (_pad(x, 1, NT * BT) for x in (q, k, v))
    g, beta = (_pad(x.astype(jnp.float32), 1, NT * BT) for x in (g, beta))
    rep, scale = Hv // Hk, Dk ** -0.5
    if t.prefill_form == "split":
        out, last = _prefill_split(lengths, q, k, v, g, beta, state, t, rep=rep, scale=scale, prec=prec,
                                   out_dtype=out_dtype, interpret=interpret)
        return out[:, :T, :, :Dv0], last[:, :, :Dk, :Dv0]
    BV = _block_v(t.prefill_block_v or 32, Dv, 16)  # the scan's Dv tile
    stages = t.prefill_stages if max(x.dtype.itemsize for x in (q, k, v)) <= 2 else 1
    tri = jax.ShapeDtypeStruct((B, Hv, NT, BT, BT), jnp.float32)
    w_shape = (jax.ShapeDtypeStruct((B, Hv, NT, BT, q.shape[-1]), jnp.float32),) if t.prefill_w else ()
    prep = pl.pallas_call(
        functools.partial(_chunk_prep_kernel, chunk=BT, rep=rep, scale=scale, prec=prec, blocked=t.prefill_blocked),
        grid=(B, Hv, NT), out_shape=(tri, tri, *w_shape), interpret=interpret,
        compiler_params=_compiler_params(interpret, t.chunk_prep_warps), name="jspec_gated_delta_chunk_prep",
    )(lengths, q, k, g, beta)
    out, last = pl.pallas_call(
        functools.partial(_chunk_scan_kernel, chunk=BT, chunks=NT, rep=rep, block_v=BV, scale=scale, prec=prec,
                          with_w=t.prefill_w),
        grid=(B, Hv, Dv // BV),
        out_shape=(jax.ShapeDtypeStruct((B, NT * BT, Hv, Dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={len(prep) + 6: 1}, interpret=interpret,
        compiler_params=_compiler_params(interpret, t.prefill_warps, stages),
        name="jspec_gated_delta_chunk_scan",
    )(lengths, q, k, v, g, beta, *prep, state)
    return out[:, :T, :, :Dv0].astype(out_dtype), last[:, :, :Dk, :Dv0]


def _prefill_numerics(t: GatedDeltaTiles, q, k, v) -> GatedDeltaTiles:
    """t with prefill_split_dtype and prefill_precision filled in where None: FLA's numerics
    (bfloat16 intermediates, one-pass bf16 products) for 16-bit q, k and v, float32
    intermediates for wider ones; the products one bf16 pass over the split form's
    bfloat16 intermediates, else t.precision."""
    half = max(x.dtype.itemsize for x in (q, k, v)) <= 2
    split_dtype = t.prefill_split_dtype or ("bfloat16" if half else "float32")
    fla = t.prefill_form == "split" and split_dtype == "bfloat16"
    precision = t.prefill_precision or ("bf16" if fla else t.precision)
    return dataclasses.replace(t, prefill_split_dtype=split_dtype, prefill_precision=precision)


def _split_choices(t: GatedDeltaTiles, B: int, Hv: int, Dk: int, Dv: int) -> GatedDeltaTiles:
    """t (numerics filled in, `_prefill_numerics`) with the split form's settings that it
    leaves None filled in, for B rows of Hv value heads. With bfloat16 intermediates: the
    prep as two kernels, the state kernel on raw keys; Dv tiles of 64 over Kd^T where tiles
    of 32 would give more programs than the GPU has SMs (Hv = 48 at B = 1), else 32; 3
    stages where the state kernel's programs fit the SMs; the output kernel on 128 Dv
    columns, key blocks of 32, 3 stages. With float32 ones: one prep kernel, tiles of 32,
    2 stages; the output kernel on 64 columns, whole key rows, 1 stage (each measured the
    faster there on an H200, docs/benchmarks.md, "The prep in two kernels", "The output
    kernel's loop over the key dim")."""
    bf16 = t.prefill_split_dtype == "bfloat16"
    wide = bf16 and B * Hv * max(Dv // 32, 1) > _sm_count()
    prep_split = bf16 if t.prefill_prep_split is None else t.prefill_prep_split
    BV = _block_v(t.prefill_block_v or (64 if wide else 32), Dv, 16)
    stages = t.prefill_state_stages
    if stages is None:
        stages = 3 if bf16 and B * Hv * (Dv // BV) <= _sm_count() else 2
    def pick(value, when_bf16, otherwise):
        return (when_bf16 if bf16 else otherwise) if value is None else value

    return dataclasses.replace(
        t, prefill_prep_split=prep_split, prefill_kd_transposed=pick(t.prefill_kd_transposed, wide, False),
        prefill_block_v=BV, prefill_state_stages=stages,
        prefill_raw_keys=prep_split and t.prefill_raw_keys is not False,
        prefill_out_block_v=_block_v(pick(t.prefill_out_block_v, 128, 64), Dv, 16),
        prefill_out_block_k=_block_v(pick(t.prefill_out_block_k, 32, Dk), Dk, 16),
        prefill_out_stages=pick(t.prefill_out_stages, 3, 1))


def _prefill_split(lengths, q, k, v, g, beta, state, t: GatedDeltaTiles, *, rep: int, scale: float, prec,
                   out_dtype, interpret: bool):
    """The split form's three kernels over inputs padded to NT chunks of BT tokens (q, k [B,
    NT BT, Hk, Dk], v [B, NT BT, Hv, Dv], g, beta [B, NT BT, Hv] float32, state [B, Hv, Dk,
    Dv] float32; Dk, Dv powers of two >= 16) -> (out [B, NT BT, Hv, Dv] out_dtype, the last
    state [B, Hv, Dk, Dv] float32). Intermediates (W, U, Kd, the new values and the chunks'
    states: 2 NT BT (Dk + Dv) + NT Dk Dv numbers per row and value head) in
    t.prefill_split_dtype."""
    B, Tp, _, Dk = k.shape
    Hv, Dv = v.shape[2:]
    BT = t.prefill_chunk
    NT = Tp // BT
    dt = SPLIT_DTYPES[t.prefill_split_dtype]
    def per_chunk(d):  # [B, Hv, NT, BT, d] in the intermediates' dtype
        return jax.ShapeDtypeStruct((B, Hv, NT, BT, d), dt)

    t = _split_choices(t, B, Hv, Dk, Dv)
    prep_split, kd_t, raw_keys = t.prefill_prep_split, t.prefill_kd_transposed, t.prefill_raw_keys
    BV = t.prefill_block_v
    bc = _BC if t.prefill_blocked else BT
    Hkd = Hv // rep if raw_keys else Hv  # Kd a value head's, or the normalised keys a key head's
    kd_shape = jax.ShapeDtypeStruct((B, Hkd, NT, Dk, BT) if kd_t else (B, Hkd, NT, BT, Dk), dt)
    prep_shapes = (per_chunk(Dk), per_chunk(Dv), kd_shape, jax.ShapeDtypeStruct((B, Hv, NT), jnp.float32))
    dec = ()
    if prep_split:  # FLA's two kernels: the solve writes X, whole-chunk products read it
        x = pl.pallas_call(
            functools.partial(_split_solve_kernel, chunk=BT, bc=bc, rep=rep, prec=prec),
            grid=(B, Hv, NT), out_shape=per_chunk(BT), interpret=interpret,
            compiler_params=_compiler_params(interpret, t.prefill_solve_warps), name="jspec_gated_delta_split_solve",
        )(lengths, k, g, beta)
        dec_shape = (jax.ShapeDtypeStruct((B, Hv, NT, BT), jnp.float32),) if raw_keys else ()
        w, u, kd, gl, *dec = pl.pallas_call(
            functools.partial(_split_wu_kernel, chunk=BT, rep=rep, prec=prec, kd_t=kd_t, raw_keys=raw_keys),
            grid=(B, Hv, NT), out_shape=prep_shapes + dec_shape, interpret=interpret,
            compiler_params=_compiler_params(interpret, t.prefill_wu_warps), name="jspec_gated_delta_split_wu",
        )(lengths, k, v, g, beta, x)
    else:
        w, u, kd, gl = pl.pallas_call(
            functools.partial(_split_prep_kernel, chunk=BT, bc=bc, rep=rep, prec=prec, kd_t=kd_t),
            grid=(B, Hv, NT), out_shape=prep_shapes, interpret=interpret,
            compiler_params=_compiler_params(interpret, t.chunk_prep_warps), name="jspec_gated_delta_split_prep",
        )(lengths, k, v, g, beta)
    vn, sc, last = pl.pallas_call(
        functools.partial(_split_state_kernel, chunks=NT, block_v=BV, prec=prec, kd_t=kd_t, rep=rep,
                          raw_keys=raw_keys),
        grid=(B, Hv, Dv // BV),
        out_shape=(per_chunk(Dv), jax.ShapeDtypeStruct((B, Hv, NT, Dk, Dv), dt),
                   jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={2 + len(dec): 0, 4 + len(dec): 2}, interpret=interpret,
        compiler_params=_compiler_params(interpret, t.prefill_warps, t.prefill_state_stages),
        name="jspec_gated_delta_split_state",
    )(gl, *dec, w, u, kd, state)
    BVo, BKo = t.prefill_out_block_v, t.prefill_out_block_k
    out = pl.pallas_call(
        functools.partial(_split_out_kernel, chunk=BT, rep=rep, block_v=BVo, block_k=BKo, scale=scale, prec=prec),
        grid=(B, Hv, NT, Dv // BVo), out_shape=jax.ShapeDtypeStruct((B, Tp, Hv, Dv), out_dtype),
        interpret=interpret, compiler_params=_compiler_params(interpret, t.prefill_out_warps, t.prefill_out_stages),
        name="jspec_gated_delta_split_out",
    )(lengths, q, k, g, sc, vn)
    return out, last


# --------------------------------------------------------------------------- entry points

def _small_heads(k, v) -> bool:
    """Whether the kernels' register tiles take these head dims without padding past 256."""
    return k.shape[-1] <= 256 and v.shape[-1] <= 1024


def gated_delta_verify(q, k, v, g, beta, state, parents, *, tiles: GatedDeltaTiles | None = None):
    """The rule over a tree of T = N nodes, each continuing its parent's state (parents
    [B, T] int, parents[t] < t, -1: the incoming state), reading the state once and writing
    none. q, k [B, T, Hk, Dk] raw (normalised here), v [B, T, Hv, Dv], g, beta [B, T, Hv],
    state [B, Hv, Dk, Dv] float32 -> out [B, T, Hv, Dv] float32 (each node as decoding its
    root-to-node path). The kernel on a GPU (up to 64 nodes), else
    `gated_delta.gated_delta_tree_chunk_reference`."""
    _check("gated_delta_verify", q, k, v, g, beta, state)
    _check_rows("gated_delta_verify", "parents", parents, *k.shape[:2])
    if dispatch.want_pallas(k.shape[1] <= 64 and _small_heads(k, v)):
        return gated_delta_verify_kernel(q, k, v, g, beta, state, parents, tiles=tiles)
    return gd.gated_delta_tree_chunk_reference(q, k, v, g, beta, state, parents)


def gated_delta_step(q, k, v, g, beta, state, count=None, *, tiles: GatedDeltaTiles | None = None):
    """T steps of the rule one after the other, of which the first count[b] change row b's
    state (count [B] int or None: T; later steps are no-ops, their outputs read the state
    after count[b] steps). q None: no outputs (a replay that keeps only the state). Same
    inputs as `gated_delta_verify` -> (out [B, T, Hv, Dv] float32 or None, state [B, Hv, Dk,
    Dv] float32). The kernel (state updated in place when donated) on a GPU, else
    `gated_delta.gated_delta_steps_reference`."""
    _check("gated_delta_step", q, k, v, g, beta, state, q_optional=True)
    if count is not None:
        _check_rows("gated_delta_step", "count", count, k.shape[0], None)
    if dispatch.want_pallas(_small_heads(k, v)):
        return gated_delta_step_kernel(q, k, v, g, beta, state, count, tiles=tiles)
    return gd.gated_delta_steps_reference(q, k, v, g, beta, state, count)


def gated_delta_prefill(q, k, v, g, beta, state, lengths=None, *, tiles: GatedDeltaTiles | None = None,
                        out_dtype=jnp.float32):
    """The rule over right-padded prompts in chunks (chunked WY form, float32): tokens t >=
    lengths[b] (lengths [B] int or None: T) leave the state unchanged. Same inputs as
    `gated_delta_verify` -> (out [B, T, Hv, Dv] out_dtype (computed in float32 and rounded
    once: the model's compute dtype saves writing and reading float32 outputs), the state
    after lengths[b] tokens [B, Hv, Dk, Dv] float32). The kernels on a GPU, else
    `gated_delta.gated_delta_chunk_reference` (chunks of tiles.prefill_chunk)."""
    _check("gated_delta_prefill", q, k, v, g, beta, state)
    if lengths is not None:
        _check_rows("gated_delta_prefill", "lengths", lengths, k.shape[0], None)
    t = DEFAULT_TILES if tiles is None else tiles
    if dispatch.want_pallas(_small_heads(k, v)):
        return gated_delta_prefill_kernel(q, k, v, g, beta, state, lengths, tiles=t, out_dtype=out_dtype)
    out, last = gd.gated_delta_chunk_reference(q, k, v, g, beta, state, lengths, chunk=t.prefill_chunk)
    return out.astype(out_dtype), last
