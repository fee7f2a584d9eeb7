"""Qwen3-Next's and Qwen3.5's split over several devices (`TargetFamily.split`;
docs/design.md, "Several GPUs"), DeepSeek's way (`models.deepseek_split`): gated full
attention by heads (its KV cache by KV head), Gated DeltaNet by key heads with their value
heads (the conv state by the channels those heads read, the delta-rule state by value
head), routed experts by expert, the shared expert's and dense MLPs' columns Megatron's
way, the embedding and LM head by vocabulary. `split_qwen3_next` reorders a model's
weights so that each device's block is what its layer code expects and gives their
PartitionSpecs; `layer_on_devices` runs a decoder layer on every device's block under
`jax.shard_map` with two all-reduces (`sharding.device_sum`).
"""
from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from jspec import sharding
from jspec.cache.recurrent import RECORD_SPECS, STATE_SPECS
from jspec.models.qwen3_next_hf import HybridConfig
from jspec.models.layers import after_input
from jspec.quantization import dequantize_uneven_rows

A = sharding.AXIS
# Which weight splits how, by the last two keys of its path. Column-parallel input
# projections (reordered by `split_qwen3_next`), row-parallel outputs, per-head vectors by
# head; norms, the router, the shared expert's gate and the MTP layer's fc replicated.
SPLITS = {("qkv_proj", "kernel"): P(None, A), ("o_proj", "kernel"): P(A, None),
          ("in_proj", "kernel"): P(None, A), ("linear_attn", "conv_weight"): P(A, None),
          ("linear_attn", "A_log"): P(A), ("linear_attn", "dt_bias"): P(A), ("out_proj", "kernel"): P(A, None),
          ("gate_up_proj", "kernel"): P(None, A), ("down_proj", "kernel"): P(A, None),
          ("experts", "gate_up"): P(A, None, None), ("experts", "down"): P(A, None, None),
          ("experts", "gate_up_scale"): P(A, None, None), ("experts", "down_scale"): P(A, None, None),
          ("embed_tokens", "embedding"): P(A, None), ("lm_head", "kernel"): P(None, A)}
# An FP8 kernel's scales [ceil(in / 128), out] split as the kernel: by columns, or by groups
# of rows (`split_qwen3_next` dequantizes a row-split kernel whose blocks are not whole groups)
COLUMNS = ("qkv_proj", "in_proj", "gate_up_proj")
ROWS = ("o_proj", "out_proj", "down_proj")
SPLITS |= {(k, "kernel_scale"): P(None, A) for k in COLUMNS} | {(k, "kernel_scale"): P(A, None) for k in ROWS}
VOCAB_SPLITS = (("embed_tokens", "embedding"), ("lm_head", "kernel"))


def along(axis: int, ndim: int) -> P:
    """A PartitionSpec splitting axis `axis` of an array of `ndim` dimensions over the devices."""
    spec = [None] * ndim
    spec[axis] = A
    return P(*spec)


def state_specs(kv, conv, ssm):
    """The specs of a layer's cache parts (None where the layer has none): keys and values by
    KV head (axis -2), the conv and delta-rule states as the cache kind splits them
    (`cache.recurrent.STATE_SPECS`)."""
    return (None if kv is None else along(kv.ndim - 2, kv.ndim), None if conv is None else STATE_SPECS["conv"],
            None if ssm is None else STATE_SPECS["ssm"])


def layer_on_devices(c: HybridConfig, layer: nn.Module, params, x, kv, conv, ssm, meta, record: tuple[str, ...]):
    """A decoder layer of a model split over c.devices (`split_qwen3_next`): `layer`, made
    with the block's config (`HybridConfig.block`), runs on every device's block of the
    weights and of the cache parts under `jax.shard_map`, so the Pallas kernels run per
    device as they do on one; x [B,T,D] and meta are replicated; `record`: the names of the
    round's record the layer leaves (`qwen3_next.record_names`). -> as the layer: (x, kv,
    conv, ssm, record or None)."""
    specs = sharding.weight_specs(params, c.devices, SPLITS, VOCAB_SPLITS)
    cache_specs = state_specs(kv, conv, ssm)
    record_specs = {n: RECORD_SPECS[n] for n in record} or None

    def run(p, x, kv, conv, ssm, meta):
        return layer.apply({"params": after_input(p, x, meta)}, x, kv, conv, ssm, meta)
    return jax.shard_map(run, in_specs=(specs, P()) + cache_specs + (P(),),
                         out_specs=(P(),) + cache_specs + (record_specs,), check_vma=False)(
        params, x, kv, conv, ssm, meta)


