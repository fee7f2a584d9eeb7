"""Qwen3-Next and Qwen3.5 (dense and MoE) decoders as Flax modules, behind the
target-family protocol (`jspec.models.family`).

Three of every four layers (as `layer_types` says) are Gated DeltaNet linear attention:
one input projection gives the convolution's q, k, v channels, the output gate z and the
delta rule's b and a; a causal depthwise convolution (SiLU) over q, k, v; the gated delta
rule (`jspec.kernels.gated_delta.reference`: L2-normalised q and k, decay g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b), Hv value heads over Hk key heads); a gated
RMSNorm per value head (norm, times w, times silu(z)); the output projection. The rest
are full attention with an output gate: q_proj gives each head its query and its gate,
q/k norms, RoPE on the first rotary_dim dims of a head (Qwen3.5's mrope sections are all
one text position), and the output times sigmoid(gate). Every other norm is Qwen's
(1 + w) RMSNorm. MLPs are SwiGLU, or MoE (softmax routing to k experts, renormalised,
plus a shared expert scaled by sigmoid(shared_expert_gate(x))).

The cache is `jspec.cache.recurrent`'s hybrid kind: keys and values of the full-attention
layers, conv and delta-rule states of the linear ones. A prompt's first block starts each
admitted row from zero states, its later blocks (`AttnMeta.causal_block`) from the states
the blocks before left; any other forward over T > 1 nodes (a verification) leaves
the round's record for the commit and writes no state (see that module); one token
(plain decoding) writes its states.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from jspec import sharding
from jspec.cache.kv import KVCache, KVCacheKind, cached_attention
from jspec.cache.recurrent import (
    HybridCache,
    HybridCacheKind,
    conv_window,
    put_rows,
    take_rows,
)
from jspec.tuning import DEFAULT_TUNING, Tuning
from jspec.kernels.moe import experts as moe_experts, grouped as moe_grouped
from jspec.kernels.meta import AttnMeta
from jspec.kernels.gated_delta.reference import causal_conv_reference, gated_delta_reference
from jspec.kernels.gated_delta.kernels import (
    gated_delta_prefill,
    gated_delta_step,
    gated_delta_verify,
)
from jspec.kernels.moe.route import Routing, route
from jspec.models import qwen3_next_hf
from jspec.models.layers import INIT, DecoderLM, FlaxFamily, call_layer, Linear, apply_rope, loaded_param
from jspec.models.qwen3_next_hf import LINEAR, HybridConfig
from jspec.models.qwen3_next_split import layer_on_devices, split_qwen3_next
from jspec.quantization import expert_scales



def offset_rms_norm(x, w, eps: float):
    """Qwen's RMSNorm: x normed in float32, times (1 + w), then rounded to x's dtype."""
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


class OffsetRMSNorm(nn.Module):
    """`offset_rms_norm` with its weight (zero-initialised: the identity gain)."""

    eps: float
    dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.zeros, (x.shape[-1],), jnp.dtype(self.dtype))
        return offset_rms_norm(x, w, self.eps)


class GatedRMSNorm(nn.Module):
    """The linear layers' output norm per value head: normed in float32, rounded, times w
    (a plain gain), times silu(z) in float32, rounded (as transformers computes it)."""

    eps: float
    dtype: str = "float32"

    @nn.compact
    def __call__(self, o, z):
        """o, z [..., Dv] (model dtype) -> [..., Dv]."""
        w = self.param("weight", nn.initializers.ones, (o.shape[-1],), jnp.dtype(self.dtype))
        of = o.astype(jnp.float32)
        h = w * (of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + self.eps)).astype(o.dtype)
        return (h.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


class GatedAttention(nn.Module):
    """Full attention with the output gate (q_proj gives per head [query | gate]), q/k
    norms and partial RoPE, over the KV part of the cache."""

    cfg: HybridConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, kv, meta: AttnMeta):
        """x [B,T,D] normed; kv: the layer's KV buffer or None -> (out [B,T,D], buffer)."""
        c = self.cfg
        B, T, _ = x.shape
        H, Hkv, Dh, R = c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim
        qkv = Linear(2 * H * Dh + 2 * Hkv * Dh, c.attention_bias, c.dtype, tuning=self.tuning, name="qkv_proj")(x)
        qg = qkv[..., :2 * H * Dh].reshape(B, T, H, 2 * Dh)
        q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, T, H * Dh)
        k = qkv[..., 2 * H * Dh:(2 * H + Hkv) * Dh].reshape(B, T, Hkv, Dh)
        v = qkv[..., (2 * H + Hkv) * Dh:].reshape(B, T, Hkv, Dh)
        q = OffsetRMSNorm(c.rms_norm_eps, c.dtype, name="q_norm")(q)
        k = OffsetRMSNorm(c.rms_norm_eps, c.dtype, name="k_norm")(k)
        inv_freq = c.rope.inv_freq(R)

        def rope(t):  # the first R dims of each head rotate, the rest pass
            return jnp.concatenate([apply_rope(t[..., :R], meta.positions, inv_freq, c.rope.cos_sin_scale()),
                                    t[..., R:]], axis=-1)

        kv_scale = self.get_variable("params", "kv_scale") if self.has_variable("params", "kv_scale") else None
        o, kv = cached_attention(rope(q), rope(k), v, kv, meta, scale=Dh ** -0.5, tiles=self.tuning.attention,
                                 kv_scale=kv_scale)
        o = o.reshape(B, T, H * Dh) * jax.nn.sigmoid(gate)
        # one device's heads (`HybridConfig.block`): a float32 partial sum for `sharding.device_sum`
        return Linear(c.hidden_size, c.attention_bias, c.dtype, float32_out=c.per_device, tuning=self.tuning,
                      name="o_proj")(o), kv


