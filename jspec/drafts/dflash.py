"""DFlash block drafters (z-lab's `DFlashDraftModel` checkpoints, e.g.
`z-lab/Qwen3-8B-DFlash-b16`): one forward over the root and block_size - 1 mask tokens
proposes the whole block, conditioned on the target's features of every committed token
(`jspec.models.dflash`; the proposer is `jspec.loop.proposers.block`).

The checkpoint: config.json with `architectures: ["DFlashDraftModel"]`, a Qwen3 decoder's
fields, `block_size` and `dflash_config` {`mask_token_id`, `target_layer_ids`} (older
checkpoints keep `block_size` and `target_layer_ids` at the top level); tensors
`layers.{i}.*` (Qwen3 layers), `fc.weight` [D, len(ids) x D], `hidden_norm.weight`,
`norm.weight`. No embedding or LM head: the target's serve (its embedding times
`input_embedding_scale`, its LM head times `output_multiplier`, then
`final_logit_softcapping` if set).

Target layers: `target_layer_ids` name the target layers whose outputs the draft reads
(Hugging Face's `hidden_states[id + 1]`): in jspec's capture convention the inputs of
layers id + 1, and for the last layer (id = n - 1) the target's final-norm hidden, which
is what `hidden_states[n]` holds in transformers.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec import sharding
from jspec.cache.layout import CacheLayout, make_meta
from jspec.drafts.base import Draft, strip_model_prefix
from jspec.models import family_for
from jspec.models.dflash import DFlashModel
from jspec.models.llama import kv_groups
from jspec.models.llama_hf import gate_up_order, model_config_from_hf
from jspec.tensors import HostParam, Tensors, hf_linear, to_numpy
from jspec.tuning import DEFAULT_TUNING

ARCHITECTURE = "DFlashDraftModel"
UNSUPPORTED_ARCHITECTURES = ("DFlash2DraftModel",)  # grouped dynamic convolutions and a candidate selector


# Over n devices: attention by heads (q_proj and kv_proj by columns, o_proj by rows), the MLP
# by columns then rows; fc and the norms replicated.
SPLITS = {("q_proj", "kernel"): P(None, sharding.AXIS), ("q_proj", "bias"): P(sharding.AXIS),
          ("kv_proj", "kernel"): P(None, sharding.AXIS), ("kv_proj", "bias"): P(sharding.AXIS),
          ("o_proj", "kernel"): P(sharding.AXIS, None),
          ("gate_up_proj", "kernel"): P(None, sharding.AXIS), ("down_proj", "kernel"): P(sharding.AXIS, None)}


def kv_order(Hkv: int, Dh: int) -> np.ndarray:
    """Rows of Hugging Face's [k; v] weights ([2 Hkv Dh] rows) in the fused `kv_proj` order:
    per KV head its key rows, then its value rows."""
    heads = [h for j in range(Hkv) for h in (j, Hkv + j)]
    return (np.asarray(heads)[:, None] * Dh + np.arange(Dh)[None, :]).reshape(-1)


def dflash_value(cfg_json: dict, name: str, default=None):
    """A DFlash setting: from `dflash_config`, else the config's top level (older checkpoints)."""
    inner = cfg_json.get("dflash_config") or {}
    return inner[name] if inner.get(name) is not None else cfg_json.get(name, default)


