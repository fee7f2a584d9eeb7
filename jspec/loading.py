"""Hugging Face directories (config.json + safetensors + tokenizer) -> configs + params.

Tensors are read straight from the safetensors files (no torch). Names and shapes are
checked against the config: a missing, extra or mis-shaped tensor fails naming it.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import safetensors_io
from jspec.config import DTYPES, DraftConfig, ModelConfig, model_config_from_hf


@dataclasses.dataclass(frozen=True, eq=False)
class DraftParams:
    """A loaded draft: its config and weights (a Flax variables dict)."""

    config: DraftConfig
    weights: Any
    path: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Params:
    """What `jspec.load` returns: the target's config, weights and tokenizer, and a draft."""

    config: ModelConfig
    weights: Any
    tokenizer: Any = None
    draft: DraftParams | None = None
    path: str | None = None

    def with_draft(self, draft: DraftParams | None) -> "Params":
        return dataclasses.replace(self, draft=draft)


def read_config(model_dir: str) -> dict:
    if not isinstance(model_dir, (str, os.PathLike)):
        raise TypeError(f"expected a model directory path, got {type(model_dir).__name__}")
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"{model_dir!r} is not a directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} is not a model directory: it has no config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: config.json is not a JSON object")
    return cfg


def read_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files (single file or sharded index)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ValueError(f"{model_dir!r}: shards listed in the index are missing: {missing}")
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        extra = " (only PyTorch .bin weights found; convert them to safetensors)" if glob.glob(
            os.path.join(model_dir, "*.bin")) else ""
        raise ValueError(f"{model_dir!r} has no *.safetensors weights{extra}")
    tensors = {}
    for f in files:
        for name, arr in safetensors_io.load(os.path.join(model_dir, f)).items():
            if name in tensors:
                raise ValueError(f"{model_dir!r}: tensor {name!r} appears in more than one shard")
            tensors[name] = arr
    return tensors


def load_tokenizer(model_dir: str):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _check_dtype(dtype):
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")


class _Tensors:
    """Takes tensors by name with shape checks, then reports anything left over."""

    def __init__(self, tensors: dict[str, np.ndarray], where: str, dtype):
        self.tensors = dict(tensors)
        self.where = where
        self.dtype = jnp.dtype(dtype)

    def has(self, name):
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...], dtype=None) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"{self.where}: missing tensor {name!r}")
        a = self.tensors.pop(name)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{self.where}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        return a

    def param(self, *names_shapes, axis=0):
        """Takes one or more tensors, concatenates them along `axis`, converts to jax."""
        parts = [self.take(n, s) for n, s in names_shapes]
        a = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
        return jnp.asarray(a, dtype=self.dtype)

    def linear(self, *names_shapes):
        """A projection: Hugging Face [out, in] tensors, concatenated along `out`, as the
        [in, out] `kernel` that `jspec.models.llama.Linear` uses (transposed on device)."""
        return {"kernel": self.param(*names_shapes).T}

    def ignore(self, *names):
        for n in names:
            self.tensors.pop(n, None)

    def finish(self):
        left = sorted(k for k in self.tensors if not k.endswith("rotary_emb.inv_freq"))
        if left:
            more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
            raise ValueError(f"{self.where}: unexpected tensors {left[:5]}{more}")


def decoder_layer_params(t: _Tensors, prefix: str, c: ModelConfig, attn_in: int | None = None) -> dict:
    """One decoder layer's params from `prefix`-named HF tensors (q/k/v and gate/up fused)."""
    D, F, H, Hkv, Dh = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    a_in = attn_in or D
    att = f"{prefix}self_attn."
    attn = {"qkv_proj": t.linear((att + "q_proj.weight", (H * Dh, a_in)), (att + "k_proj.weight", (Hkv * Dh, a_in)),
                                 (att + "v_proj.weight", (Hkv * Dh, a_in))),
            "o_proj": t.linear((att + "o_proj.weight", (D, H * Dh)))}
    if c.qkv_bias:
        attn["qkv_proj"]["bias"] = t.param((att + "q_proj.bias", (H * Dh,)), (att + "k_proj.bias", (Hkv * Dh,)),
                                           (att + "v_proj.bias", (Hkv * Dh,)))
    if c.o_bias:
        attn["o_proj"]["bias"] = t.param((att + "o_proj.bias", (D,)))
    if c.qk_norm:
        attn["q_norm"] = {"weight": t.param((att + "q_norm.weight", (Dh,)))}
        attn["k_norm"] = {"weight": t.param((att + "k_norm.weight", (Dh,)))}
    mlp_p = f"{prefix}mlp."
    mlp = {"gate_up_proj": t.linear((mlp_p + "gate_proj.weight", (F, D)), (mlp_p + "up_proj.weight", (F, D))),
           "down_proj": t.linear((mlp_p + "down_proj.weight", (D, F)))}
    if c.mlp_bias:
        mlp["gate_up_proj"]["bias"] = t.param((mlp_p + "gate_proj.bias", (F,)), (mlp_p + "up_proj.bias", (F,)))
        mlp["down_proj"]["bias"] = t.param((mlp_p + "down_proj.bias", (D,)))
    return {"self_attn": attn, "mlp": mlp,
            "post_attention_layernorm": {"weight": t.param((prefix + "post_attention_layernorm.weight", (D,)))}}


def target_params_from_tensors(tensors: dict[str, np.ndarray], c: ModelConfig, where: str) -> dict:
    t = _Tensors(tensors, where, c.dtype)
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


def load_target(model_dir: str, dtype: str | None = None) -> Params:
    _check_dtype(dtype)
    cfg_json = read_config(model_dir)
    config = model_config_from_hf(cfg_json, dtype=dtype)
    weights = target_params_from_tensors(read_tensors(model_dir), config, os.fspath(model_dir))
    return Params(config=config, weights=weights, tokenizer=load_tokenizer(model_dir),
                  path=os.fspath(model_dir))


def load(target_dir: str, *, draft: str | None = None, dtype: str | None = None) -> Params:
    """Loads a target (and optionally a draft) from local Hugging Face directories.

    dtype: 'float32', 'bfloat16' or 'float16' for the weights and activations; None keeps
    the checkpoint's declared dtype.
    """
    params = load_target(target_dir, dtype)
    if draft is not None:
        from jspec.drafts import load_draft
        params = params.with_draft(load_draft(draft, params))
    return params
