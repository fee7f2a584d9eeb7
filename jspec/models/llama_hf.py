"""Llama-family checkpoints in Hugging Face's format: config.json parsing and weights in
both directions (q/k/v and gate/up fused on load, split again on export).

The fused matrices keep whatever belongs together next to each other, so that any even
split of their columns over devices (`jspec.sharding`) gives each device whole pieces:
`qkv_proj` holds, per KV head g, the query heads that read it, then its key head, then
its value head ([Hkv, H/Hkv + 2, Dh] columns); `gate_up_proj` interleaves the gate and up
columns ([F, 2]).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jspec.config import DTYPES, ModelConfig, RopeConfig
from jspec.tensors import Tensors, hf_linear, kv_scale_tensors, to_numpy

# Hugging Face `architectures` entries a target may declare, by family.
TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(theta=theta, kind="llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    if kind == "yarn":
        old = int(params["original_max_position_embeddings"])
        factor = params.get("factor")
        factor = float(factor) if factor is not None else float(cfg["max_position_embeddings"]) / old
        att = params.get("attention_factor")
        return RopeConfig(theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=old,
                          beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                          mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                          attention_factor=None if att is None else float(att),
                          truncate=bool(params.get("truncate", True)))
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def model_config_from_hf(cfg: Mapping[str, Any], *, dtype: str | None = None,
                         require_architecture: bool = True) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face config.json dict."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "llama")
    arch = next((a for a in archs if a in TARGET_ARCHITECTURES), None)
    if arch is None:
        if require_architecture:
            raise ValueError(f"unsupported architecture {archs or model_type!r}; jspec supports "
                             f"{sorted(TARGET_ARCHITECTURES)}")
        arch = _ARCH_BY_MODEL_TYPE.get(model_type, "LlamaForCausalLM")
    family = TARGET_ARCHITECTURES[arch]
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} (jspec supports silu)")
    D = int(cfg["hidden_size"])
    H = int(cfg["num_attention_heads"])
    Hkv = int(cfg.get("num_key_value_heads") or H)
    head_dim = cfg.get("head_dim") or D // H
    L = int(cfg["num_hidden_layers"])
    if family == "mistral":
        windows = (int(cfg.get("sliding_window") or 0),) * L
    elif family in ("qwen2", "qwen3") and cfg.get("sliding_window"):
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", L)) if cfg.get("use_sliding_window") else L
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(L)]
        windows = tuple(int(cfg["sliding_window"]) if t == "sliding_attention" else 0 for t in types)
    else:
        windows = (0,) * L
    eos = cfg.get("eos_token_id")
    eos = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
    if dtype is None:
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]), hidden_size=D,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=L, num_heads=H,
        num_kv_heads=Hkv, head_dim=int(head_dim), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(cfg), max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias and family != "mistral",
        o_bias=attention_bias and family in ("llama", "qwen3"),
        mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=family == "qwen3",
        sliding_windows=windows, dtype=dtype, model_type=family, architecture=arch,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos)


def qkv_order(H: int, Hkv: int, Dh: int, groups: int | None = None) -> np.ndarray:
    """Rows of Hugging Face's concatenated [q; k; v] weights ([(H + 2 Hkv) Dh] rows) in the
    fused order: for each of `groups` KV groups (default Hkv), its H / groups query heads,
    then the key head and the value head they read. groups = n Hkv repeats each KV head n
    times (for more devices than KV heads: `jspec.sharding`)."""
    groups = groups or Hkv
    G, per_kv = H // groups, groups // Hkv
    heads = []
    for j in range(groups):
        heads += list(range(j * G, (j + 1) * G)) + [H + j // per_kv, H + Hkv + j // per_kv]
    return (np.asarray(heads)[:, None] * Dh + np.arange(Dh)[None, :]).reshape(-1)


def gate_up_order(F: int) -> np.ndarray:
    """Rows of [gate; up] ([2F] rows) in the fused order: gate and up column i side by side."""
    return np.stack([np.arange(F), F + np.arange(F)], axis=1).reshape(-1)


def decoder_layer_params(t: Tensors, prefix: str, c: ModelConfig, attn_in: int | None = None) -> dict:
    """One decoder layer's params from `prefix`-named HF tensors (q/k/v and gate/up fused)."""
    D, F, H, Hkv, Dh = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    a_in = attn_in or D
    att = f"{prefix}self_attn."
    qkv = qkv_order(H, Hkv, Dh)
    attn = {"qkv_proj": t.linear((att + "q_proj.weight", (H * Dh, a_in)), (att + "k_proj.weight", (Hkv * Dh, a_in)),
                                 (att + "v_proj.weight", (Hkv * Dh, a_in)), order=qkv),
            "o_proj": t.linear((att + "o_proj.weight", (D, H * Dh)))}
    if c.qkv_bias:
        attn["qkv_proj"]["bias"] = t.param((att + "q_proj.bias", (H * Dh,)), (att + "k_proj.bias", (Hkv * Dh,)),
                                           (att + "v_proj.bias", (Hkv * Dh,)), order=qkv)
    if c.o_bias:
        attn["o_proj"]["bias"] = t.param((att + "o_proj.bias", (D,)))
    if c.qk_norm:
        attn["q_norm"] = {"weight": t.param((att + "q_norm.weight", (Dh,)))}
        attn["k_norm"] = {"weight": t.param((att + "k_norm.weight", (Dh,)))}
    kv_scale = t.kv_scales(att)
    if kv_scale is not None:  # an FP8 cache's per-layer scales (`cache.kv.cached_attention`)
        attn["kv_scale"] = kv_scale
    mlp_p = f"{prefix}mlp."
    gu = gate_up_order(F)
    mlp = {"gate_up_proj": t.linear((mlp_p + "gate_proj.weight", (F, D)), (mlp_p + "up_proj.weight", (F, D)), order=gu),
           "down_proj": t.linear((mlp_p + "down_proj.weight", (D, F)))}
    if c.mlp_bias:
        mlp["gate_up_proj"]["bias"] = t.param((mlp_p + "gate_proj.bias", (F,)), (mlp_p + "up_proj.bias", (F,)), order=gu)
        mlp["down_proj"]["bias"] = t.param((mlp_p + "down_proj.bias", (D,)))
    return {"self_attn": attn, "mlp": mlp,
            "post_attention_layernorm": {"weight": t.param((prefix + "post_attention_layernorm.weight", (D,)))}}


