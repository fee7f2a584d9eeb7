"""DeepSeek's split over several devices (`TargetFamily.split`; docs/design.md, "Several
GPUs"): attention by heads, routed experts by expert (expert parallelism), the shared
experts' and dense MLPs' columns Megatron's way, the embedding and LM head by vocabulary.
`split_deepseek` reorders a model's weights so that each device's block is what its layer
code expects and gives their PartitionSpecs; `layer_on_devices` runs a layer on every
device's block under `jax.shard_map`, and `sharding.device_sum` adds the devices' partial
sums.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from jspec import sharding
from jspec.models.deepseek_hf import DeepseekConfig
from jspec.models.layers import after_input
from jspec.quantization import GROUP, dequantize_host, dequantize_uneven_rows


def layer_on_devices(c: DeepseekConfig, layer: nn.Module, params, x, buf, meta):
    """A decoder layer of a model split over c.devices (`split_deepseek`): `layer`, the
    module made with the block's config (`DeepseekConfig.block`), runs on every device's
    block of the weights under `jax.shard_map`, so the Pallas kernels run per device as they
    do on one; x [B,T,D], the latent buffer (every device writes the same rows) and meta are
    replicated. Two all-reduces a layer (`sharding.device_sum`). -> (x [B,T,D], buffer)."""
    specs = sharding.weight_specs(params, c.devices, device_splits(c), VOCAB_SPLITS)

    def run(p, x, buf, meta):
        return layer.apply({"params": after_input(p, x, meta)}, x, buf, meta)
    return jax.shard_map(run, in_specs=(specs, P(), P(), P()), out_specs=(P(), P()), check_vma=False)(
        params, x, buf, meta)


# Several devices: which weight splits how, by the last two keys of its path (one key: an
# MTP draft's own embedding or head). Attention by heads (the latent cache and the latent
# projections replicated), routed experts by expert, the shared experts' and dense MLPs'
# columns Megatron's way, the embedding and LM head by vocabulary.
def device_splits(c: DeepseekConfig) -> dict:
    A = sharding.AXIS
    splits = {("q_b_proj", "kernel"): P(None, A), ("self_attn", "w_uk"): P(None, A, None),
              ("self_attn", "w_uv"): P(A, None, None), ("o_proj", "kernel"): P(A, None),
              ("gate_up_proj", "kernel"): P(None, A), ("down_proj", "kernel"): P(A, None),
              ("experts", "gate_up"): P(A, None, None), ("experts", "down"): P(A, None, None),
              ("experts", "gate_up_scale"): P(A, None, None), ("experts", "down_scale"): P(A, None, None),
              ("shared_experts", "gate_up"): P(None, None, A), ("shared_experts", "down"): P(None, A, None),
              ("shared_experts", "gate_up_scale"): P(None, None, A), ("shared_experts", "down_scale"): P(None, A, None),
              ("embed_tokens", "embedding"): P(A, None), ("lm_head", "kernel"): P(None, A),
              ("embed",): P(A, None), ("head",): P(None, A)}
    if not c.q_lora_rank:  # q_proj's columns by head, each device's followed by the latent's (`split_deepseek`)
        splits |= {("qkv_a_proj", "kernel"): P(None, A), ("qkv_a_proj", "bias"): P(A)}
    # an FP8 kernel's scales [ceil(in / 128), out] split as the kernel: by columns, or by groups of
    # rows (`split_deepseek` dequantizes a row-split kernel whose blocks are not whole groups)
    splits |= {(k, "kernel_scale"): splits[k, "kernel"] for k in COLUMNS + ROWS if (k, "kernel") in splits}
    return splits


COLUMNS = ("qkv_a_proj", "q_b_proj", "gate_up_proj")  # FP8 projections split by columns (qkv_a_proj: no query latent)
ROWS = ("o_proj", "down_proj")  # ... and by rows


VOCAB_SPLITS = (("embed_tokens", "embedding"), ("lm_head", "kernel"), ("embed",), ("head",))


def _check_split(c: DeepseekConfig, n: int) -> None:
    fits = [(c.num_heads, "attention heads"), (c.n_routed_experts, "routed experts")]
    if c.first_k_dense_replace or not c.n_routed_experts:
        fits.append((c.intermediate_size, "columns of the dense MLPs"))
    if c.n_shared_experts:
        fits.append((c.moe_intermediate_size, "columns of the shared experts"))
    sharding.check_divides(fits, n, "DeepSeek", c.attention_bias, c.devices)


def split_deepseek(c: DeepseekConfig, weights, n: int):
    """A DeepSeek model (target weights, or an MTP draft's) for n devices -> (config with
    `devices` n, weights, PartitionSpec tree), Megatron's way where it applies and expert
    parallelism for the routed experts (`device_splits`; docs/design.md, "Several GPUs").
    Columns are reordered so that each device's block is what its layer code expects: the
    [gate | up] halves of dense and shared MLPs per device (`halves_by_device`) and, without
    a query latent, q_proj's columns of its heads followed by the latent's (those repeat
    on every device); FP8 kernels' scales with their columns
    (`quantization.dequantize_uneven_rows`; FP8 shared experts whose Fm / n rows of down are
    not whole groups dequantized, `dequantize_uneven_shared`). Host weights stay unread
    (`HostParam`)."""
    _check_split(c, n)
    Q = c.num_heads * c.qk_head_dim
    Dcr = c.kv_lora_rank + c.qk_rope_head_dim
    qkv_cols = np.concatenate([np.r_[d * Q // n:(d + 1) * Q // n, Q:Q + Dcr] for d in range(n)])

    def reorder(keys, w):  # a kernel's columns, and its FP8 scales' with them
        if keys[-2:-1] == ("qkv_a_proj",) and not c.q_lora_rank:
            return sharding.take_columns(w, qkv_cols)
        if keys[-2:] in (("gate_up_proj", "kernel"), ("gate_up_proj", "kernel_scale")):
            return sharding.take_columns(w, sharding.halves_by_device(c.intermediate_size, n))
        if keys[-2:] in (("shared_experts", "gate_up"), ("shared_experts", "gate_up_scale")):
            return sharding.take_columns(w, sharding.halves_by_device(c.moe_intermediate_size, n))
        return w
    weights = dequantize_uneven_shared(dequantize_uneven_rows(weights, n, c.jnp_dtype, ROWS), n, c.jnp_dtype)
    weights = sharding.map_weights(reorder, weights)
    return c.replace(devices=n), weights, sharding.weight_specs(weights, n, device_splits(c), VOCAB_SPLITS)


def dequantize_uneven_shared(tree, n: int, dtype):
    """A weight tree with every FP8 shared-experts stack whose down projection's Fm / n rows
    a device (its block of the Fm columns split over n) are not whole groups of GROUP
    dequantized to `dtype` (its scales dropped): a device's block must hold whole groups."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if k == "shared_experts" and isinstance(v, dict) and "down_scale" in v and (v["down"].shape[1] // n) % GROUP:
            out[k] = {name: jnp.asarray(dequantize_host(np.asarray(v[name]), np.asarray(v[name + "_scale"])), dtype)
                      for name in ("gate_up", "down")}
        else:
            out[k] = dequantize_uneven_shared(v, n, dtype)
    return out

