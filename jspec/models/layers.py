"""Flax layers every family shares: the products (`product`: row-invariant, native CPU and
padded one-row paths; `Linear`), `RMSNorm`, rotary embeddings (`apply_rope`), the decoder's
ends (`DecoderLM`: embedding and LM head) and `FlaxFamily`, the target-family protocol's
model methods for a `DecoderLM`. Llama (`models.llama`), DeepSeek, Qwen3-Next and the draft
models build on them.

Projection weights are stored [in, out] (`kernel`, Hugging Face's [out, in] transposed at
load time).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jspec import sharding
from jspec.quantization import dequantize_kernel
from jspec.cache.layout import prefill_meta
from jspec.kernels import dispatch
from jspec.kernels.cpu import matmul as cpu_matmul
from jspec.kernels.fp8 import matmul as fp8_matmul, mosaic as fp8_mosaic, w8a8 as fp8_w8a8
from jspec.kernels.meta import AttnMeta
from jspec.kernels.moe import experts as moe_experts
from jspec.kernels.row import matmul as row_matmul, norm as row_norm
from jspec.models.family import TargetFamily
from jspec.tuning import DEFAULT_TUNING, Tuning

INIT = nn.initializers.normal(0.02)  # every family's weight initializer


def rows_alone(tuning: Tuning, meta: AttnMeta) -> bool:
    """Whether a pass computes each token alone (`Tuning.row_invariant`): not in a prefill,
    which plain and speculative programs share (`loop.rows.prompt_pass` also turns it off
    for prompt chunks)."""
    return bool(tuning.row_invariant) and not meta.prefill


def pad_one_row(rows: int, weight_elements: int, tuning: Tuning = DEFAULT_TUNING) -> bool:
    """Whether a product of `rows` rows with a weight of `weight_elements` elements runs
    padded to two rows: one row, a weight of `tuning.two_row_elements` [lo, hi) elements,
    a backend of `tuning.two_row_backends` (XLA's GPU compiler turns such products into a
    multiply plus a reduction, see `Tuning`)."""
    lo, hi = tuning.two_row_elements
    return rows == 1 and lo <= weight_elements < hi and jax.default_backend() in tuning.two_row_backends


def product(x: jax.Array, w: jax.Array, transpose_w: bool = False, float32_out: bool = False,
            tuning: Tuning = DEFAULT_TUNING, row_invariant: bool = False, norm=None) -> jax.Array:
    """x [..., K] @ w [K, N] (or w [N, K] transposed: a tied head) -> [..., N], accumulated
    in float32 (kept as float32 with `float32_out`); norm (weight, eps): x RMS-normed first
    (`moe_experts.rms_norm`). row_invariant: the row-invariant kernel (`kernels.row.matmul`,
    tiles `tuning.row_matmul`; the norm by `kernels.row.norm`) where the backend runs
    kernels and the shapes fit it. Few-row float32 products on the CPU
    run jspec's native loops (`kernels.cpu.matmul`, up to `tuning.cpu_matmul_max_rows`
    rows), everything else XLA's dot (one-row products with mid-sized weights on the GPU
    padded to two rows: `pad_one_row`)."""
    if row_invariant and row_matmul.supported(x, w, transpose_w, tuning.row_matmul) and dispatch.want_pallas(True):
        normed = x if norm is None else row_norm.rms_norm(x, *norm, tiles=tuning.row_norm)
        y = row_matmul.row_matmul(normed, w, transpose_w=transpose_w, tiles=tuning.row_matmul)
        return y if float32_out else y.astype(w.dtype)
    x = moe_experts.normed(x, norm).astype(w.dtype)
    if cpu_matmul.use_native(x, w, tuning.cpu_matmul_max_rows):
        return cpu_matmul.matmul(x, w, transpose_w=transpose_w)
    pad = pad_one_row(x.size // x.shape[-1], w.size, tuning)
    xs = jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0))) if pad else x
    y = jax.lax.dot_general(xs, w, (((xs.ndim - 1,), (1 if transpose_w else 0,)), ((), ())),
                            preferred_element_type=jnp.float32 if float32_out else None)
    return y[:1].reshape(x.shape[:-1] + y.shape[-1:]) if pad else y


def fp8_product(x: jax.Array, w: jax.Array, scale: jax.Array, dtype, tuning: Tuning = DEFAULT_TUNING,
                float32_out: bool = False, norm=None) -> jax.Array | None:
    """x [..., K] @ an FP8 kernel w [K, N] with its `kernel_scale` [ceil(K / GROUP), N] ->
    [..., N] in `dtype` (float32 with `float32_out`) through the first FP8 kernel that takes
    it, or None where none does (the caller dequantizes): from `tuning.fp8_w8a8.min_rows`
    rows on Hopper the w8a8 kernel, up to `tuning.fp8.mosaic_rows` rows on Hopper the Mosaic
    kernel, other products of up to `tuning.fp8.max_rows` rows on a GPU the Triton one.
    norm (weight, eps): x RMS-normed first, as `product` norms."""
    probe, f8 = x.astype(dtype), tuning.fp8
    if fp8_w8a8.uses_kernel(probe, w, scale, tuning.fp8_w8a8):
        kernel = functools.partial(fp8_w8a8.fp8_w8a8_mosaic, tiles=tuning.fp8_w8a8)
    elif fp8_mosaic.uses_kernel(probe, w, scale, f8):
        if norm is not None:  # the rows' float16 bound from the norm's own pass
            xn, top = moe_experts.normed_with_top(x, norm)
            return fp8_mosaic.fp8_matmul_mosaic(xn.astype(dtype), w, scale, float32_out=float32_out, top=top,
                                                tiles=tuning.fp8_mosaic)
        kernel = functools.partial(fp8_mosaic.fp8_matmul_mosaic, tiles=tuning.fp8_mosaic)
    elif fp8_matmul.uses_kernel(probe, w, scale, f8):
        kernel = functools.partial(fp8_matmul.fp8_matmul, tiles=f8)
    else:
        return None
    return kernel(moe_experts.normed(x, norm).astype(dtype), w, scale, float32_out=float32_out)


def project(x: jax.Array, p: dict, dtype, tuning: Tuning = DEFAULT_TUNING, float32_out: bool = False,
            norm=None) -> jax.Array:
    """x [..., K] through a projection's params {kernel[, kernel_scale]} (not a `Linear`'s
    module: a dense MLP's or a shared expert's) -> [..., N]: an FP8 kernel through
    `fp8_product` where a kernel takes it, else `product` over the kernel in `dtype` (an
    FP8 one dequantized in the graph)."""
    if "kernel_scale" in p:
        y = fp8_product(x, p["kernel"], p["kernel_scale"], dtype, tuning, float32_out, norm)
        if y is not None:
            return y
        return product(x, dequantize_kernel(p["kernel"], p["kernel_scale"], dtype), float32_out=float32_out,
                       tuning=tuning, norm=norm)
    return product(x, p["kernel"], float32_out=float32_out, tuning=tuning, norm=norm)


def loaded_param(module: nn.Module, name: str, init):
    """`module.param(name, init)`, but a group of params already given (loaded weights) is
    read as it is: an FP8 one carries scales beside its arrays (`kernel_scale`,
    `gate_up_scale`, ...) that random initialisation does not make, so flax's check against
    the initializer's structure does not apply."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, init)