def target_weights_from_tensors(tensors: dict[str, np.ndarray], c: ModelConfig, where: str) -> dict:
    t = Tensors(tensors, where, c.dtype)
    D, V = c.hidden_size, c.vocab_size
    p: dict[str, Any] = {"embed_tokens": {"embedding": t.param(("model.embed_tokens.weight", (V, D)))}}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        layer = decoder_layer_params(t, pre, c)
        layer["input_layernorm"] = {"weight": t.param((pre + "input_layernorm.weight", (D,)))}
        p[f"layers_{i}"] = layer
    p["norm"] = {"weight": t.param(("model.norm.weight", (D,)))}
    if c.tie_word_embeddings:
        t.ignore("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    else:
        p["lm_head"] = t.linear(("lm_head.weight", (V, D)))
    t.finish()
    return {"params": p}


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


def layer_tensors(p: dict, prefix: str, c: ModelConfig, out: dict, dtype: str):
    """Un-fuses one decoder layer's params into Hugging Face tensor names."""
    H, Hkv, Dh, F = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    att, mlp = p["self_attn"], p["mlp"]
    unqkv = np.argsort(qkv_order(H, Hkv, Dh))  # fused order -> [q; k; v]
    q, k, v = np.split(hf_linear(att["qkv_proj"], dtype)[unqkv], [H * Dh, (H + Hkv) * Dh], axis=0)
    a = prefix + "self_attn."
    out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
                a + "o_proj.weight": hf_linear(att["o_proj"], dtype)})
    if "bias" in att["qkv_proj"]:
        qb, kb, vb = np.split(to_numpy(att["qkv_proj"]["bias"], dtype)[unqkv], [H * Dh, (H + Hkv) * Dh])
        out.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb})
    if "bias" in att["o_proj"]:
        out[a + "o_proj.bias"] = to_numpy(att["o_proj"]["bias"], dtype)
    out.update(kv_scale_tensors(att, a))
    ungu = np.argsort(gate_up_order(F))
    gate, up = np.split(hf_linear(mlp["gate_up_proj"], dtype)[ungu], [F], axis=0)
    out.update({prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": hf_linear(mlp["down_proj"], dtype)})
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        if norm in p:
            out[prefix + norm + ".weight"] = to_numpy(p[norm]["weight"], dtype)


def target_tensors(c: ModelConfig, weights) -> dict:
    """A target's (or standalone draft's) weights as `LlamaForCausalLM` tensors."""
    p = weights["params"]
    dt = c.dtype
    t = {"model.embed_tokens.weight": to_numpy(p["embed_tokens"]["embedding"], dt),
         "model.norm.weight": to_numpy(p["norm"]["weight"], dt)}
    for i in range(c.num_layers):
        layer_tensors(p[f"layers_{i}"], f"model.layers.{i}.", c, t, dt)
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = hf_linear(p["lm_head"], dt)
    return t
