"""EAGLE-3 heads (`LlamaForCausalLMEagle3`, the format SGLang and vLLM load): the feature is
the concatenated inputs of three target layers, projected by fc; one decoder layer; its own
norm and LM head over a draft vocabulary, with `d2t` mapping draft ids to target ids."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache.layout import prefill_meta
from jspec.drafts.base import LlamaDraft, strip_model_prefix
from jspec.drafts.eagle import embed_tokens, head_model_config
from jspec.models.eagle import Eagle3Head
from jspec.models.llama_hf import decoder_layer_params, hf_config, layer_tensors
from jspec.tensors import Tensors, hf_linear, to_numpy
from jspec.tuning import DEFAULT_TUNING

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


# The one rule for EAGLE-3 features, in loading and training alike: a head reads the
# inputs of target layers i in 1..n (i = n: the last layer's output, before the final
# norm), which SGLang's and vLLM's `eagle_aux_hidden_state_layer_ids` name as the outputs
# of layers i - 1 (0..n-1); the embeddings (i = 0) are not a layer's output and are refused.


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The default EAGLE-3 features: SGLang's, the inputs of layers 2, n/2 and n-3 (the
    outputs of layers 1, n/2 - 1, n - 4), each moved into 1..n for targets of fewer than
    four layers (a 3-layer target: 2, 1, 1)."""
    n = num_target_layers
    return tuple(min(max(i, 1), n) for i in (2, n // 2, n - 3))


def check_aux_layers(layers, num_target_layers: int, fix: str) -> tuple[int, ...]:
    """Auxiliary layers checked against an n-layer target (each in 1..n); `fix` says where
    to choose others."""
    n = num_target_layers
    layers = tuple(int(i) for i in layers)
    if not layers or any(not 1 <= i <= n for i in layers):
        raise ValueError(f"EAGLE-3 auxiliary layers {layers} (the inputs of these target layers; "
                         f"eagle_aux_hidden_state_layer_ids {[i - 1 for i in layers]}) do not fit a {n}-layer target: "
                         f"each must be in 1..{n} (ids 0..{n - 1}); {fix}")
    return layers


def eagle3_aux_layers(cfg_json: dict, num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose inputs an EAGLE-3 head reads (SGLang's convention)."""
    ids = (cfg_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(i + 1 for i in ids) if ids else default_aux_layers(num_target_layers)
    return check_aux_layers(layers, num_target_layers,
                            "set eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json")


@dataclasses.dataclass(frozen=True)
class Eagle3Draft(LlamaDraft):
    """target_hidden_size: the target's width Dt; aux_layers: the target layers whose
    inputs form the feature [B,T,3*Dt]; draft_vocab_size: Vd (< V needs `d2t`)."""

    kind = "eagle3"
    target_hidden_size: int = 0
    aux_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0

    @property
    def vocab_size(self) -> int:
        return self.draft_vocab_size or self.model.vocab_size

    @property
    def target_layers(self):
        return tuple(sorted(set(self.aux_layers)))

    def target_features(self, hidden, aux):
        return jnp.concatenate([aux[i] for i in self.aux_layers], axis=-1)

    def _head(self, tuning=DEFAULT_TUNING):
        return Eagle3Head(self.model, self.draft_vocab_size, tuning)

    def forward(self, tcfg, tw, dw, tokens, feats, cache, meta, from_target: bool, tuning=DEFAULT_TUNING):
        embeds = embed_tokens(tcfg, tw, dw, tokens)
        return self._head(tuning).apply({"params": dw["params"]}, embeds, feats.astype(embeds.dtype), cache, meta,
                                        from_target)

    def logits(self, tcfg, tw, dw, hidden, tuning=DEFAULT_TUNING):
        return self._head(tuning).apply({"params": dw["params"]}, hidden, method=Eagle3Head.head)

    def to_target_ids(self, dw, ids):
        d2t = dw.get("d2t")
        return ids if d2t is None else ids + d2t[ids]

    def init(self, key, target_vocab: int):
        m, T = self.model, 2
        embeds = jnp.zeros((1, T, m.hidden_size), m.jnp_dtype)
        feats = jnp.zeros((1, T, len(self.aux_layers) * self.target_hidden_size), m.jnp_dtype)
        meta = prefill_meta(jnp.full((1,), T, jnp.int32), T)
        out = {"params": self._head().init(key, embeds, feats, None, meta, method=Eagle3Head.init_all)["params"]}
        if self.draft_vocab_size != target_vocab:
            out["d2t"] = jnp.zeros((self.draft_vocab_size,), jnp.int32)
        return out

    @classmethod
    def recognises(cls, cfg_json, tensors):
        return any(a in ARCHITECTURES for a in cfg_json.get("architectures") or []) or any(
            k.startswith("midlayer.") for k in strip_model_prefix(tensors))

    @classmethod
    def from_hf(cls, cfg_json, tensors, tcfg, where):
        m = head_model_config(cfg_json, tcfg, where)
        D, V = m.hidden_size, tcfg.vocab_size
        Dt = int(cfg_json.get("target_hidden_size") or D)
        if Dt != tcfg.hidden_size:
            raise ValueError(f"{where}: EAGLE-3 head expects target hidden size {Dt}, the target has "
                             f"{tcfg.hidden_size}")
        if m.num_layers != 1:
            raise ValueError(f"{where}: EAGLE-3 heads with {m.num_layers} layers are not supported (only 1)")
        aux = eagle3_aux_layers(cfg_json, tcfg.num_layers)
        Vd = int(cfg_json.get("draft_vocab_size") or V)
        if Vd > V:
            raise ValueError(f"{where}: draft_vocab_size {Vd} exceeds the target vocabulary {V}")
        t = Tensors(strip_model_prefix(tensors), where, m.dtype)
        p = {"fc": t.linear(("fc.weight", (D, len(aux) * Dt)))}
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
        elif D != tcfg.hidden_size:
            raise ValueError(f"{where}: EAGLE-3 head of width {D} has no embed_tokens and cannot share the "
                             f"target's (width {tcfg.hidden_size})")
        t.finish()
        return cls(m, target_hidden_size=Dt, aux_layers=aux, draft_vocab_size=Vd), weights

    def to_hf(self, weights, target_vocab: int):
        c, dt, p = self.model, self.model.dtype, weights["params"]
        cfg = hf_config(c, ARCHITECTURES[0])
        cfg.update(num_hidden_layers=1, draft_vocab_size=self.draft_vocab_size,
                   target_hidden_size=self.target_hidden_size,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layers]})
        t = {"fc.weight": hf_linear(p["fc"], dt)}
        layer_tensors(p["midlayer"], "midlayer.", c, t, dt)
        t["norm.weight"] = to_numpy(p["norm"]["weight"], dt)
        t["lm_head.weight"] = hf_linear(p["lm_head"], dt)
        if "embed" in weights:
            t["embed_tokens.weight"] = to_numpy(weights["embed"], dt)
        if "d2t" in weights:
            d2t = np.asarray(jax.device_get(weights["d2t"])).astype(np.int64)
            t["d2t"] = d2t
            t2d = np.zeros((target_vocab,), bool)
            t2d[np.arange(d2t.shape[0]) + d2t] = True
            t["t2d"] = t2d
        return cfg, t
