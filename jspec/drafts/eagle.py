"""EAGLE (1/2) heads: fc([token embedding; target hidden]) -> decoder layer(s) -> hidden,
read out by the target's own LM head (`LlamaForCausalLMEagle`)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jspec import sharding
from jspec.cache.layout import prefill_meta
from jspec.drafts.base import LlamaDraft, strip_model_prefix
from jspec.models import family_for
from jspec.models.eagle import Eagle1Head
from jspec.models.llama_hf import decoder_layer_params, hf_config, layer_tensors, model_config_from_hf
from jspec.tensors import Tensors, hf_linear, to_numpy
from jspec.tuning import DEFAULT_TUNING

ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def head_model_config(cfg_json, tcfg, where):
    """An EAGLE-family head's decoder config, in the target's dtype, checked against the
    target's vocabulary."""
    m = model_config_from_hf(cfg_json, dtype=tcfg.dtype, require_architecture=False)
    if m.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{where}: draft vocab_size ({m.vocab_size}) differs from the target's "
                         f"({tcfg.vocab_size})")
    return m


def embed_tokens(tcfg, tw, dw, tokens):
    """An EAGLE-family head's input embeddings: its own table if it has one, else the target's."""
    table = dw.get("embed")
    return family_for(tcfg).embed(tcfg, tw, tokens) if table is None else sharding.lookup_rows(table, tokens)


@dataclasses.dataclass(frozen=True)
class EagleDraft(LlamaDraft):
    """An EAGLE-1/2 head; its feature is the target's final-norm hidden state (width D)."""

    kind = "eagle"
    fc_bias: bool = False

    def target_features(self, hidden, aux):
        return hidden

    def forward(self, tcfg, tw, dw, tokens, feats, cache, meta, from_target: bool, tuning=DEFAULT_TUNING):
        embeds = embed_tokens(tcfg, tw, dw, tokens)
        return Eagle1Head(self.model, self.fc_bias, tuning).apply({"params": dw["params"]}, embeds,
                                                                  feats.astype(embeds.dtype), cache, meta)

    def logits(self, tcfg, tw, dw, hidden, tuning=DEFAULT_TUNING):
        return family_for(tcfg).logits(tcfg, tw, hidden, tuning=tuning)

    def init(self, key, target_vocab: int):
        m, T = self.model, 2
        x = jnp.zeros((1, T, m.hidden_size), m.jnp_dtype)
        meta = prefill_meta(jnp.full((1,), T, jnp.int32), T)
        return {"params": Eagle1Head(m, self.fc_bias).init(key, x, x, None, meta)["params"]}

    @classmethod
    def recognises(cls, cfg_json, tensors):
        names = strip_model_prefix(tensors)
        return any(a in ARCHITECTURES for a in cfg_json.get("architectures") or []) or (
            "fc.weight" in names and any(k.startswith("layers.") for k in names))

    @classmethod
    def from_hf(cls, cfg_json, tensors, tcfg, where):
        m = head_model_config(cfg_json, tcfg, where)
        D = m.hidden_size
        if D != tcfg.hidden_size:
            raise ValueError(f"{where}: EAGLE head hidden size {D} differs from the target's {tcfg.hidden_size}")
        t = Tensors(strip_model_prefix(tensors), where, m.dtype)
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
        return cls(m, fc_bias=fc_bias), {"params": p}

    def to_hf(self, weights, target_vocab: int):
        c, dt, p = self.model, self.model.dtype, weights["params"]
        t = {"fc.weight": hf_linear(p["fc"], dt)}
        if "bias" in p["fc"]:
            t["fc.bias"] = to_numpy(p["fc"]["bias"], dt)
        for i in range(c.num_layers):
            layer_tensors(p[f"layers_{i}"], f"layers.{i}.", c, t, dt)
        return hf_config(c, ARCHITECTURES[0]), t