class Linear(nn.Module):
    """y = x W + b with the weight `kernel` [in, out] (Hugging Face's [out, in] transposed:
    XLA's batch-1 products stream this layout faster, see docs/benchmarks.md).

    An FP8 kernel comes with `kernel_scale` [ceil(in / GROUP), out] float32 (`jspec.quantization`,
    kept FP8 in device memory): up to `Tuning.fp8.mosaic_rows` bfloat16 (or float16) rows on
    a Hopper GPU run `kernels.fp8.mosaic` (`mosaic.uses_kernel`), other products of up to
    `Tuning.fp8.max_rows` rows on a GPU `kernels.fp8.matmul`; both read the FP8 bytes.
    Products of at least `Tuning.fp8_w8a8.min_rows` rows (65 by default; 0: never) on a
    Hopper GPU run `kernels.fp8.w8a8` (the rows rounded to E4M3 too). Other products (more
    rows on other GPUs, the CPU, row-invariant passes) dequantize the kernel into the
    compute dtype in the graph first (`dequantize_kernel`)."""

    features: int
    use_bias: bool = False
    dtype: str = "float32"
    float32_out: bool = False  # keep the float32 accumulator (LM heads)
    row_kernel: bool = False  # few-row products through `moe_experts.matvec` where it applies
    tuning: Tuning = DEFAULT_TUNING  # the row kernel's tiles (`experts`) and `product`'s rules

    @nn.compact
    def __call__(self, x, norm_factor=None, norm=None, splits: bool = False, row_invariant: bool = False):
        """x [..., in] -> [..., out]; `norm_factor` [..., 1] float32 multiplies the product
        before the bias (a deferred RMSNorm factor, see `RMSNorm`); `norm` (weight, eps):
        x is RMS-normed first (`RMSNorm(..., unapplied=True)`; in the row kernel's
        prologue when it runs). splits: return the row kernel's K splits [S, rows, out]
        float32 unsummed (`moe_experts.matvec`; only where `uses_splits`; with row_invariant
        and no norm, `row_matmul`'s, which must take the weight). row_invariant: `product`'s
        (`rows_alone`)."""
        w = self.param("kernel", INIT, (x.shape[-1], self.features), jnp.dtype(self.dtype))
        if self.has_variable("params", "kernel_scale"):
            scale = self.get_variable("params", "kernel_scale")
            if not (splits or row_invariant):
                y = fp8_product(x, w, scale, self.dtype, self.tuning, self.float32_out, norm)
                if y is not None:
                    return self.finish(y, norm_factor)
            w = dequantize_kernel(w, scale, self.dtype)
        if splits and row_invariant and not self.use_bias and norm is None:
            return row_matmul.row_matmul(x.reshape(-1, x.shape[-1]), w, tiles=self.tuning.row_matmul,
                                         sum_splits=False)
        if splits:
            if not self.uses_splits(x):
                raise ValueError("Linear(splits=True) needs the row kernel for this product and no bias")
            return moe_experts.matvec(x, w, norm, sum_splits=False, tiles=self.tuning.experts)
        if self.row_kernel and not row_invariant and moe_experts.uses_matvec(x, w, self.tuning.experts):
            y = moe_experts.matvec(x, w, norm, float32_out=self.float32_out, tiles=self.tuning.experts)
        else:
            # Products accumulate in float32 either way; asking for a float32 result only
            # where it is kept avoids a separate conversion pass after every matrix-vector
            # product.
            y = product(x, w, float32_out=self.float32_out, tuning=self.tuning, row_invariant=row_invariant,
                        norm=norm)
        return self.finish(y, norm_factor)

    def finish(self, y, norm_factor):
        """The product y [..., out] times `norm_factor`, plus the bias."""
        if norm_factor is not None:  # fuses into the product's consumer
            y = (y.astype(jnp.float32) * norm_factor).astype(y.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.dtype(self.dtype)).astype(y.dtype)
        return y

    def uses_splits(self, x) -> bool:
        """Whether `__call__(x, splits=True)` applies: the row kernel runs x's product and
        there is no bias to add."""
        w = jax.ShapeDtypeStruct((x.shape[-1], self.features), jnp.dtype(self.dtype))
        return self.row_kernel and not self.use_bias and moe_experts.uses_matvec(x, w, self.tuning.experts)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers does.

    deferred=True returns (w * x, r) with the float32 factor r [..., 1] left for the
    caller to apply after its projection: W (w * x * r) = r * W (w * x). XLA then computes
    the gain product in the same kernel as the sum of squares and applies r in the
    projection's consumer, one kernel fewer per norm in a decode step.

    unapplied=True returns the norm as (weight, eps) for a `Linear(...)(x, norm=...)`,
    which norms x itself (in the row kernel's prologue: no kernel for the norm).

    row_invariant (a call argument, `rows_alone`): the
    row-invariant kernel (`kernels.row.norm`) where the backend runs kernels; a deferred
    norm is then applied at once (its factor is None).
    """

    eps: float
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x, deferred: bool = False, unapplied: bool = False, row_invariant: bool = False):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.dtype(self.dtype))
        if unapplied:
            return w, self.eps
        if row_invariant and row_norm.supported(x, w) and dispatch.want_pallas(True):
            y = row_norm.rms_norm(x, w, self.eps)
            return (y, None) if deferred else y
        if deferred:
            xf = x.astype(jnp.float32)
            return w * x, jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return moe_experts.rms_norm(x, w, self.eps)


def apply_rope(x, positions, inv_freq: np.ndarray, scale: float = 1.0):
    """x [B,T,h,Dh] rotated by positions [B,T] (rotate-half layout, as transformers:
    x * [cos, cos] + [-x2, x1] * [sin, sin], computed per half with the same roundings);
    `scale` multiplies cos and sin (YaRN's attention factor)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [B,T,Dh/2]
    cos = (jnp.cos(freqs) * scale).astype(x.dtype)[:, :, None, :]
    sin = (jnp.sin(freqs) * scale).astype(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def after_input(weights, x, meta: AttnMeta):
    """A layer's `weights` as they are; in a prompt's pass (`meta.prefill` or
    `meta.causal_block`) held back until its input `x` exists (an optimization barrier):
    what is computed from the weights alone (an FP8 projection dequantized for the pass)
    cannot be scheduled before the layer, where it would be live from the program's start,
    every layer's at once (docs/experiments.md, "Dequantized projections live from the
    start"). Not in decoding and verification, where XLA takes such work out of the loop
    of rounds (V2-Lite's FP8 step at batch 1 was 3.6% dearer with the barrier there).
    Every layer of a stack takes its weights through this."""
    if not (meta.prefill or meta.causal_block):
        return weights
    return jax.lax.optimization_barrier((weights, x))[0]


@functools.cache
def _layer_program(module_type: type, fields: tuple, backend: str):
    """One jitted `apply` of a layer definition: its module rebuilt from `fields`; one per
    kernel backend (`dispatch.backend()`, read while tracing: jit's traces do not know it)."""
    module = module_type(**dict(fields), parent=None)  # unbound, whatever module calls this

    def apply(variables, *args):
        return module.apply(after_input(variables, args[0], args[-1]), *args)  # (x, ..., meta)
    apply.__name__ = apply.__qualname__ = module_type.__name__  # the name of its calls in a program
    return jax.jit(apply)


def call_layer(layer: nn.Module, *args, same: dict | None = None):
    """`layer(*args)` for a bound layer of a model's stack, through one jitted function per
    layer definition (its fields but parent and name, with `same`'s values: fields that
    name a layer of the same kind, e.g. the first layer index of its kind): inside a
    program's trace the layers of one definition and argument shapes are traced and
    lowered to MLIR once and called from each place (XLA inlines the calls, so the
    compiled program is the one the unrolled layers give). A deep model's programs are
    traced and lowered in a fraction of the time. While initializing: the plain call."""
    if layer.is_initializing():
        return layer(*args)
    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer) if f.name not in ("parent", "name")}
    definition = tuple((fields | (same or {})).items())
    return _layer_program(type(layer), definition, dispatch.backend())(layer.variables, *args)


class DecoderLM(nn.Module):
    """What decoder families share: the embedding and the LM head (tied to the embedding or
    a `lm_head` Linear). A subclass has the fields `cfg` and `tuning` (passed down to its
    layers); its `setup` makes `embed_tokens` (and `lm_head` when untied) and its
    `__call__` runs tokens -> (final-norm hidden, aux, cache)."""

    def setup_ends(self, norm):
        """From `setup`: the embedding, the final norm `norm` (a module) and, untied, the LM head."""
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=INIT, dtype=c.jnp_dtype,
                                     param_dtype=c.jnp_dtype)
        self.norm = norm
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, c.dtype, float32_out=True, tuning=self.tuning)

    def logits(self, hidden):
        """hidden [..., D] -> float32 logits [..., V] (`Tuning.row_invariant`: by the row kernel)."""
        ri = self.tuning.row_invariant
        if self.cfg.tie_word_embeddings:
            return product(hidden, self.embed_tokens.embedding, transpose_w=True, float32_out=True,
                           tuning=self.tuning, row_invariant=ri)
        return self.lm_head(hidden, row_invariant=ri)

    def embed(self, tokens):
        """tokens [...] -> embeddings [..., D] (`sharding.lookup_rows`: per device under a mesh)."""
        return sharding.lookup_rows(self.embed_tokens.embedding, tokens).astype(self.cfg.jnp_dtype)

    def init_all(self, tokens, cache, meta):
        """Touches every parameter (for `init`): the forward pass and the LM head."""
        return self.logits(self(tokens, cache, meta)[0])