def qkv_columns(c: HybridConfig, n: int) -> np.ndarray:
    """qkv_proj's columns [query and gate of H heads | keys | values of Hkv heads] reordered
    so that device d's block is [its H/n heads' | its KV heads' keys | their values]; with
    more devices than KV heads, each device's one KV head is the one its heads read."""
    H, Hkv, Dh = c.num_heads, c.num_kv_heads, c.head_dim
    groups = sharding.kv_heads_over(Hkv, n)
    cols = []
    for d in range(n):
        heads = np.arange(d * groups // n, (d + 1) * groups // n) * Hkv // groups  # its KV heads (repeated or not)
        per_head = np.arange(Dh)
        keys = (2 * H * Dh + heads[:, None] * Dh + per_head).reshape(-1)
        cols += [np.arange(d * 2 * H * Dh // n, (d + 1) * 2 * H * Dh // n), keys, keys + Hkv * Dh]
    return np.concatenate(cols)


def check_split(c: HybridConfig, n: int) -> None:
    sharding.kv_heads_over(c.num_kv_heads, n)
    fits = [(c.num_heads, "attention heads"), (c.linear_num_key_heads, "linear attention key heads")]
    if any(not c.is_moe(i) for i in range(c.num_layers)) or c.num_experts == 0:
        fits.append((c.intermediate_size, "columns of the dense MLPs"))
    if c.num_experts:
        fits.append((c.num_experts, "routed experts"))
    if c.shared_expert_intermediate_size:
        fits.append((c.shared_expert_intermediate_size, "columns of the shared expert"))
    sharding.check_divides(fits, n, "Qwen3-Next / Qwen3.5", c.attention_bias, c.devices)


def split_qwen3_next(c: HybridConfig, weights, n: int):
    """A Qwen3-Next / Qwen3.5 model (target weights, or an MTP layer's) for n devices ->
    (config with `devices` n, weights, PartitionSpec tree). Columns are reordered so that
    each device's block is what its layer code expects (`sharding.blocks_by_device`):
    qkv_proj's (`qkv_columns`; with more devices than KV heads each is repeated,
    `sharding.kv_heads_over`, and the config has n KV heads holding the same keys and
    values), in_proj's [its q | k | v | z | b | a], the conv weight's channels as its q, k
    and v, the MLPs' [gate | up] halves; FP8 kernels' scales with their columns
    (`quantization.dequantize_uneven_rows`). Host weights stay unread (`HostParam`)."""
    check_split(c, n)
    Kd, Vd, Hv = c.key_dim, c.value_dim, c.linear_num_value_heads
    qkv = qkv_columns(c, n)
    in_proj = sharding.blocks_by_device((Kd, Kd, Vd, Vd, Hv, Hv), n)
    channels = sharding.blocks_by_device((Kd, Kd, Vd), n)

    def reorder(keys, w):  # a kernel's columns, and its FP8 scales' with them
        if keys[-2:] in (("qkv_proj", "kernel"), ("qkv_proj", "kernel_scale")):
            return sharding.take_columns(w, qkv)
        if keys[-2:] in (("in_proj", "kernel"), ("in_proj", "kernel_scale")):
            return sharding.take_columns(w, in_proj)
        if keys[-2:] == ("linear_attn", "conv_weight"):
            return sharding.take_rows(w, channels)
        if keys[-2:] in (("gate_up_proj", "kernel"), ("gate_up_proj", "kernel_scale")):
            width = c.shared_expert_intermediate_size if "shared_expert" in keys else c.intermediate_size
            return sharding.take_columns(w, sharding.halves_by_device(width, n))
        return w
    weights = sharding.map_weights(reorder, dequantize_uneven_rows(weights, n, c.jnp_dtype, ROWS))
    return (c.replace(devices=n, num_kv_heads=sharding.kv_heads_over(c.num_kv_heads, n)), weights,
            sharding.weight_specs(weights, n, SPLITS, VOCAB_SPLITS))
