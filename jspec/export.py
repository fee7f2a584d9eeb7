"""Saving jspec weights as Hugging Face directories (config.json + safetensors).

Targets are saved by their family (`LlamaForCausalLM`: transformers loads them); drafts by
their kind, in the format their loaders read: EAGLE-3 heads as `LlamaForCausalLMEagle3`
(what SGLang and vLLM load, with `d2t` and `t2d` when the draft vocabulary is reduced),
EAGLE heads as `LlamaForCausalLMEagle`, standalone drafts as their family's models.
"""
from __future__ import annotations

import json
import os

from jspec import safetensors_io
from jspec.models import family_for


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


def save_target(path: str, cfg, weights, tokenizer=None, max_shard_bytes: int | None = None):
    """A target (any family's config) as a directory transformers loads."""
    cfg_json, tensors = family_for(cfg).weights_to_hf(cfg, weights)
    _write(path, cfg_json, tensors, max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_draft(path: str, draft, weights, target_vocab: int):
    """A draft (a `jspec.drafts.Draft`) in the format its loaders expect."""
    cfg_json, tensors = draft.to_hf(weights, target_vocab)
    _write(path, cfg_json, tensors)