class FlaxFamily(TargetFamily):
    """The protocol's model methods for a family whose model is a `DecoderLM` subclass
    (`model`) taking its config and a `Tuning` as its fields."""

    model: type

    def init_weights(self, cfg, key):
        tokens = jnp.zeros((1, 2), jnp.int32)
        return self.model(cfg).init(key, tokens, None, prefill_meta(jnp.full((1,), 2, jnp.int32), 2),
                                    method=self.model.init_all)

    def forward(self, cfg, weights, tokens, cache, meta: AttnMeta, capture: tuple[int, ...] = (),
                tuning=DEFAULT_TUNING):
        """tokens [B,T] -> (hidden [B,T,D] after the final norm, {layer: its input [B,T,D]}
        for the `capture` layers, cache); `tuning` goes down to the layers and kernels."""
        return self.model(cfg, tuning).apply(weights, tokens, cache, meta, capture)

    def logits(self, cfg, weights, hidden, tuning=DEFAULT_TUNING):
        """hidden [..., D] -> float32 logits [..., V]."""
        return self.model(cfg, tuning).apply(weights, hidden, method=self.model.logits)

    def embed(self, cfg, weights, tokens):
        """tokens [...] -> embeddings [..., D]."""
        return self.model(cfg).apply(weights, tokens, method=self.model.embed)
