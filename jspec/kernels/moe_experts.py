"""Pallas (Triton) expert products for MoE decode and verification: each (token, expert)
pair reads its expert's weights straight from the stacked [E, Din, Dout] array.

At decode sizes (N tokens, N*k < E pairs) the routed experts are a few matrix-vector
products, memory bound: the only real cost is reading the chosen experts' weights. The
gather formulation (`routed_experts_reference`: `w[ids]`, then batched products) first
copies every pair's expert into a new array, which XLA did at 0.3-0.7 TB/s on the H200.

Kernel (`expert_matmul`): out[p, :] = x[p, :] @ w[ids[p], :, :] in float32.
- Grid (P, Dout tiles, K splits); the pair axis varies fastest, so the programs that read
  one tile of the same expert for different pairs run together and the repeats hit L2.
- A program takes BN output columns of one pair and walks its share of the Din rows in
  chunks of BK: it loads the [BK, BN] weight tile of expert ids[p] from the whole array
  (dynamic indexing; XLA makes no copy) and the matching BK activations, and accumulates
  x * w elementwise in a float32 [BK, BN] tile, summed over rows once at the end (no
  tensor cores: a pair is one row).
- Dout not a multiple of BN: the last tile starts at Dout - BN and overlaps its
  neighbour (both write the same values). Din not a multiple of BK: the last chunk starts
  at Din - BK and zeroes the activations of rows an earlier chunk took. No loads out of
  bounds, no masks.
- K splits (more programs when P * tiles is small): each split writes its partial sums
  to its own [P, Dout] slice, which the wrapper adds up (XLA fuses that into the next op).
- ids are clamped to [0, E) in the kernel (an out-of-range id reads expert 0 or E-1
  instead of stray memory). Arrays over 4 GB (V3's gate_up: 15 GB) get 64-bit offsets
  from Pallas' Triton lowering.

`expert_matmul` may also take a second stacked array, `extra`, whose experts follow w's
(ids E..): DeepSeek's shared experts run in the routed experts' products that way
(`pl.when` picks the array per program; no concatenated copy).

`routed_experts` chains two of them as DeepSeek's routed experts do: h = x @ gate_up
(rounded to the activations' dtype, as the reference's product is), silu(h_gate) * h_up
in that dtype, then @ down, kept in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels import dispatch

# Defaults measured on the H200 (benchmarks/moe_kernel_check.py, device time of the routed
# experts, bf16): 3.3 TB/s at V3 N=1, 3.5-3.7 TB/s at N=4..16, 1.9 TB/s at V2-Lite N=1.
# Sizes tuned one by one gained 2-9% at most (BK=32, 4 warps, 4 stages at V3 N>=4).
DEFAULT_BLOCK_N = 128  # output columns per program
DEFAULT_BLOCK_K = 64  # weight rows per loop step
DEFAULT_WARPS = 2  # beat 4 warps by 5-20% on every product measured
DEFAULT_STAGES = 3
TARGET_PROGRAMS = 264  # two programs per SM on an H200 (132 SMs): more K splits below that
MIN_SPLIT_CHUNKS = 4  # a K split walks at least this many chunks

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# --------------------------------------------------------------------------- reference

def _gather(w, extra, ids):
    """w[ids] over the experts of w [E, ...] followed by those of `extra` (None: none)."""
    E = w.shape[0]
    got = w[jnp.clip(ids, 0, E - 1)]
    if extra is None:
        return got
    return jnp.where((ids < E)[:, None, None], got, extra[jnp.clip(ids - E, 0, extra.shape[0] - 1)])


def routed_experts_reference(x_pairs, ids, gate_up, down, extra=None):
    """x_pairs [P, D] (each pair's token), ids [P] (each pair's expert), gate_up
    [E, D, 2Fm], down [E, Fm, D], extra: (gate_up, down) of experts E.. -> [P, D] float32:
    the gather formulation (copies each pair's expert weights, then batched products in
    the activations' dtype)."""
    Fm = down.shape[1]
    extra_gu, extra_down = (None, None) if extra is None else extra
    h = jnp.einsum("pd,pdf->pf", x_pairs, _gather(gate_up, extra_gu, ids))  # [P, 2Fm]
    a = jax.nn.silu(h[:, :Fm]) * h[:, Fm:]
    return jnp.einsum("pf,pfd->pd", a, _gather(down, extra_down, ids)).astype(jnp.float32)


def expert_matmul_reference(x, ids, w):
    """x [P, Din], ids [P], w [E, Din, Dout] -> [P, Dout] float32 (float32 products)."""
    return jnp.einsum("pd,pdf->pf", x.astype(jnp.float32), w[ids].astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)


# --------------------------------------------------------------------------- kernel

def _kernel(ids_ref, x_ref, w_ref, *rest, din: int, dout: int, num_experts: int, num_extra: int,
            block_k: int, block_n: int, chunks_per_split: int, num_chunks: int,
            reduce_each_step: bool):
    """One (pair p, column tile j, K split s).

    ids_ref [P] int32; x_ref [P, Din]; w_ref [E, Din, Dout] and, with `num_extra`, the
    extra experts' [E2, Din, Dout] (ids E.. E+E2-1) (whole arrays); o_ref [S, P, Dout]
    float32 (whole; this program writes [s, p, n0:n0+BN])."""
    extra_ref, o_ref = rest if num_extra else (None, rest[0])
    p, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = jnp.clip(ids_ref[p], 0, num_experts + num_extra - 1)
    n0 = j * block_n
    if dout % block_n:  # the last tile overlaps its neighbour instead of running past Dout
        n0 = jnp.minimum(n0, dout - block_n)
    lo = s * chunks_per_split
    hi = jnp.minimum(lo + chunks_per_split, num_chunks)
    rows = jnp.arange(block_k, dtype=jnp.int32)

    def product(ref, expert):  # this program's share of x[p] @ ref[expert][:, n0:n0+BN]
        def step(c, acc):
            k0 = c * block_k
            if din % block_k:  # the last chunk overlaps: zero the rows an earlier one took
                kc = jnp.minimum(k0, din - block_k)
                xv = x_ref[p, pl.ds(kc, block_k)].astype(jnp.float32)
                xv = jnp.where(kc + rows >= k0, xv, 0.0)
            else:
                kc = k0
                xv = x_ref[p, pl.ds(kc, block_k)].astype(jnp.float32)
            wv = ref[expert, pl.ds(kc, block_k), pl.ds(n0, block_n)].astype(jnp.float32)
            if reduce_each_step:
                return acc + jnp.sum(xv[:, None] * wv, axis=0)
            return acc + xv[:, None] * wv

        shape = (block_n,) if reduce_each_step else (block_k, block_n)
        acc = lax.fori_loop(lo, hi, step, jnp.zeros(shape, jnp.float32))
        o_ref[s, p, pl.ds(n0, block_n)] = acc if reduce_each_step else jnp.sum(acc, axis=0)

    if not num_extra:
        product(w_ref, e)
        return

    @pl.when(e < num_experts)
    def _():
        product(w_ref, jnp.minimum(e, num_experts - 1))

    @pl.when(e >= num_experts)
    def _():
        product(extra_ref, jnp.maximum(e - num_experts, 0))


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def _check_matmul(x, ids, w, extra=None) -> None:
    """Raises ValueError / TypeError for arguments `expert_matmul` does not take."""
    if extra is not None:
        if getattr(extra, "ndim", None) != 3 or getattr(w, "ndim", None) != 3 or extra.shape[1:] != w.shape[1:]:
            raise ValueError(f"extra experts must be [E2, Din, Dout] like w {getattr(w, 'shape', w)}, got "
                             f"{getattr(extra, 'shape', extra)}")
        if extra.dtype != w.dtype:
            raise TypeError(f"extra experts' dtype {extra.dtype} differs from w's {w.dtype}")
    if getattr(x, "ndim", None) != 2 or getattr(ids, "ndim", None) != 1 or getattr(w, "ndim", None) != 3:
        raise ValueError(f"expert_matmul needs x [P, Din], ids [P] and w [E, Din, Dout], got shapes "
                         f"{getattr(x, 'shape', x)}, {getattr(ids, 'shape', ids)}, {getattr(w, 'shape', w)}")
    P, Din = x.shape
    E, Din_w, Dout = w.shape
    if ids.shape[0] != P:
        raise ValueError(f"ids has {ids.shape[0]} entries for {P} pairs (x rows)")
    if Din_w != Din:
        raise ValueError(f"weights take {Din_w} inputs, x has {Din}")
    if P < 1 or E < 1:
        raise ValueError(f"no pairs or no experts: x {x.shape}, w {w.shape}")
    if Din < 16 or Dout < 16:
        raise ValueError(f"Din and Dout must be >= 16 (Triton tiles), got {Din} and {Dout}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integer, got {ids.dtype}")
    for name, a in (("x", x), ("w", w)):
        if jnp.dtype(a.dtype) not in map(jnp.dtype, _DTYPES):
            raise TypeError(f"{name} dtype {a.dtype} is not float32, bfloat16 or float16")


def expert_matmul(x, ids, w, extra=None, *, block_n: int | None = None, block_k: int | None = None,
                  num_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, reduce_each_step: bool = False,
                  interpret: bool | None = None):
    """out[p] = x[p] @ w[ids[p]]: x [P, Din], ids [P] int, w [E, Din, Dout] -> [P, Dout]
    float32, reading only the experts ids names (out-of-range ids are clamped). extra
    [E2, Din, Dout]: more experts, which ids E.. E+E2-1 name (DeepSeek's shared experts
    beside the routed ones, without a concatenated copy).

    block_n: output columns per program, block_k: weight rows per loop step (powers of
    two; capped at Dout and Din). num_splits: programs sharing one (pair, tile)'s rows
    (default: enough programs to fill the GPU). num_warps, num_stages: Triton's.
    reduce_each_step: sum each step's [BK, BN] products over rows at once (a [BN]
    accumulator) instead of accumulating the tile and summing it at the end.
    interpret None: interpret mode unless the default backend is a GPU."""
    _check_matmul(x, ids, w, extra)
    P, Din = x.shape
    E, _, Dout = w.shape
    E2 = 0 if extra is None else extra.shape[0]
    block_n = DEFAULT_BLOCK_N if block_n is None else block_n
    block_k = DEFAULT_BLOCK_K if block_k is None else block_k
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if not _is_pow2(v):
            raise ValueError(f"{name} must be a power of two, got {v!r}")
    BN = min(block_n, _pow2_floor(Dout))
    BK = min(block_k, _pow2_floor(Din))
    tiles = pl.cdiv(Dout, BN)
    num_chunks = pl.cdiv(Din, BK)
    if num_splits is None:
        want = pl.cdiv(TARGET_PROGRAMS, P * tiles)
        num_splits = max(1, min(want, num_chunks // MIN_SPLIT_CHUNKS))
    if not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    per_split = pl.cdiv(num_chunks, min(num_splits, num_chunks))
    S = pl.cdiv(num_chunks, per_split)  # no empty splits
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    kernel = functools.partial(_kernel, din=Din, dout=Dout, num_experts=E, num_extra=E2, block_k=BK,
                               block_n=BN, chunks_per_split=per_split, num_chunks=num_chunks,
                               reduce_each_step=bool(reduce_each_step))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=DEFAULT_WARPS if num_warps is None else num_warps,
                                    num_stages=DEFAULT_STAGES if num_stages is None else num_stages)
    whole = pl.BlockSpec()  # whole arrays, indexed inside the kernel
    out = pl.pallas_call(
        kernel,
        grid=(P, tiles, S),
        in_specs=[whole] * (4 if E2 else 3),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((S, P, Dout), jnp.float32),
        interpret=interpret,
        compiler_params=params,
        name="jspec_expert_matmul",
    )(ids.astype(jnp.int32), x, w, *(() if extra is None else (extra,)))
    return out[0] if S == 1 else jnp.sum(out, axis=0)


# --------------------------------------------------------------------------- routed experts

def _check_experts(x_pairs, ids, gate_up, down, extra=None) -> None:
    """Raises ValueError / TypeError for arguments `routed_experts` does not take."""
    if getattr(gate_up, "ndim", None) != 3 or getattr(down, "ndim", None) != 3:
        raise ValueError(f"gate_up must be [E, D, 2Fm] and down [E, Fm, D], got "
                         f"{getattr(gate_up, 'shape', gate_up)} and {getattr(down, 'shape', down)}")
    E, D, F2 = gate_up.shape
    if down.shape != (E, F2 // 2, D) or F2 % 2:
        raise ValueError(f"down {down.shape} does not match gate_up {gate_up.shape} "
                         f"(want [E, Fm, D] = {(E, F2 // 2, D)})")
    if gate_up.dtype != down.dtype:
        raise TypeError(f"gate_up and down dtypes differ: {gate_up.dtype}, {down.dtype}")
    extra_gu, extra_down = (None, None) if extra is None else extra
    _check_matmul(x_pairs, ids, gate_up, extra_gu)
    _check_matmul(jax.ShapeDtypeStruct((x_pairs.shape[0], F2 // 2), x_pairs.dtype), ids, down, extra_down)
    if extra is not None and extra_gu.shape[0] != extra_down.shape[0]:
        raise ValueError(f"extra experts: gate_up {extra_gu.shape} and down {extra_down.shape} hold "
                         f"different numbers of experts")


def is_supported(x_pairs, ids, gate_up, down, extra=None) -> bool:
    """Whether `routed_experts` takes these arguments (the dispatch falls back to the
    reference when not)."""
    try:
        _check_experts(x_pairs, ids, gate_up, down, extra)
    except (TypeError, ValueError):
        return False
    return True


def routed_experts(x_pairs, ids, gate_up, down, extra=None, *, interpret: bool | None = None,
                   gate_up_tiles: dict | None = None, down_tiles: dict | None = None):
    """The routed experts of (token, expert) pairs with the Pallas kernel: x_pairs [P, D]
    (each pair's token activation), ids [P] int (its expert), gate_up [E, D, 2Fm], down
    [E, Fm, D] -> [P, D] float32; extra: (gate_up [E2, D, 2Fm], down [E2, Fm, D]) of
    experts E.. E+E2-1 (shared experts), read in the same products. Same roundings as
    `routed_experts_reference` up to the last product, which stays float32. *_tiles:
    `expert_matmul`'s tiling arguments for each product (default: its defaults)."""
    _check_experts(x_pairs, ids, gate_up, down, extra)
    extra_gu, extra_down = (None, None) if extra is None else extra
    Fm = down.shape[1]
    h = expert_matmul(x_pairs, ids, gate_up, extra_gu, interpret=interpret, **(gate_up_tiles or {}))
    h = h.astype(x_pairs.dtype)  # the reference's product is in the activations' dtype
    a = jax.nn.silu(h[:, :Fm]) * h[:, Fm:]
    return expert_matmul(a, ids, down, extra_down, interpret=interpret, **(down_tiles or {}))


def uses_kernel(x_pairs, ids, gate_up, down, extra=None) -> bool:
    """Whether `moe_experts` takes the Pallas kernel for these arguments (see the dispatch)."""
    if dispatch.backend() == "reference":
        return False
    return dispatch.want_pallas(dispatch.backend() == "pallas" or
                                is_supported(x_pairs, ids, gate_up, down, extra))


def moe_experts(x_pairs, ids, gate_up, down, extra=None):
    """Dispatch: `routed_experts` (the kernel) where `uses_kernel`, else
    `routed_experts_reference`; same arguments, [P, D] float32. JSPEC_KERNELS=pallas forces
    the kernel (interpret mode off GPU; raises for arguments it does not take)."""
    if uses_kernel(x_pairs, ids, gate_up, down, extra):
        return routed_experts(x_pairs, ids, gate_up, down, extra)
    return routed_experts_reference(x_pairs, ids, gate_up, down, extra)