def sequence_conv(x, weight, lengths, conv0=None):
    """The causal depthwise conv (SiLU) over right-padded sequences from the conv state
    conv0 [B,C-1,Ch] (None: zeros): x [B,T,Ch], weight [Ch,C], lengths [B] -> (out
    [B,T,Ch], conv state after each row's lengths[b] inputs [B,C-1,Ch])."""
    B, T, Ch = x.shape
    C = weight.shape[1]
    conv0 = jnp.zeros((B, C - 1, Ch), x.dtype) if conv0 is None else conv0.astype(x.dtype)
    xp = jnp.concatenate([conv0, x], axis=1).astype(jnp.float32)
    w = weight.astype(jnp.float32)
    y = sum(xp[:, j:j + T] * w[:, j] for j in range(C))
    return jax.nn.silu(y).astype(x.dtype), conv_window(conv0, x, lengths)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer over its conv and delta-rule states."""

    cfg: HybridConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, conv, ssm, meta: AttnMeta):
        """x [B,T,D] normed; conv [R,C-1,Ch], ssm [R,Hv,Dk,Dv] (the request rows' states; None
        without a cache) -> (out [B,T,D], conv, ssm, the round's record or None)."""
        c = self.cfg
        B, T, _ = x.shape
        Hv, Dk, Dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        Ch, Vd, C = c.conv_dim, c.value_dim, c.conv_kernel
        dt = jnp.dtype(c.dtype)
        proj = Linear(Ch + Vd + 2 * Hv, False, c.dtype, tuning=self.tuning, name="in_proj")(x)
        mixed, z = proj[..., :Ch], proj[..., Ch:Ch + Vd].reshape(B, T, Hv, Dv)
        b, a = proj[..., Ch + Vd:Ch + Vd + Hv], proj[..., Ch + Vd + Hv:]
        w_conv = self.param("conv_weight", INIT, (Ch, C), dt)
        A_log = self.param("A_log", lambda key, s: jnp.log(jax.random.uniform(key, s, jnp.float32, 1, 16)), (Hv,))
        dt_bias = self.param("dt_bias", nn.initializers.ones, (Hv,), jnp.float32)
        beta = jax.nn.sigmoid(b).astype(jnp.float32)
        g = -jnp.exp(A_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)  # [B,T,Hv]
        record = None
        if meta.prefill or meta.causal_block:  # a prompt's block: padding (invalid tokens) changes no state
            valid = meta.valid if meta.valid is not None else jnp.ones((B, T), bool)
            lengths = valid.sum(axis=1).astype(jnp.int32)
            if meta.prefill:  # the first block: from zero states
                conv0, ssm0 = None, jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
            else:  # a later block: from the states the blocks before it left
                conv0, ssm0 = take_rows(conv, meta.rows), take_rows(ssm, meta.rows).astype(jnp.float32)
            y, new_conv = sequence_conv(mixed, w_conv, lengths, conv0)
            q, k, v = split_qkv(y, c)
            o, new_ssm = gated_delta_prefill(q, k, v, g, beta, ssm0, lengths, tiles=self.tuning.gated_delta,
                                             out_dtype=dt)
            if conv is not None:  # admitted rows with room (all rows when the pass names none)
                live = jnp.ones((B,), bool) if meta.rows is None else valid.any(axis=1)
                conv = put_rows(conv, new_conv, meta.rows, live)
                ssm = put_rows(ssm, new_ssm, meta.rows, live)
        else:
            conv0, ssm0 = take_rows(conv, meta.rows), take_rows(ssm, meta.rows)
            y, windows = causal_conv_reference(mixed, conv0, w_conv, meta.parents)
            q, k, v = split_qkv(y, c)
            live = meta.valid[:, 0] if meta.valid is not None else jnp.ones((B,), bool)
            if T == 1:  # plain decoding: the new states are the committed ones
                o, new_ssm = gated_delta_step(q, k, v, g, beta, ssm0, tiles=self.tuning.gated_delta)
                conv = put_rows(conv, windows[:, 0], meta.rows, live)
                ssm = put_rows(ssm, new_ssm, meta.rows, live)
            elif record_names(meta, T, self.tuning) == ("conv", "ssm"):  # every node's states, for the commit to pick
                o, states = gated_delta_reference(q, k, v, g, beta, ssm0, meta.parents)
                record = {"conv": windows, "ssm": states}
            else:  # the outputs only; the commit replays the accepted path from the nodes' inputs
                o = gated_delta_verify(q, k, v, g, beta, ssm0, meta.parents, tiles=self.tuning.gated_delta)
                record = {"x": mixed, "k": k, "v": v, "g": g, "beta": beta}
        o = GatedRMSNorm(c.rms_norm_eps, c.dtype, name="norm")(o.astype(dt), z).reshape(B, T, Vd)
        out = Linear(c.hidden_size, False, c.dtype, float32_out=c.per_device, tuning=self.tuning, name="out_proj")(o)
        return out, conv, ssm, record


def record_names(meta: AttnMeta, T: int, tuning: Tuning) -> tuple[str, ...]:
    """The names of the round's record a linear layer leaves for a forward over T tokens
    (`GatedDeltaNet`; none outside a verification)."""
    if meta.prefill or meta.causal_block or T == 1:
        return ()
    return ("conv", "ssm") if tuning.recurrent_commit == "checkpoint" else ("x", "k", "v", "g", "beta")


def split_qkv(y, c: HybridConfig):
    """The convolution's output [B,T,Ch] -> q, k [B,T,Hk,Dk], v [B,T,Hv,Dv]."""
    B, T, _ = y.shape
    Kd = c.key_dim
    return (y[..., :Kd].reshape(B, T, c.linear_num_key_heads, c.linear_key_head_dim),
            y[..., Kd:2 * Kd].reshape(B, T, c.linear_num_key_heads, c.linear_key_head_dim),
            y[..., 2 * Kd:].reshape(B, T, c.linear_num_value_heads, c.linear_value_head_dim))


class MLP(nn.Module):
    """SwiGLU: gate_up_proj [D, 2F] (gate columns, then up), down_proj [F, D]."""

    width: int
    dtype: str
    tuning: Tuning = DEFAULT_TUNING
    partial: bool = False  # one device's columns (`HybridConfig.block`): a float32 partial sum

    @nn.compact
    def __call__(self, x):
        F = self.width
        gu = Linear(2 * F, False, self.dtype, tuning=self.tuning, name="gate_up_proj")(x)
        return Linear(x.shape[-1], False, self.dtype, float32_out=self.partial, tuning=self.tuning,
                      name="down_proj")(jax.nn.silu(gu[..., :F]) * gu[..., F:])


class SparseMoe(nn.Module):
    """Routed experts (softmax over E, the k best, renormalised when norm_topk_prob), plus
    the shared expert times sigmoid(shared_expert_gate(x)). Decoding and verification
    read only the chosen experts (`moe_experts`); a prefill groups tokens by expert
    (`moe_grouped`), as `models.deepseek.MoE` does."""

    cfg: HybridConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x):
        """x [B,T,D] normed -> [B,T,D]."""
        c, tuning = self.cfg, self.tuning
        B, T, D = x.shape
        E, k, Fm = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
        dt = jnp.dtype(c.dtype)
        router = self.param("router", lambda key: {"kernel": INIT(key, (D, E), jnp.float32)})
        n = c.devices if c.per_device else 1  # a device's block: E/n experts
        experts = loaded_param(self, "experts", lambda key: {  # FP8: with their scales (`expert_scales`)
            "gate_up": INIT(key, (E // n, D, 2 * Fm), dt), "down": INIT(jax.random.fold_in(key, 1), (E // n, Fm, D), dt)})
        r = Routing(E, k, scoring="softmax", method="greedy", norm_topk_prob=c.norm_topk_prob)
        xs = x.reshape(B * T, D)
        weights, ids = route(r, xs, router["kernel"], tiles=tuning.route, expert_tiles=tuning.experts)  # [N, KP] each
        ids = ids[:, :k]
        if c.per_device:  # this device's E/n experts; other experts' pairs: id -1
            local = ids - jax.lax.axis_index(sharding.AXIS) * (E // n)
            ids = jnp.where((local >= 0) & (local < E // n), local, -1)
        if B * T * k < E:
            y = moe_experts.moe_experts(xs, ids, experts["gate_up"], experts["down"], None, k,
                                        tiles=tuning.experts, scales=expert_scales(experts),
                                        mosaic_tiles=tuning.fp8_mosaic)  # [N*k, D]
            out = jnp.einsum("nkd,nk->nd", y.reshape(B * T, k, D).astype(jnp.float32), weights[:, :k])
        else:
            y = moe_grouped.grouped(xs, ids, experts["gate_up"], experts["down"], tiles=tuning.grouped,
                                    scales=expert_scales(experts), w8a8=tuning.fp8_w8a8).reshape(B * T, k, D)
            out = jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), weights[:, :k])
        out = out.reshape(B, T, D) if c.per_device else out.astype(x.dtype).reshape(B, T, D)
        if c.shared_expert_intermediate_size:  # split: this device's columns, a float32 partial sum
            shared = MLP(c.shared_expert_intermediate_size, c.dtype, tuning, c.per_device, name="shared_expert")(x)
            gate = Linear(1, False, c.dtype, tuning=tuning, name="shared_expert_gate")(x)
            out = out + jax.nn.sigmoid(gate) * shared
        return out  # float32 when split: a partial sum over the devices


class DecoderLayer(nn.Module):
    cfg: HybridConfig
    layer: int
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, kv, conv, ssm, meta):
        """-> (x, kv, conv, ssm, record): a linear layer leaves kv None, a full one the rest."""
        c, tuning = self.cfg, self.tuning
        h = OffsetRMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(x)
        record = None
        if c.layer_types[self.layer] == LINEAR:
            h, conv, ssm, record = GatedDeltaNet(c, tuning, name="linear_attn")(h, conv, ssm, meta)
        else:
            h, kv = GatedAttention(c, tuning, name="self_attn")(h, kv, meta)
        x = x + sharding.device_sum(h, c)
        h = OffsetRMSNorm(c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x)
        mlp = (SparseMoe(c, tuning, name="mlp") if c.is_moe(self.layer)
               else MLP(c.intermediate_size, c.dtype, tuning, c.per_device, name="mlp"))
        return x + sharding.device_sum(mlp(h), c), kv, conv, ssm, record


def run_layer(c: HybridConfig, layer: DecoderLayer, x, kv, conv, ssm, meta):
    """A bound decoder layer on one device, or split over c.devices on each device's block
    (`qwen3_next_split.layer_on_devices`) -> (x, kv, conv, ssm, record)."""
    if c.devices == 1:
        kind = lambda i: (c.layer_types[i], c.is_moe(i))  # noqa: E731
        first = next(i for i in range(c.num_layers) if kind(i) == kind(layer.layer))
        return call_layer(layer, x, kv, conv, ssm, meta, same={"layer": first})
    local = DecoderLayer(c.block(), layer.layer, layer.tuning, parent=None)
    names = record_names(meta, x.shape[1], layer.tuning) if c.layer_types[layer.layer] == LINEAR else ()
    return layer_on_devices(c, local, layer.variables["params"], x, kv, conv, ssm, meta, names)


class HybridModel(DecoderLM):
    """Token ids -> final-norm hidden states; `logits` applies the LM head."""

    cfg: HybridConfig
    tuning: Tuning = DEFAULT_TUNING

    def setup(self):
        c = self.cfg
        self.setup_ends(OffsetRMSNorm(c.rms_norm_eps, c.dtype))
        self.layers = [DecoderLayer(c, i, self.tuning, name=f"layers_{i}") for i in range(c.num_layers)]

    def __call__(self, tokens, cache: HybridCache | None, meta: AttnMeta, capture: tuple[int, ...] = ()):
        x = self.embed(tokens)
        aux, kvs, convs, ssms, records = {}, [], [], [], []
        lin, full = self.cfg.linear_layers, self.cfg.full_layers
        for i, layer in enumerate(self.layers):
            if i in capture:
                aux[i] = x
            kv = conv = ssm = None
            if cache is not None:
                if i in full:
                    kv = cache.kv.kv[full.index(i)]
                else:
                    conv, ssm = cache.conv[lin.index(i)], cache.ssm[lin.index(i)]
            x, kv, conv, ssm, record = run_layer(self.cfg, layer, x, kv, conv, ssm, meta)
            if i in full:
                kvs.append(kv)
            else:
                convs.append(conv)
                ssms.append(ssm)
                records.append(record)
        if self.cfg.num_layers in capture:
            aux[self.cfg.num_layers] = x
        if cache is None:
            return self.norm(x), aux, None
        pending = None if all(r is None for r in records) else tuple(records)
        return self.norm(x), aux, cache.replace(kv=KVCache(kv=tuple(kvs)), conv=tuple(convs), ssm=tuple(ssms),
                                                pending=pending)


class HybridFamily(FlaxFamily):
    """The target-family protocol for Qwen3-Next and Qwen3.5 (dense, MoE) decoders."""

    config_type = HybridConfig
    model = HybridModel
    architectures = qwen3_next_hf.TARGET_ARCHITECTURES
    fp8_weights = True  # FP8 projections stay FP8 (`Linear`)
    fp8_experts = True  # ... and the routed experts' stacks read one tensor an expert, inputs whole groups

    def config_from_hf(self, cfg_json: dict, dtype: str | None) -> HybridConfig:
        return qwen3_next_hf.config_from_hf(cfg_json, dtype)

    def weights_from_hf(self, tensors: dict, cfg: HybridConfig, where: str):
        return qwen3_next_hf.target_weights_from_tensors(tensors, cfg, where)

    def weights_to_hf(self, cfg: HybridConfig, weights) -> tuple[dict, dict]:
        return qwen3_next_hf.hf_config(cfg), qwen3_next_hf.target_tensors(cfg, weights)

    def split(self, cfg: HybridConfig, weights, n: int):
        return split_qwen3_next(cfg, weights, n)

    def cache_kind(self, cfg: HybridConfig) -> HybridCacheKind:
        kv = KVCacheKind(len(cfg.full_layers), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
        return HybridCacheKind(kv, len(cfg.linear_layers), cfg.conv_kernel, cfg.conv_dim,
                               cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                               cfg.dtype)


QWEN3_NEXT = HybridFamily()


class MtpLayer(nn.Module):
    """A Qwen3-Next / Qwen3.5 multi-token-prediction layer, the MTP draft's whole model.

    (embeds [B,T,D] of tokens t+1, feats [B,T,D]: the hidden state that predicted t+1) ->
    hidden [B,T,D]: fc([pre_fc_norm_embedding(embeds); pre_fc_norm_hidden(feats)]) through
    one gated full-attention decoder layer (the target's MLP or MoE), then `norm`. The
    target's final-norm hidden state is the first feature; each later draft step reads this
    layer's own output after `norm` (as SGLang's and vLLM's Qwen3.5 / Qwen3-Next MTP do)."""

    cfg: HybridConfig  # the layer's config (`jspec.drafts.qwen_mtp.layer_config`)
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, embeds, feats, cache: KVCache | None, meta: AttnMeta):
        c = self.cfg
        h = jnp.concatenate([OffsetRMSNorm(c.rms_norm_eps, c.dtype, name="pre_fc_norm_embedding")(embeds),
                             OffsetRMSNorm(c.rms_norm_eps, c.dtype, name="pre_fc_norm_hidden")(feats)], axis=-1)
        x = Linear(c.hidden_size, False, c.dtype, tuning=self.tuning, name="fc")(h)
        kv = None if cache is None else cache.kv[0]
        x, kv, _, _, _ = run_layer(c, DecoderLayer(c, 0, self.tuning, name="layers_0"), x, kv, None, None, meta)
        out = OffsetRMSNorm(c.rms_norm_eps, c.dtype, name="norm")(x)
        return out, None if cache is None else KVCache(kv=(kv,))
