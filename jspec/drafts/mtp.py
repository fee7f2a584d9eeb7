"""MTP (NextN) drafts: a DeepSeek-V3 checkpoint's own multi-token-prediction layer.

The layer (`jspec.models.deepseek.MtpLayer`) reads, with token i+1, the hidden state that
predicted it: first the target's final-norm hidden state at i (what SGLang's NextN model
and transformers' `MTPCandidateGenerator` feed `hnorm`), then its own output, so one
layer runs S times for a chain or a tree, like an EAGLE head. It keeps its own MLA latent
cache and is extended on the accepted tokens after each round.

Where the weights come from:
- `jspec.load(dir, draft="mtp")`: the target's checkpoint, layer `model.layers.{L}` (L =
  num_hidden_layers; the first of `num_nextn_predict_layers`).
- `jspec.load(dir, draft=nextn_dir)`: a NextN directory as SGLang's
  `export_deepseek_nextn.py` writes it (architecture `DeepseekV3ForCausalLMNextN`, one layer
  at `model.layers.0`).
`embed_tokens` and `shared_head.head` are optional in both: missing, or equal to the
target's, the target's embedding and LM head are used (no copy).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from jspec.cache.layout import prefill_meta
from jspec.drafts.base import Draft
from jspec.drafts.eagle import embed_tokens
from jspec.models import family_for
from jspec.models import deepseek_hf
from jspec.models.deepseek import MtpLayer
from jspec.models.deepseek_split import split_deepseek
from jspec.models.deepseek_hf import DeepseekConfig
from jspec.models.layers import product
from jspec.tensors import Tensors, hf_linear, to_numpy
from jspec.tuning import DEFAULT_TUNING

NEXTN_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"
_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")  # the layer's tensors besides its block


def layer_config(c: DeepseekConfig) -> DeepseekConfig:
    """The MTP layer's config: one layer, MoE whenever the model has routed experts (the
    first_k_dense_replace rule counts the target's layers, not the MTP layer's), on one
    device (`MtpDraft.split` splits it as the target's layers are)."""
    return c.replace(num_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0, devices=1)


def _check_against_target(m: DeepseekConfig, tcfg, where: str):
    if not isinstance(tcfg, DeepseekConfig):
        raise ValueError(f"{where}: an MTP (NextN) draft needs a DeepSeek target, got a "
                         f"{type(tcfg).__name__} target")
    for name in ("hidden_size", "vocab_size"):
        if getattr(m, name) != getattr(tcfg, name):
            raise ValueError(f"{where}: MTP layer {name} ({getattr(m, name)}) differs from the target's "
                             f"({getattr(tcfg, name)})")


@dataclasses.dataclass(frozen=True)
class MtpDraft(Draft):
    """`model`: the MTP layer's config (`layer_config`)."""

    kind = "mtp"
    layer: ClassVar[type] = MtpLayer  # the layer's Flax module: (embeds, feats, cache, meta) -> (hidden, cache)

    def target_features(self, hidden, aux):
        return hidden

    def cache_kind(self):
        return family_for(self.model).cache_kind(self.model)

    def forward(self, tcfg, tw, dw, tokens, feats, cache, meta, from_target: bool, tuning=DEFAULT_TUNING):
        embeds = embed_tokens(tcfg, tw, dw, tokens)
        return self.layer(self.model, tuning).apply({"params": dw["params"]}, embeds, feats.astype(embeds.dtype),
                                                  cache, meta)

    def logits(self, tcfg, tw, dw, hidden, tuning=DEFAULT_TUNING):
        head = dw.get("head")  # [D, V]
        if head is None:
            return family_for(tcfg).logits(tcfg, tw, hidden, tuning=tuning)
        return product(hidden, head, float32_out=True, tuning=tuning)

    def init(self, key, target_vocab: int):
        m, T = self.model, 2
        x = jnp.zeros((1, T, m.hidden_size), m.jnp_dtype)
        meta = prefill_meta(jnp.full((1,), T, jnp.int32), T)
        return {"params": self.layer(m).init(key, x, x, None, meta)["params"]}

    @classmethod
    def serves(cls, tcfg) -> bool:
        return isinstance(tcfg, DeepseekConfig)

    def split(self, weights, n: int):
        """Split as the target's layers are (`models.deepseek_split.split_deepseek`); eh_proj and
        the norms replicated, an own embedding or head by vocabulary."""
        model, weights, specs = split_deepseek(self.model, weights, n)
        return dataclasses.replace(self, model=model), weights, specs

    @classmethod
    def recognises(cls, cfg_json, tensors):
        return NEXTN_ARCHITECTURE in (cfg_json.get("architectures") or [])

    @classmethod
    def from_hf(cls, cfg_json, tensors, tcfg, where):
        """A NextN directory: the layer at `model.layers.0`."""
        if int(cfg_json.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{where}: a NextN directory holds one layer (num_hidden_layers 1), got "
                             f"{cfg_json.get('num_hidden_layers')}")
        m = layer_config(deepseek_hf.config_from_hf(cfg_json, tcfg.dtype, where))
        _check_against_target(m, tcfg, where)
        return cls(m), _weights(Tensors(tensors, where, m.dtype), "model.layers.0.", m, shared={})

    @classmethod
    def from_target_checkpoint(cls, tensors: dict, tcfg, where: str) -> tuple["MtpDraft", Any]:
        """The first MTP layer of a target's own checkpoint (`draft="mtp"`)."""
        m = layer_config(tcfg) if isinstance(tcfg, DeepseekConfig) else None
        if m is None or not tcfg.num_nextn_predict_layers:
            raise ValueError(f"{where}: draft='mtp' needs a checkpoint with MTP layers; this one has none "
                             f"(config.json num_nextn_predict_layers is "
                             f"{getattr(tcfg, 'num_nextn_predict_layers', 'absent')})")
        prefix = f"model.layers.{tcfg.num_layers}."
        if prefix + "eh_proj.weight" not in tensors:
            raise ValueError(f"{where}: config.json declares {tcfg.num_nextn_predict_layers} MTP layer(s) but the "
                             f"safetensors hold no {prefix}eh_proj.weight (weights saved without the MTP layer?)")
        shared = {"embed_tokens.weight": tensors.get("model.embed_tokens.weight"),
                  "shared_head.head.weight": tensors.get("lm_head.weight")}
        others = tuple(f"model.layers.{tcfg.num_layers + j}." for j in range(1, tcfg.num_nextn_predict_layers))
        t = Tensors({k: v for k, v in tensors.items() if k.startswith(prefix)}, where, m.dtype)
        return cls(m), _weights(t, prefix, m, shared=shared, ignore_prefixes=others)

    def to_hf(self, weights, target_vocab: int):
        """-> a NextN directory's config.json and tensors (`model.layers.0.`)."""
        m, dt = self.model, self.model.dtype
        cfg = deepseek_hf.hf_config(m.replace(num_nextn_predict_layers=1))
        cfg.update(architectures=[NEXTN_ARCHITECTURE], num_hidden_layers=1)
        p, pre = weights["params"], "model.layers.0."
        out = deepseek_hf.layer_tensors(p["block"], pre, m, 0, {})
        out.update({pre + "enorm.weight": to_numpy(p["enorm"]["weight"], dt),
                    pre + "hnorm.weight": to_numpy(p["hnorm"]["weight"], dt),
                    pre + "eh_proj.weight": hf_linear(p["eh_proj"], dt),
                    pre + "shared_head.norm.weight": to_numpy(p["shared_head_norm"]["weight"], dt)})
        if "embed" in weights:
            out[pre + "embed_tokens.weight"] = to_numpy(weights["embed"], dt)
        if "head" in weights:
            out[pre + "shared_head.head.weight"] = np.ascontiguousarray(to_numpy(weights["head"], dt).T)
        return cfg, out


def _weights(t: Tensors, prefix: str, m: DeepseekConfig, *, shared: dict, ignore_prefixes=()) -> dict:
    """The layer's tensors under `prefix` -> draft weights; an embedding or head equal to the
    target's (`shared`: the target's on-disk tensors by MTP name) is not kept."""
    D, V = m.hidden_size, m.vocab_size
    p = {"block": deepseek_hf.layer_params(t, prefix, m, 0),
         "enorm": {"weight": t.param((prefix + "enorm.weight", (D,)))},
         "hnorm": {"weight": t.param((prefix + "hnorm.weight", (D,)))},
         "eh_proj": t.linear((prefix + "eh_proj.weight", (D, 2 * D))),
         "shared_head_norm": {"weight": t.param((prefix + "shared_head.norm.weight", (D,)))}}
    weights: dict[str, Any] = {"params": p}
    for name, key, shape in (("embed_tokens.weight", "embed", (V, D)), ("shared_head.head.weight", "head", (V, D))):
        if not t.has(prefix + name):
            continue
        same = shared.get(name)
        if same is not None and same.shape == t.tensors[prefix + name].shape and np.array_equal(
                same, t.tensors[prefix + name]):
            t.ignore(prefix + name)
        else:
            arr = t.param((prefix + name, shape))
            weights[key] = arr if key == "embed" else arr.T
    t.ignore(*[k for k in list(t.tensors) if k.startswith(tuple(ignore_prefixes))])
    t.finish()
    return weights
