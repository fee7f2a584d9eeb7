"""Saving jspec weights as Hugging Face directories (config.json + safetensors).

Targets and standalone drafts are saved as `LlamaForCausalLM` (transformers loads them);
EAGLE-3 heads as `LlamaForCausalLMEagle3`, the format SGLang and vLLM load (with `d2t` and
`t2d` when the draft vocabulary is reduced); EAGLE heads as `LlamaForCausalLMEagle`.
"""
from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np

from jspec import safetensors_io
from jspec.config import DraftConfig, ModelConfig

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _np(a, dtype: str) -> np.ndarray:
    return np.asarray(jax.device_get(a)).astype(_NP_DTYPES[dtype])


def _hf_linear(p: dict, dtype: str) -> np.ndarray:
    """A `Linear`'s [in, out] kernel as Hugging Face's [out, in] weight."""
    return np.ascontiguousarray(_np(p["kernel"], dtype).T)


def hf_config(c: ModelConfig, architecture: str = "LlamaForCausalLM") -> dict:
    """A Llama config.json dict for a ModelConfig."""
    rope = {"rope_type": c.rope.kind, "rope_theta": c.rope.theta}
    if c.rope.kind == "linear":
        rope["factor"] = c.rope.factor
    elif c.rope.kind == "llama3":
        rope.update(factor=c.rope.factor, low_freq_factor=c.rope.low_freq_factor,
                    high_freq_factor=c.rope.high_freq_factor,
                    original_max_position_embeddings=c.rope.original_max_position_embeddings)
    if c.qk_norm or c.qkv_bias != c.o_bias or any(c.sliding_windows):
        raise ValueError("only plain Llama-architecture models can be exported")
    cfg = {
        "architectures": [architecture], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.qkv_bias,
        "mlp_bias": c.mlp_bias, "rope_theta": c.rope.theta,
        "rope_scaling": None if c.rope.kind == "default" else rope, "dtype": c.dtype,
        "torch_dtype": c.dtype,
    }
    if c.bos_token_id is not None:
        cfg["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        cfg["eos_token_id"] = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
    return cfg


def _layer_tensors(p: dict, prefix: str, c: ModelConfig, out: dict, dtype: str):
    """Un-fuses one decoder layer's params into Hugging Face tensor names."""
    H, Hkv, Dh, F = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    att, mlp = p["self_attn"], p["mlp"]
    qkv = _hf_linear(att["qkv_proj"], dtype)
    q, k, v = np.split(qkv, [H * Dh, (H + Hkv) * Dh], axis=0)
    a = prefix + "self_attn."
    out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
                a + "o_proj.weight": _hf_linear(att["o_proj"], dtype)})
    if "bias" in att["qkv_proj"]:
        qb, kb, vb = np.split(_np(att["qkv_proj"]["bias"], dtype), [H * Dh, (H + Hkv) * Dh])
        out.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb})
    if "bias" in att["o_proj"]:
        out[a + "o_proj.bias"] = _np(att["o_proj"]["bias"], dtype)
    gate, up = np.split(_hf_linear(mlp["gate_up_proj"], dtype), [F], axis=0)
    out.update({prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": _hf_linear(mlp["down_proj"], dtype)})
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        if norm in p:
            out[prefix + norm + ".weight"] = _np(p[norm]["weight"], dtype)


def _write(path: str, cfg: dict, tensors: dict, max_shard_bytes: int | None = None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if max_shard_bytes is None or sum(t.nbytes for t in tensors.values()) <= max_shard_bytes:
        safetensors_io.save(os.path.join(path, "model.safetensors"), tensors)
        return
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        if cur and size + tensors[name].nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += tensors[name].nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors_io.save(os.path.join(path, fname), shard)
        weight_map.update({n: fname for n in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)


def save_target(path: str, c: ModelConfig, weights, tokenizer=None, max_shard_bytes: int | None = None):
    """A Llama-architecture model (target or standalone draft) as a transformers directory."""
    p = weights["params"]
    dt = c.dtype
    t = {"model.embed_tokens.weight": _np(p["embed_tokens"]["embedding"], dt),
         "model.norm.weight": _np(p["norm"]["weight"], dt)}
    for i in range(c.num_layers):
        _layer_tensors(p[f"layers_{i}"], f"model.layers.{i}.", c, t, dt)
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = _hf_linear(p["lm_head"], dt)
    _write(path, hf_config(c), t, max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_draft(path: str, d: DraftConfig, weights, target_vocab: int):
    """An EAGLE / EAGLE-3 head, or a standalone draft, in the format its loaders expect."""
    if d.kind == "standalone":
        return save_target(path, d.model, weights)
    c, dt, p = d.model, d.model.dtype, weights["params"]
    t: dict = {}
    if d.kind == "eagle":
        cfg = hf_config(c, "LlamaForCausalLMEagle")
        t["fc.weight"] = _hf_linear(p["fc"], dt)
        if "bias" in p["fc"]:
            t["fc.bias"] = _np(p["fc"]["bias"], dt)
        for i in range(c.num_layers):
            _layer_tensors(p[f"layers_{i}"], f"layers.{i}.", c, t, dt)
    else:
        cfg = hf_config(c, "LlamaForCausalLMEagle3")
        cfg.update(num_hidden_layers=1, draft_vocab_size=d.draft_vocab_size,
                   target_hidden_size=d.target_hidden_size,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in d.aux_layers]})
        t["fc.weight"] = _hf_linear(p["fc"], dt)
        _layer_tensors(p["midlayer"], "midlayer.", c, t, dt)
        t["norm.weight"] = _np(p["norm"]["weight"], dt)
        t["lm_head.weight"] = _hf_linear(p["lm_head"], dt)
        if "embed" in weights:
            t["embed_tokens.weight"] = _np(weights["embed"], dt)
        if "d2t" in weights:
            d2t = np.asarray(jax.device_get(weights["d2t"])).astype(np.int64)
            t["d2t"] = d2t
            t2d = np.zeros((target_vocab,), bool)
            t2d[np.arange(d2t.shape[0]) + d2t] = True
            t["t2d"] = t2d
    _write(path, cfg, t)
