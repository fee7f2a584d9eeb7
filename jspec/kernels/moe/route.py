"""MoE routing (DeepSeek-V2/V3 rules) as one Pallas (Triton) kernel, beside its jnp
reference: router logits -> each token's experts and weights, as the routing table the
expert kernel reads (`jspec.kernels.moe.experts`).

The table: ids and weights [N, KP], KP the smallest power of two >= k + num_extra.
Columns 0..k-1 hold the k chosen experts, best first (ties: the lower expert id first, as
`lax.top_k`), with their weights; columns k..k+num_extra-1 the extra (shared) experts
E.. E+num_extra-1 with weight 1; the rest is padding (id 0, weight 0).

In XLA the routing of one decoding token is four kernels of 1-3 us on the H200 (softmax,
a sort for the top-k, the gather of the weights, the concatenation with the shared
experts). The kernel does it in one: a program per token holds the token's E logits as a
[G, E/G] tile (groups by rows, padded to powers of two with -inf), computes the scores,
keeps the topk_group best groups where the method limits groups, then takes the k best
experts one at a time (the maximum, the lowest id holding it, removed from the rest).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels import dispatch
from jspec.kernels.moe.experts import ExpertTiles, expert_matmul, normed, prologue_norm
from jspec.kernels.tiling import is_pow2, pow2_ceil


@dataclasses.dataclass(frozen=True)
class RouteTiles:
    """Where the router product runs (`Tuning.route`; the routing kernel itself has no
    tiles)."""

    kernel_product_tokens: int = 16  # up to this many tokens the router product runs in the expert kernel
    block_k: int = 64  # its rows a program (K splits: the router weight is read by many SMs)

SCORINGS = ("softmax", "sigmoid")
METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a MoE layer picks each token's experts (static: part of the compile key).

    scoring: softmax (V2) or sigmoid (V3) scores of the router logits; method: greedy
    (the k best), group_limited_greedy (V2: only the topk_group groups with the best
    maximum), noaux_tc (V3: only the topk_group groups with the best sum of their two best
    choice values; the choice adds the score-correction bias, the weights do not);
    norm_topk_prob: weights divided by their sum (k > 1); scaling: routed_scaling_factor;
    num_extra: shared experts appended to every token with weight 1."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    scaling: float = 1.0
    num_extra: int = 0

    def __post_init__(self):
        if self.scoring not in SCORINGS or self.method not in METHODS:
            raise ValueError(f"routing: scoring must be one of {SCORINGS} and method one of {METHODS}, got "
                             f"{self.scoring!r}, {self.method!r}")
        if not 1 <= self.top_k <= self.num_experts or self.num_extra < 0:
            raise ValueError(f"routing: top_k {self.top_k} must be in [1, {self.num_experts}] experts, "
                             f"num_extra {self.num_extra} >= 0")
        if self.grouped and (self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group
                             or self.topk_group * (self.num_experts // self.n_group) < self.top_k):
            raise ValueError(f"routing: {self.num_experts} experts in {self.n_group} groups, keeping "
                             f"{self.topk_group} groups, cannot give {self.top_k} experts a token")

    @property
    def grouped(self) -> bool:
        """Whether only the topk_group best groups are eligible."""
        return self.method != "greedy" and self.n_group > 1

    @property
    def slots(self) -> int:
        """Pairs a token: its k routed experts and the extra ones."""
        return self.top_k + self.num_extra

    @property
    def table_width(self) -> int:
        """KP: columns of the routing table (a power of two >= slots)."""
        return pow2_ceil(self.slots)


# --------------------------------------------------------------------------- reference

def router_logits(x, w):
    """x [N, D] (the normalised activations), w [D, E] float32 -> logits [N, E] float32,
    the products in float32."""
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)


def route_reference(r: Routing, logits, bias=None):
    """Router logits [N, E] float32, or K splits of them [S, N, E] (and V3's
    score-correction bias [E]) -> the routing table (weights [N, KP] float32, ids [N, KP]
    int32); see the module docstring."""
    if logits.ndim == 3:  # K splits of the logits
        logits = jnp.sum(logits, axis=0)
    N, E = logits.shape
    k, G = r.top_k, r.n_group
    scores = jax.nn.sigmoid(logits) if r.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias if bias is not None else scores
    if r.grouped:  # keep the topk_group best groups
        grouped = choice.reshape(N, G, E // G)
        if r.method == "noaux_tc":
            group_score = lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_score = grouped.max(-1)
        keep = lax.top_k(group_score, r.topk_group)[1]  # [N, topk_group]
        group_ok = jnp.zeros((N, G), bool).at[jnp.arange(N)[:, None], keep].set(True)
        hidden = -jnp.inf if r.method == "noaux_tc" else 0.0
        choice = jnp.where(jnp.repeat(group_ok, E // G, axis=1), choice, hidden)
    ids = lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if r.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    pad = r.table_width - r.slots
    ids = jnp.concatenate([ids.astype(jnp.int32), jnp.broadcast_to(jnp.arange(E, E + r.num_extra, dtype=jnp.int32),
                                                                   (N, r.num_extra)),
                           jnp.zeros((N, pad), jnp.int32)], axis=1)
    weights = jnp.concatenate([weights * r.scaling, jnp.ones((N, r.num_extra), jnp.float32),
                               jnp.zeros((N, pad), jnp.float32)], axis=1)
    return weights, ids


# --------------------------------------------------------------------------- kernel

def _kernel(logits_ref, *rest, r: Routing, group_size: int):
    """One token n. logits_ref [S, N, G, EGp] float32 (K splits of the token's logits by
    group, summed here; columns from group_size on padding at -inf); with a bias, bias_ref
    [G, EGp] float32; w_ref and ids_ref [N, KP] (whole; this program writes row n)."""
    bias_ref, w_ref, ids_ref = rest if len(rest) == 3 else (None,) + rest
    n = pl.program_id(0)
    x = sum(logits_ref[i, n] for i in range(logits_ref.shape[0]))  # [G, EGp]
    G, EGp = x.shape
    KP = w_ref.shape[1]
    col = lax.broadcasted_iota(jnp.int32, (G, EGp), 1)
    expert = lax.broadcasted_iota(jnp.int32, (G, EGp), 0) * group_size + col  # the expert id of each entry
    valid = col < group_size
    ninf = jnp.float32(-jnp.inf)

    def all_max(v):
        return jnp.max(jnp.max(v, axis=1), axis=0)

    if r.scoring == "softmax":
        e = jnp.exp(x - all_max(x))
        scores = e / jnp.sum(jnp.sum(e, axis=1), axis=0)
    else:
        scores = jax.nn.sigmoid(x)
    choice = scores + bias_ref[...] if bias_ref is not None else scores
    choice = jnp.where(valid, choice, ninf)
    if r.grouped:
        best = jnp.max(choice, axis=1)  # [G]
        if r.method == "noaux_tc":  # the sum of each group's two best values
            first = jnp.min(jnp.where(choice == best[:, None], col, EGp), axis=1)
            best = best + jnp.max(jnp.where(col == first[:, None], ninf, choice), axis=1)
        group = lax.broadcasted_iota(jnp.int32, (G,), 0)
        keep = jnp.zeros((G,), jnp.bool_)
        for _ in range(r.topk_group):
            top = jnp.max(best)
            g = jnp.min(jnp.where(best == top, group, G))
            keep = keep | (group == g)
            best = jnp.where(group == g, ninf, best)
        hidden = ninf if r.method == "noaux_tc" else jnp.float32(0.0)
        choice = jnp.where(keep[:, None] | ~valid, choice, hidden)

    slot = lax.broadcasted_iota(jnp.int32, (KP,), 0)
    ids = jnp.zeros((KP,), jnp.int32)
    weights = jnp.zeros((KP,), jnp.float32)
    left = valid  # entries not taken yet
    for t in range(r.top_k):
        top = all_max(jnp.where(left, choice, ninf))
        e = jnp.min(jnp.min(jnp.where(left & (choice == top), expert, r.num_experts), axis=1), axis=0)
        chosen = left & (expert == e)
        ids = jnp.where(slot == t, e, ids)
        weights = jnp.where(slot == t, jnp.sum(jnp.sum(jnp.where(chosen, scores, 0.0), axis=1), axis=0), weights)
        left = left & ~chosen
    if r.norm_topk_prob and r.top_k > 1:
        weights = weights / (jnp.sum(weights) + 1e-20)
    weights = weights * r.scaling
    extra = (slot >= r.top_k) & (slot < r.slots)
    ids_ref[n, :] = jnp.where(extra, r.num_experts + slot - r.top_k, ids)
    w_ref[n, :] = jnp.where(extra, 1.0, weights)


def _check(r: Routing, logits, bias) -> None:
    """Raises ValueError / TypeError for arguments `route_kernel` does not take."""
    if not isinstance(r, Routing):
        raise TypeError(f"routing must be a Routing, got {type(r).__name__}")
    if getattr(logits, "ndim", None) not in (2, 3) or logits.shape[-1] != r.num_experts or 0 in logits.shape:
        raise ValueError(f"logits must be [N, {r.num_experts}] or its K splits [S, N, {r.num_experts}], got "
                         f"{getattr(logits, 'shape', logits)}")
    if logits.dtype != jnp.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    if bias is not None and (getattr(bias, "shape", None) != (r.num_experts,) or bias.dtype != jnp.float32):
        raise ValueError(f"bias must be float32 [{r.num_experts}], got {getattr(bias, 'dtype', '')} "
                         f"{getattr(bias, 'shape', bias)}")
    G = r.n_group if r.grouped else 1
    if not is_pow2(G):
        raise ValueError(f"the kernel takes a power-of-two number of groups, got {G}")


def is_supported(r: Routing, logits, bias=None) -> bool:
    """Whether `route_kernel` takes these arguments."""
    try:
        _check(r, logits, bias)
    except (TypeError, ValueError):
        return False
    return True


def route_kernel(r: Routing, logits, bias=None, *, interpret: bool | None = None):
    """`route_reference` (same arguments and result) as one Pallas kernel, a program per
    token. interpret None: interpret mode unless the default backend is a GPU."""
    _check(r, logits, bias)
    if logits.ndim == 2:
        logits = logits[None]
    _, N, E = logits.shape
    G = r.n_group if r.grouped else 1
    EG = E // G
    EGp = max(2, pow2_ceil(EG))

    def by_group(v):  # [..., E] -> [..., G, EGp], padding at -inf
        v = v.reshape(v.shape[:-1] + (G, EG))
        return jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, EGp - EG)], constant_values=-jnp.inf)

    args = [by_group(logits)] + ([] if bias is None else [by_group(bias)])
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=1, num_stages=1)
    KP = r.table_width
    whole = pl.BlockSpec()
    weights, ids = pl.pallas_call(
        functools.partial(_kernel, r=r, group_size=EG),
        grid=(N,),
        in_specs=[whole] * len(args),
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((N, KP), jnp.float32), jax.ShapeDtypeStruct((N, KP), jnp.int32)],
        interpret=interpret,
        compiler_params=params,
        name="jspec_moe_route",
    )(*args)
    return weights, ids


def uses_kernel(r: Routing, logits, bias=None) -> bool:
    """Whether `route` takes the Pallas kernels (see `jspec.kernels.dispatch`)."""
    if dispatch.backend() == "reference":
        return False
    return dispatch.want_pallas(dispatch.backend() == "pallas" or is_supported(r, logits, bias))


def route(r: Routing, x, w, bias=None, norm=None, *, tiles: RouteTiles | None = None,
          expert_tiles: ExpertTiles | None = None, rows_alone: bool = False):
    """The routing table of x [N, D] (the normalised activations; or, with norm (weight
    [D], eps), the activations that RMSNorm normalises first) with the router w [D, E]
    float32 (and V3's score-correction bias [E]): (weights [N, KP] float32, ids [N, KP]
    int32), see the module docstring.

    Dispatch: with the kernels, up to `tiles.kernel_product_tokens` tokens take the
    router product from the expert kernel (`moe_experts.expert_matmul` with
    `expert_tiles`, w as one expert, float32 products, `tiles.block_k` rows a
    program) as K splits that `route_kernel` sums: two kernels, where XLA's one-row product
    is a padded product, a reduction of its splits and a slice. More tokens take XLA's
    product, then `route_kernel`. Without: `router_logits`, then `route_reference`. The norm
    runs in the expert kernel's prologue where that product runs, else before the product.
    tiles, expert_tiles (`Tuning.route`, `Tuning.experts`) None: the defaults. rows_alone (`Tuning.row_invariant`): the expert kernel's
    product for any number of tokens (its sums follow the weight's shape only)."""
    t = RouteTiles() if tiles is None else tiles
    N, E = x.shape[0], w.shape[1]
    probe = jax.ShapeDtypeStruct((N, E), jnp.float32)
    kernels = uses_kernel(r, probe, bias)
    if not (kernels and (N <= t.kernel_product_tokens or rows_alone) and min(E, x.shape[1]) >= 16):  # (16: the expert kernel's tiles)
        logits = router_logits(normed(x, norm), w)
        return route_kernel(r, logits, bias) if kernels else route_reference(r, logits, bias)
    D = x.shape[1]
    x, norm = prologue_norm(x, norm)
    splits = max(1, D // t.block_k)  # a program per chunk of rows: the weight is read by many SMs
    partials = expert_matmul(x, jnp.zeros((N, 1), jnp.int32), w[None], sum_splits=False, num_splits=splits,
                             block_k=t.block_k, norm=norm, tiles=expert_tiles)  # [S, N, E]
    return route_kernel(r, partials, bias)
