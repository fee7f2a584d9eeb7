"""The Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral) as Flax modules.

Projection weights are stored [in, out] (`kernel`, Hugging Face's [out, in] transposed at
load time); q/k/v and gate/up are fused into one matrix each (`qkv_proj`, `gate_up_proj`;
column order in `llama_hf`) so a decode step reads them in one pass. Layers are unrolled
(a scanned layer stack copies weight slices and loses bandwidth), each called through one
jitted function of their definition (`layers.call_layer`), so a program traces one.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from jspec.cache.kv import KVCache, KVCacheKind, cached_attention
from jspec.config import ModelConfig
from jspec.tuning import DEFAULT_TUNING, Tuning
from jspec.kernels.row import matmul as row_matmul, norm as row_norm
from jspec.kernels.meta import AttnMeta
from jspec.kernels.tiling import is_pow2
from jspec import sharding
from jspec.models import llama_hf
from jspec.models.family import row_invariant_measured_cheap
from jspec.models.layers import DecoderLM, FlaxFamily, call_layer, Linear, RMSNorm, apply_rope, rows_alone
from jspec.tensors import HostParam

# `Tuning.row_invariant=None` turns it on for targets up to this hidden size at every batch
# (measured cheaper at 256; sizes between 256 and 4096 not measured), and for every target
# in programs of up to ROW_INVARIANT_AUTO_MAX_BATCH rows on GPUs where it was measured
# cheap (`LlamaFamily.row_invariant_by_default`, `family.ROW_INVARIANT_CHEAP_GPUS`).
ROW_INVARIANT_AUTO_MAX_HIDDEN = 1024
ROW_INVARIANT_AUTO_MAX_BATCH = 1


class Attention(nn.Module):
    """Self-attention with fused qkv, optional q/k norms (Qwen3), RoPE and the KV cache."""

    cfg: ModelConfig
    window: int = 0
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, kv, meta: AttnMeta, norm_factor=None):
        """x [B,T,D]; kv: the layer's cache buffer (see jspec.cache.kv) or None; norm_factor:
        a deferred input-norm factor [B,T,1] (see `RMSNorm`). -> (out [B,T,D], new buffer)."""
        c = self.cfg
        B, T, _ = x.shape
        H, Hkv, Dh = c.num_heads, c.num_kv_heads, c.head_dim
        G = H // Hkv
        ri = rows_alone(self.tuning, meta)
        qkv = Linear((H + 2 * Hkv) * Dh, c.qkv_bias, c.dtype, tuning=self.tuning, name="qkv_proj")(
            x, norm_factor, row_invariant=ri)
        qkv = qkv.reshape(B, T, Hkv, G + 2, Dh)  # per KV head: its G query heads, key, value
        q = qkv[:, :, :, :G].reshape(B, T, H, Dh)
        k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, c.dtype, name="q_norm")(q, row_invariant=ri)
            k = RMSNorm(c.rms_norm_eps, c.dtype, name="k_norm")(k, row_invariant=ri)
        inv_freq = c.rope.inv_freq(Dh)
        q = apply_rope(q, meta.positions, inv_freq, c.rope.cos_sin_scale())
        k = apply_rope(k, meta.positions, inv_freq, c.rope.cos_sin_scale())
        kv_scale = self.get_variable("params", "kv_scale") if self.has_variable("params", "kv_scale") else None
        o, kv = cached_attention(q, k, v, kv, meta, window=self.window, scale=Dh ** -0.5,
                                 tiles=self.tuning.attention,
                                 row_tiles=self.tuning.row_attention if ri else None, kv_scale=kv_scale)
        out = Linear(c.hidden_size, c.o_bias, c.dtype, tuning=self.tuning, name="o_proj")(
            o.reshape(B, T, H * Dh), row_invariant=ri)
        return out, kv


class MLP(nn.Module):
    cfg: ModelConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, norm_factor=None, row_invariant: bool = False):
        c = self.cfg
        F = c.intermediate_size
        gu = Linear(2 * F, c.mlp_bias, c.dtype, tuning=self.tuning, name="gate_up_proj")(
            x, norm_factor, row_invariant=row_invariant)
        gu = gu.reshape(gu.shape[:-1] + (F, 2))  # gate and up column i side by side
        return Linear(c.hidden_size, c.mlp_bias, c.dtype, tuning=self.tuning, name="down_proj")(
            nn.silu(gu[..., 0]) * gu[..., 1], row_invariant=row_invariant)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    window: int = 0
    input_norm: bool = True  # EAGLE-1 heads skip the first layer's input norm
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, kv, meta):
        c = self.cfg
        # Both norms are deferred: their factor is applied after the projection that follows.
        h, r = x, None
        ri = rows_alone(self.tuning, meta)
        if self.input_norm:
            h, r = RMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(x, deferred=True, row_invariant=ri)
        h, kv = Attention(c, self.window, self.tuning, name="self_attn")(h, kv, meta, r)
        x = x + h
        h, r = RMSNorm(c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x, deferred=True, row_invariant=ri)
        return x + MLP(c, self.tuning, name="mlp")(h, r, row_invariant=ri), kv


class LlamaModel(DecoderLM):
    """Token ids -> final-norm hidden states; `logits` applies the LM head."""

    cfg: ModelConfig
    tuning: Tuning = DEFAULT_TUNING

    def setup(self):
        c = self.cfg
        self.setup_ends(RMSNorm(c.rms_norm_eps, c.dtype))
        self.layers = [DecoderLayer(c, c.sliding_windows[i], tuning=self.tuning, name=f"layers_{i}")
                       for i in range(c.num_layers)]

    def __call__(self, tokens, cache: KVCache | None, meta: AttnMeta, capture: tuple[int, ...] = ()):
        """tokens [B,T] -> (hidden [B,T,D] after the final norm, {layer: its input [B,T,D]}
        for the `capture` layers (index num_layers: the last layer's output), cache)."""
        x = self.embed(tokens)
        aux, kvs = {}, []
        for i, layer in enumerate(self.layers):
            if i in capture:
                aux[i] = x
            x, kv = call_layer(layer, x, None if cache is None else cache.kv[i], meta)
            kvs.append(kv)
        if self.cfg.num_layers in capture:  # the last layer's output, before the final norm
            aux[self.cfg.num_layers] = x
        new_cache = None if cache is None else KVCache(kv=tuple(kvs))
        return self.norm(x, row_invariant=rows_alone(self.tuning, meta)), aux, new_cache

# Tensor parallelism (`jspec.sharding`): how a Llama-architecture module's weights split,
# by the last two keys of their path (a one-key path: an EAGLE-3 head's own embedding).
TP_SPLITS = {
    ("qkv_proj", "kernel"): P(None, sharding.AXIS), ("qkv_proj", "bias"): P(sharding.AXIS),
    ("gate_up_proj", "kernel"): P(None, sharding.AXIS), ("gate_up_proj", "bias"): P(sharding.AXIS),
    ("o_proj", "kernel"): P(sharding.AXIS, None), ("down_proj", "kernel"): P(sharding.AXIS, None),
    ("embed_tokens", "embedding"): P(sharding.AXIS, None), ("lm_head", "kernel"): P(None, sharding.AXIS),
    ("embed",): P(sharding.AXIS, None),
    # FP8 kernels' scales [groups, out] split with their kernels (`jspec.quantization`)
    ("qkv_proj", "kernel_scale"): P(None, sharding.AXIS), ("gate_up_proj", "kernel_scale"): P(None, sharding.AXIS),
    ("o_proj", "kernel_scale"): P(sharding.AXIS, None), ("down_proj", "kernel_scale"): P(sharding.AXIS, None),
}
# Replicated where they do not divide: embeddings and heads, and the scales of a kernel
# whose rows split into fewer groups of 128 than devices (GSPMD then reads each device's).
UNEVEN_REPLICATED = (("embed_tokens", "embedding"), ("lm_head", "kernel"), ("embed",),
                ("o_proj", "kernel_scale"), ("down_proj", "kernel_scale"))


def kv_groups(cfg: ModelConfig, n: int) -> int:
    """KV heads of the model split over n devices: Hkv, or n when the devices outnumber the
    KV heads (each KV head is then repeated n / Hkv times, as SGLang and vLLM do)."""
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    if H % n:
        raise ValueError(f"{H} attention heads cannot be split over {n} devices")
    if cfg.intermediate_size % n:
        raise ValueError(f"an MLP of width {cfg.intermediate_size} cannot be split over {n} devices")
    return sharding.kv_heads_over(Hkv, n)


def split_llama(cfg: ModelConfig, weights, n: int):
    """A Llama-architecture module for n devices -> (config, weights, PartitionSpec tree):
    Megatron's split (`TP_SPLITS`). With more devices than KV heads each KV head's key and
    value columns are repeated and the config has n KV heads; the repeated heads hold the
    same keys and values, so outputs do not change."""
    groups = kv_groups(cfg, n)
    if groups != cfg.num_kv_heads:
        H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cols = np.argsort(llama_hf.qkv_order(H, Hkv, Dh))[llama_hf.qkv_order(H, Hkv, Dh, groups)]

        def repeat(keys, w):
            if keys[-2:-1] != ("qkv_proj",):
                return w
            if isinstance(w, HostParam):
                return w.take_rows(cols)  # a kernel's columns are its source rows
            return jnp.take(w, jnp.asarray(cols), axis=w.ndim - 1)
        weights = sharding.map_weights(repeat, weights)
        cfg = dataclasses.replace(cfg, num_kv_heads=groups)
    return cfg, weights, sharding.weight_specs(weights, n, TP_SPLITS, UNEVEN_REPLICATED)


class LlamaFamily(FlaxFamily):
    """The target-family protocol (`jspec.models.family`) for Llama-architecture decoders."""

    config_type = ModelConfig
    model = LlamaModel
    fp8_weights = True

    architectures = tuple(llama_hf.TARGET_ARCHITECTURES)

    def row_invariant_problem(self, cfg, tuning) -> str | None:
        """A product whose weight the row kernel does not take (`row_matmul.shape_problem`:
        on the GPU it would stay XLA's), or a norm width
        `kernels.row.norm` does not take."""
        t = tuning.row_matmul
        H, Hkv, Dh, D, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        shapes = {"qkv_proj": (D, (H + 2 * Hkv) * Dh), "o_proj": (H * Dh, D), "gate_up_proj": (D, 2 * F),
                  "down_proj": (F, D), "the LM head": (D, cfg.vocab_size)}
        for name, (k, n) in shapes.items():
            if why := row_matmul.shape_problem(k, n, t):
                return f"{why}; {name} is [{k}, {n}]"
        if not row_norm.chunk_of(D) or (cfg.qk_norm and not row_norm.chunk_of(Dh)):
            return f"the row norm takes widths that are multiples of 16 (hidden {D}, head {Dh})"
        if not (is_pow2(Dh) and Dh >= 16):
            return f"the row attention kernel takes head dims that are powers of two >= 16, not {Dh}"
        return None

    def row_invariant_by_default(self, cfg, batch: int, device) -> bool:
        """On up to `ROW_INVARIANT_AUTO_MAX_HIDDEN` at every batch, and at batch 1
        (`ROW_INVARIANT_AUTO_MAX_BATCH`) for every size where `row_invariant_measured_cheap`.
        On an H100 the bundled pair (hidden 256) ran faster with it (plain 2681 against
        2368 tokens/s, EAGLE-3 S=5 6114 against 5721); the 8B shape (4096) paid 1.7-2.3% a
        batch-1 step, 1.8-2.1% a chain round (S=3) and 1.8-2.0% a 16-node tree round; on an
        H200 5.8% a step, and at batch 4 4.0% a step and 37% a tree round
        (docs/benchmarks.md)."""
        return cfg.hidden_size <= ROW_INVARIANT_AUTO_MAX_HIDDEN or (
            batch <= ROW_INVARIANT_AUTO_MAX_BATCH and row_invariant_measured_cheap(device))

    def config_from_hf(self, cfg_json: dict, dtype: str | None) -> ModelConfig:
        return llama_hf.model_config_from_hf(cfg_json, dtype=dtype)

    def weights_from_hf(self, tensors: dict, cfg: ModelConfig, where: str):
        return llama_hf.target_weights_from_tensors(tensors, cfg, where)

    def weights_to_hf(self, cfg: ModelConfig, weights) -> tuple[dict, dict]:
        return llama_hf.hf_config(cfg), llama_hf.target_tensors(cfg, weights)

    def cache_kind(self, cfg: ModelConfig) -> KVCacheKind:
        return KVCacheKind(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)

    def split(self, cfg: ModelConfig, weights, n: int):
        return split_llama(cfg, weights, n)


LLAMA = LlamaFamily()
