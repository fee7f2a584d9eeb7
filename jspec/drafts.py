"""Draft models: loading (EAGLE, EAGLE-3, standalone) and one functional interface.

Every draft is used through the same four functions, so the speculative loop never asks
which kind it runs:

- `target_capture(d)`: target layers whose inputs the draft needs.
- `target_features(d, hidden, aux)`: the per-token feature [B,T,F] the draft reads.
- `draft_forward(...)`: (tokens, features) -> draft hidden [B,T,Dd] and the draft cache.
- `draft_logits(...)`: hidden -> float32 logits over the draft vocabulary; `to_target_ids`
  maps draft ids to target ids.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from jspec.cache.kv import AttnMeta, KVCache
from jspec.config import DraftConfig, ModelConfig, model_config_from_hf
from jspec.loading import (DraftParams, Params, _Tensors, decoder_layer_params, read_config, read_tensors,
                           target_params_from_tensors)
from jspec.models import target as tgt
from jspec.models.eagle import Eagle1Head, Eagle3Head
from jspec.models.llama import LlamaModel

EAGLE_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


# ----------------------------------------------------------------------------- interface

def target_capture(d: DraftConfig) -> tuple[int, ...]:
    return tuple(sorted(set(d.aux_layers))) if d.kind == "eagle3" else ()


def target_features(d: DraftConfig, hidden, aux):
    """Target outputs -> draft feature [B,T,F] (None for a standalone draft)."""
    if d.kind == "eagle":
        return hidden
    if d.kind == "eagle3":
        return jnp.concatenate([aux[i] for i in d.aux_layers], axis=-1)
    return None


def draft_forward(d: DraftConfig, dw, tw, tcfg: ModelConfig, tokens, feats, cache: KVCache,
                  meta: AttnMeta, from_target: bool):
    """tokens [B,T] (target ids), feats [B,T,F] -> (hidden [B,T,Dd], cache).

    dw: the draft's weights (`DraftParams.weights`); tw: the target's.
    from_target: feats are target features (True) or the draft's own hidden (False).
    """
    if d.kind == "standalone":
        hidden, _, cache = LlamaModel(d.model).apply({"params": dw["params"]}, tokens, cache, meta)
        return hidden, cache
    embeds = _embed(dw, tw, tcfg, tokens)
    if d.kind == "eagle":
        return Eagle1Head(d.model, d.fc_bias).apply({"params": dw["params"]}, embeds,
                                                     feats.astype(embeds.dtype), cache, meta)
    return Eagle3Head(d.model, d.draft_vocab_size).apply({"params": dw["params"]}, embeds,
                                                         feats.astype(embeds.dtype), cache, meta, from_target)


def draft_logits(d: DraftConfig, dw, tw, tcfg: ModelConfig, hidden):
    """hidden [..., Dd] -> float32 logits [..., Vd]."""
    if d.kind == "standalone":
        return LlamaModel(d.model).apply({"params": dw["params"]}, hidden, method=LlamaModel.logits)
    if d.kind == "eagle":
        return tgt.logits(tw, tcfg, hidden)
    return Eagle3Head(d.model, d.draft_vocab_size).apply({"params": dw["params"]}, hidden,
                                                         method=Eagle3Head.head)


def to_target_ids(dw, ids):
    """Draft-vocabulary ids -> target ids (identity unless EAGLE-3 with a reduced vocab)."""
    d2t = dw.get("d2t")
    return ids if d2t is None else ids + d2t[ids]


def _embed(dw, tw, tcfg, tokens):
    table = dw.get("embed")
    if table is None:
        return tgt.embed(tw, tcfg, tokens)
    return table[tokens]


# ------------------------------------------------------------------------------- loading

def _detect_kind(cfg: dict, tensors: dict, where: str) -> str:
    archs = cfg.get("architectures") or []
    if any(a in EAGLE3_ARCHS for a in archs) or any(k.startswith("midlayer.") for k in tensors):
        return "eagle3"
    if any(a in EAGLE_ARCHS for a in archs) or ("fc.weight" in tensors and any(k.startswith("layers.") for k in tensors)):
        return "eagle"
    from jspec.config import TARGET_ARCHITECTURES
    if any(a in TARGET_ARCHITECTURES for a in archs):
        return "standalone"
    raise ValueError(f"{where}: unknown draft architecture {archs!r}; expected an EAGLE head "
                     f"({EAGLE_ARCHS[0]}), an EAGLE-3 head ({EAGLE3_ARCHS[0]}) or a Llama-family model")


def load_draft(draft_dir: str, target: Params) -> DraftParams:
    """Loads and checks a draft against its target; recognises EAGLE, EAGLE-3, standalone."""
    cfg = read_config(draft_dir)
    where = os.fspath(draft_dir)
    tensors = read_tensors(draft_dir)
    stripped = {(k[6:] if k.startswith("model.") else k): v for k, v in tensors.items()}
    kind = _detect_kind(cfg, stripped, where)
    tc = target.config
    if kind == "standalone":
        m = model_config_from_hf(cfg, dtype=tc.dtype)
        if m.vocab_size != tc.vocab_size:
            raise ValueError(f"{where}: draft vocabulary ({m.vocab_size}) differs from the target's "
                             f"({tc.vocab_size}); a standalone draft must share the target's tokenizer")
        weights = target_params_from_tensors(tensors, m, where)
        return DraftParams(DraftConfig("standalone", m), weights, where)
    tensors = stripped  # EAGLE heads: "model." prefixes are optional in the wild
    m = model_config_from_hf(cfg, dtype=tc.dtype, require_architecture=False)
    if m.vocab_size != tc.vocab_size:
        raise ValueError(f"{where}: draft vocab_size ({m.vocab_size}) differs from the target's ({tc.vocab_size})")
    if kind == "eagle":
        return _load_eagle1(cfg, m, tensors, target, where)
    return _load_eagle3(cfg, m, tensors, target, where)


def _load_eagle1(cfg, m: ModelConfig, tensors, target: Params, where) -> DraftParams:
    tc = target.config
    D = m.hidden_size
    if D != tc.hidden_size:
        raise ValueError(f"{where}: EAGLE head hidden size {D} differs from the target's {tc.hidden_size}")
    t = _Tensors(tensors, where, m.dtype)
    fc_bias = t.has("fc.bias")
    p = {"fc": t.linear(("fc.weight", (D, 2 * D)))}
    if fc_bias:
        p["fc"]["bias"] = t.param(("fc.bias", (D,)))
    for i in range(m.num_layers):
        pre = f"layers.{i}."
        layer = decoder_layer_params(t, pre, m)
        if i > 0:
            layer["input_layernorm"] = {"weight": t.param((pre + "input_layernorm.weight", (D,)))}
        else:
            t.ignore(pre + "input_layernorm.weight")
        p[f"layers_{i}"] = layer
    t.ignore("embed_tokens.weight", "lm_head.weight", "norm.weight")  # the target's are used
    t.finish()
    return DraftParams(DraftConfig("eagle", m, target_hidden_size=D, draft_vocab_size=tc.vocab_size,
                                   fc_bias=fc_bias), {"params": p}, where)


def eagle3_aux_layers(cfg: dict, num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose inputs an EAGLE-3 head reads (SGLang's convention)."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    layers = tuple(i + 1 for i in ids) if ids else (2, n // 2, n - 3)
    if any(not 0 <= i <= n for i in layers):
        raise ValueError(f"EAGLE-3 auxiliary layers {layers} do not fit a {n}-layer target; set "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json")
    return layers


def _load_eagle3(cfg, m: ModelConfig, tensors, target: Params, where) -> DraftParams:
    tc = target.config
    D, V = m.hidden_size, tc.vocab_size
    Dt = int(cfg.get("target_hidden_size") or D)
    if Dt != tc.hidden_size:
        raise ValueError(f"{where}: EAGLE-3 head expects target hidden size {Dt}, the target has {tc.hidden_size}")
    if m.num_layers != 1:
        raise ValueError(f"{where}: EAGLE-3 heads with {m.num_layers} layers are not supported (only 1)")
    aux = eagle3_aux_layers(cfg, tc.num_layers)
    Vd = int(cfg.get("draft_vocab_size") or V)
    if Vd > V:
        raise ValueError(f"{where}: draft_vocab_size {Vd} exceeds the target vocabulary {V}")
    t = _Tensors(tensors, where, m.dtype)
    fc_in = len(aux) * Dt
    p = {"fc": t.linear(("fc.weight", (D, fc_in)))}
    layer = decoder_layer_params(t, "midlayer.", m, attn_in=2 * D)
    layer["input_layernorm"] = {"weight": t.param(("midlayer.input_layernorm.weight", (D,)))}
    layer["hidden_norm"] = {"weight": t.param(("midlayer.hidden_norm.weight", (D,)))}
    p["midlayer"] = layer
    p["norm"] = {"weight": t.param(("norm.weight", (D,)))}
    p["lm_head"] = t.linear(("lm_head.weight", (Vd, D)))
    weights = {"params": p}
    if t.has("d2t"):
        d2t = t.take("d2t", (Vd,)).astype(np.int64)
        ids = np.arange(Vd) + d2t
        if ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"{where}: d2t maps draft ids outside the target vocabulary")
        weights["d2t"] = jnp.asarray(d2t, jnp.int32)
    elif Vd != V:
        raise ValueError(f"{where}: EAGLE-3 head has a reduced vocabulary ({Vd} < {V}) but no 'd2t' tensor")
    t.ignore("t2d")
    if t.has("embed_tokens.weight"):
        weights["embed"] = t.param(("embed_tokens.weight", (V, D)))
    elif D != tc.hidden_size:
        raise ValueError(f"{where}: EAGLE-3 head of width {D} has no embed_tokens and cannot share the "
                         f"target's (width {tc.hidden_size})")
    t.finish()
    return DraftParams(DraftConfig("eagle3", m, target_hidden_size=Dt, aux_layers=aux, draft_vocab_size=Vd),
                       weights, where)


# ---------------------------------------------------------------------------- creation

def init_draft_weights(d: DraftConfig, key, target_vocab: int) -> dict:
    """Random weights for a draft of config `d` (normal(0.02); norms at one)."""
    import jax
    m = d.model
    T = 2
    meta = tgt.prefill_meta(jnp.full((1,), T, jnp.int32), T)
    tokens = jnp.zeros((1, T), jnp.int32)
    if d.kind == "standalone":
        return {"params": LlamaModel(m).init(key, tokens, None, meta, method=LlamaModel.init_all)["params"]}
    embeds = jnp.zeros((1, T, m.hidden_size), m.jnp_dtype)
    if d.kind == "eagle":
        feats = jnp.zeros((1, T, m.hidden_size), m.jnp_dtype)
        return {"params": Eagle1Head(m, d.fc_bias).init(key, embeds, feats, None, meta)["params"]}
    feats = jnp.zeros((1, T, len(d.aux_layers) * d.target_hidden_size), m.jnp_dtype)
    params = Eagle3Head(m, d.draft_vocab_size).init(key, embeds, feats, None, meta,
                                                    method=Eagle3Head.init_all)["params"]
    out = {"params": params}
    if d.draft_vocab_size != target_vocab:
        out["d2t"] = jnp.zeros((d.draft_vocab_size,), jnp.int32)
    return out