@dataclasses.dataclass(frozen=True)
class DFlashDraft(Draft):
    """A block drafter. `model`: its decoder (Qwen3 layers, width D = the target's);
    target_layer_ids: the target layers whose outputs form the context feature [.., len x D]
    (Hugging Face ids, 0-based); num_target_layers: the target's depth n; block_size: the
    block it was trained on (root included); mask_token_id: the id filling the block after
    the root; embed_scale, logit_scale, softcap: `input_embedding_scale`,
    `output_multiplier`, `final_logit_softcapping` (0: none)."""

    kind = "dflash"
    proposes_blocks: ClassVar[bool] = True
    target_layer_ids: tuple[int, ...] = ()
    num_target_layers: int = 0
    block_size: int = 16
    mask_token_id: int = 0
    embed_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float = 0.0

    @property
    def target_layers(self):
        n = self.num_target_layers
        return tuple(sorted({i + 1 for i in self.target_layer_ids if i + 1 < n}))

    def target_features(self, hidden, aux):
        """The target's final-norm hidden [B,T,D] and layer inputs {i: [B,T,D]} -> the
        context feature [B,T,len(ids) x D]."""
        n = self.num_target_layers
        return jnp.concatenate([hidden if i + 1 == n else aux[i + 1] for i in self.target_layer_ids], axis=-1)

    def embed(self, tcfg, tw, tokens):
        """Block tokens [B,T] -> embeddings [B,T,D]: the target's, times embed_scale."""
        e = family_for(tcfg).embed(tcfg, tw, tokens)
        return e if self.embed_scale == 1.0 else (e * self.embed_scale).astype(e.dtype)

    def block(self, tcfg, tw, dw, tokens, cache, meta, tuning=DEFAULT_TUNING):
        """The block: tokens [B,T] (the root, then mask tokens) at meta.positions, seeing the
        cached context and each other (meta.local_mask) -> (final-norm hidden [B,T,D], cache
        with the block's keys and values written at its slots)."""
        return DFlashModel(self.model, tuning).apply({"params": dw["params"]}, self.embed(tcfg, tw, tokens), cache,
                                                     meta)

    def context(self, tcfg, tw, dw, feats, cache, meta, tuning=DEFAULT_TUNING):
        """Committed tokens' features [B,T,F] (`target_features`) -> the cache with their
        context keys and values written at meta.write_index."""
        return DFlashModel(self.model, tuning).apply({"params": dw["params"]}, feats, cache, meta,
                                                     method=DFlashModel.context)

    def train_blocks(self, tcfg, tw, dw, tokens, feats, meta, tuning=DEFAULT_TUNING):
        """Training: block tokens [B,T] over the context of features [B,Tc,F] in one pass, no
        cache (`DFlashModel.train_blocks`) -> final-norm hidden [B,T,D]."""
        return DFlashModel(self.model, tuning).apply({"params": dw["params"]}, self.embed(tcfg, tw, tokens), feats,
                                                     meta, method=DFlashModel.train_blocks)

    def logits(self, tcfg, tw, dw, hidden, tuning=DEFAULT_TUNING):
        logits = family_for(tcfg).logits(tcfg, tw, hidden, tuning=tuning)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.softcap > 0:
            logits = jnp.tanh(logits / self.softcap) * self.softcap
        return logits

    def split(self, weights, n: int):
        """The drafter over n devices (`SPLITS`); with more devices than KV heads each KV
        head's key and value columns are repeated, as the Llama family's split does."""
        m = self.model
        groups = kv_groups(m, n)
        if groups != m.num_kv_heads:
            width = 2 * m.head_dim  # kv_proj: per KV head its key, then its value columns
            cols = np.concatenate([(g * m.num_kv_heads // groups) * width + np.arange(width) for g in range(groups)])

            def repeat(keys, w):
                if keys[-2:-1] != ("kv_proj",):
                    return w
                return w.take_rows(cols) if isinstance(w, HostParam) else jnp.take(w, jnp.asarray(cols), axis=-1)
            weights = sharding.map_weights(repeat, weights)
            m = m.replace(num_kv_heads=groups)
        return dataclasses.replace(self, model=m), weights, sharding.weight_specs(weights, n, SPLITS)

    def init(self, key, target_vocab: int):
        m, T = self.model, 2
        layout = CacheLayout(paged=False, capacity=2 * T)
        cache = self.cache_kind().init(layout, 1)
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        meta = make_meta(layout, None, positions=pos, prefix_len=jnp.zeros((1,), jnp.int32),
                         local_mask=jnp.ones((1, T, T), bool), write_valid=jnp.ones((1, T), bool))
        embeds = jnp.zeros((1, T, m.hidden_size), m.jnp_dtype)
        feats = jnp.zeros((1, T, len(self.target_layer_ids) * m.hidden_size), m.jnp_dtype)
        return {"params": DFlashModel(m).init(key, embeds, feats, cache, meta, method=DFlashModel.init_all)["params"]}

    @classmethod
    def recognises(cls, cfg_json, tensors):
        archs = cfg_json.get("architectures") or []
        return (any(a == ARCHITECTURE or a in UNSUPPORTED_ARCHITECTURES for a in archs)
                or "dflash_config" in cfg_json)

    @classmethod
    def from_hf(cls, cfg_json, tensors, tcfg, where):
        archs = cfg_json.get("architectures") or []
        bad = [a for a in archs if a in UNSUPPORTED_ARCHITECTURES]
        if bad or any(k.startswith("candidate_selector.") for k in tensors):
            raise ValueError(f"{where}: {bad[0] if bad else 'this DFlash variant'} drafts (grouped dynamic "
                             f"convolutions and a candidate selector) are not supported; jspec reads {ARCHITECTURE}")
        n = tcfg.num_layers
        m = cls.model_config(cfg_json, tcfg, where)
        ids = dflash_value(cfg_json, "target_layer_ids")
        if not ids:
            raise ValueError(f"{where}: a DFlash draft needs dflash_config.target_layer_ids (the target layers "
                             f"whose outputs it reads)")
        ids = tuple(int(i) for i in ids)
        if any(not 0 <= i < n for i in ids):
            raise ValueError(f"{where}: DFlash target_layer_ids {list(ids)} do not fit the {n}-layer target: "
                             f"each must be in 0..{n - 1}")
        depth = cfg_json.get("num_target_layers")
        if depth is not None and int(depth) != n:
            raise ValueError(f"{where}: the DFlash draft was made for a {int(depth)}-layer target "
                             f"(num_target_layers); this target has {n}")
        block = int(dflash_value(cfg_json, "block_size", 16))
        if block < 2:
            raise ValueError(f"{where}: DFlash block_size {block} must be at least 2 (the root and one draft)")
        mask = dflash_value(cfg_json, "mask_token_id")
        if mask is None:
            raise ValueError(f"{where}: a DFlash draft needs dflash_config.mask_token_id (the id that fills "
                             f"the block)")
        if not 0 <= int(mask) < tcfg.vocab_size:
            raise ValueError(f"{where}: DFlash mask_token_id {int(mask)} has no embedding in the target's "
                             f"vocabulary of {tcfg.vocab_size} tokens")
        D, F = m.hidden_size, len(ids) * m.hidden_size
        t = Tensors(strip_model_prefix(tensors), where, m.dtype)
        p = {"fc": t.linear(("fc.weight", (D, F))), "hidden_norm": {"weight": t.param(("hidden_norm.weight", (D,)))},
             "norm": {"weight": t.param(("norm.weight", (D,)))}}
        for i in range(m.num_layers):
            p[f"layers_{i}"] = cls.layer_params(t, f"layers.{i}.", m)
        t.ignore("embed_tokens.weight", "lm_head.weight")  # some exports carry the target's: jspec uses its own
        t.finish()
        draft = cls(m, target_layer_ids=ids, num_target_layers=n, block_size=block, mask_token_id=int(mask),
                    embed_scale=float(dflash_value(cfg_json, "input_embedding_scale", 1.0)),
                    logit_scale=float(dflash_value(cfg_json, "output_multiplier", 1.0)),
                    softcap=float(dflash_value(cfg_json, "final_logit_softcapping", 0.0) or 0.0))
        return draft, {"params": p}

    @staticmethod
    def model_config(cfg_json, tcfg, where):
        """The draft's decoder config: Qwen3 layers (q/k norms always, biases by
        `attention_bias`) in the target's dtype and width, over the target's vocabulary."""
        types = cfg_json.get("layer_types") or []
        if any(t != "full_attention" for t in types) or cfg_json.get("is_causal"):
            raise ValueError(f"{where}: DFlash drafts with causal or sliding-window layers are not supported "
                             f"(layer_types {types}, is_causal {cfg_json.get('is_causal')})")
        plain = {k: v for k, v in cfg_json.items() if k not in ("sliding_window", "layer_types")}
        m = model_config_from_hf(plain, dtype=tcfg.dtype, require_architecture=False)
        if m.vocab_size != tcfg.vocab_size:
            raise ValueError(f"{where}: DFlash draft vocab_size ({m.vocab_size}) differs from the target's "
                             f"({tcfg.vocab_size})")
        if m.hidden_size != tcfg.hidden_size:
            raise ValueError(f"{where}: DFlash draft width {m.hidden_size} differs from the target's "
                             f"{tcfg.hidden_size} (it reads the target's embedding and LM head)")
        bias = bool(cfg_json.get("attention_bias", False))
        return m.replace(qk_norm=True, qkv_bias=bias, o_bias=bias, model_type="qwen3", architecture=ARCHITECTURE,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_ids=())  # the target's ids serve

    @staticmethod
    def layer_params(t: Tensors, prefix: str, c) -> dict:
        D, F, H, Hkv, Dh = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
        a = prefix + "self_attn."
        kv = kv_order(Hkv, Dh)
        attn = {"q_proj": t.linear((a + "q_proj.weight", (H * Dh, D))),
                "kv_proj": t.linear((a + "k_proj.weight", (Hkv * Dh, D)), (a + "v_proj.weight", (Hkv * Dh, D)),
                                    order=kv),
                "o_proj": t.linear((a + "o_proj.weight", (D, H * Dh))),
                "q_norm": {"weight": t.param((a + "q_norm.weight", (Dh,)))},
                "k_norm": {"weight": t.param((a + "k_norm.weight", (Dh,)))}}
        if c.qkv_bias:
            attn["q_proj"]["bias"] = t.param((a + "q_proj.bias", (H * Dh,)))
            attn["kv_proj"]["bias"] = t.param((a + "k_proj.bias", (Hkv * Dh,)), (a + "v_proj.bias", (Hkv * Dh,)),
                                              order=kv)
            attn["o_proj"]["bias"] = t.param((a + "o_proj.bias", (D,)))
        mp = prefix + "mlp."
        gu = gate_up_order(F)
        mlp = {"gate_up_proj": t.linear((mp + "gate_proj.weight", (F, D)), (mp + "up_proj.weight", (F, D)), order=gu),
               "down_proj": t.linear((mp + "down_proj.weight", (D, F)))}
        return {"self_attn": attn, "mlp": mlp,
                "input_layernorm": {"weight": t.param((prefix + "input_layernorm.weight", (D,)))},
                "post_attention_layernorm": {"weight": t.param((prefix + "post_attention_layernorm.weight", (D,)))}}

    def to_hf(self, weights, target_vocab: int):
        c, dt, p = self.model, self.model.dtype, weights["params"]
        H, Hkv, Dh, F = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        cfg = {"architectures": [ARCHITECTURE], "model_type": "qwen3", "vocab_size": target_vocab,
               "hidden_size": c.hidden_size, "intermediate_size": F, "num_hidden_layers": c.num_layers,
               "num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": Dh, "hidden_act": "silu",
               "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
               "rope_theta": c.rope.theta, "attention_bias": c.qkv_bias, "tie_word_embeddings": False,
               "dtype": dt, "torch_dtype": dt, "block_size": self.block_size,
               "num_target_layers": self.num_target_layers,
               "dflash_config": {"mask_token_id": self.mask_token_id,
                                 "target_layer_ids": list(self.target_layer_ids)}}
        if c.rope.kind != "default":
            raise ValueError("DFlash drafts with scaled RoPE cannot be exported yet")
        for name, value, default in (("input_embedding_scale", self.embed_scale, 1.0),
                                     ("output_multiplier", self.logit_scale, 1.0),
                                     ("final_logit_softcapping", self.softcap, 0.0)):
            if value != default:
                cfg["dflash_config"][name] = value
        t = {"fc.weight": hf_linear(p["fc"], dt), "hidden_norm.weight": to_numpy(p["hidden_norm"]["weight"], dt),
             "norm.weight": to_numpy(p["norm"]["weight"], dt)}
        unkv, ungu = np.argsort(kv_order(Hkv, Dh)), np.argsort(gate_up_order(F))
        for i in range(c.num_layers):
            lp, pre = p[f"layers_{i}"], f"layers.{i}."
            att = lp["self_attn"]
            k, v = np.split(hf_linear(att["kv_proj"], dt)[unkv], 2, axis=0)
            t.update({pre + "self_attn.q_proj.weight": hf_linear(att["q_proj"], dt),
                      pre + "self_attn.k_proj.weight": k, pre + "self_attn.v_proj.weight": v,
                      pre + "self_attn.o_proj.weight": hf_linear(att["o_proj"], dt),
                      pre + "self_attn.q_norm.weight": to_numpy(att["q_norm"]["weight"], dt),
                      pre + "self_attn.k_norm.weight": to_numpy(att["k_norm"]["weight"], dt)})
            if "bias" in att["q_proj"]:
                kb, vb = np.split(to_numpy(att["kv_proj"]["bias"], dt)[unkv], 2)
                t.update({pre + "self_attn.q_proj.bias": to_numpy(att["q_proj"]["bias"], dt),
                          pre + "self_attn.k_proj.bias": kb, pre + "self_attn.v_proj.bias": vb,
                          pre + "self_attn.o_proj.bias": to_numpy(att["o_proj"]["bias"], dt)})
            gate, up = np.split(hf_linear(lp["mlp"]["gate_up_proj"], dt)[ungu], [F], axis=0)
            t.update({pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up,
                      pre + "mlp.down_proj.weight": hf_linear(lp["mlp"]["down_proj"], dt),
                      pre + "input_layernorm.weight": to_numpy(lp["input_layernorm"]["weight"], dt),
                      pre + "post_attention_layernorm.weight": to_numpy(lp["post_attention_layernorm"]["weight"],
                                                                        dt)})
        return cfg, t
