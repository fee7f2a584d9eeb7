"""Hugging Face directories (config.json + safetensors + tokenizer) -> configs + params.

Tensors are read straight from the safetensors files (no torch) and handed to the target
family (`jspec.models`) or draft kind (`jspec.drafts`) that recognises the checkpoint; it
checks names and shapes against the config, so a missing, extra or mis-shaped tensor
fails naming it.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np

from jspec import safetensors_io, sharding
from jspec.quantization import dequantize, quantize_fp8
from jspec.config import DTYPES
from jspec.drafts import EMBEDDED_DRAFTS, embedded_kind, kind_of_checkpoint
from jspec.loop.proposers.ngram import NgramDraft
from jspec.models import family_for, family_for_hf
from jspec.params import DraftParams, Params
from jspec.tensors import place


class ConfigJSON(dict):
    """A config.json dict that knows its path: reading a field it lacks (`cfg["hidden_size"]`)
    is a ValueError naming the file and the field, not a bare KeyError. `.get` is unchanged,
    so optional fields keep their defaults."""

    def __init__(self, fields: dict, path: str):
        super().__init__(fields)
        self.path = path

    def __missing__(self, key):
        raise ValueError(f"{self.path}: missing required field {key!r}")


HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]  # what a load reads


def looks_like_hub_id(name) -> bool:
    """'org/name' (no leading '.', '/' or '~', one slash): a Hugging Face hub model id."""
    return (isinstance(name, str) and name.count("/") == 1 and not name.startswith((".", "/", "~"))
            and all(part.strip() for part in name.split("/")))


def resolve(model) -> str:
    """A local directory as it is; a Hugging Face hub id ('Qwen/Qwen3-8B') -> its snapshot
    in huggingface_hub's cache, downloaded when online (HF_HUB_OFFLINE=1: the cache only).
    ValueError naming the argument when it is neither."""
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        return os.fspath(model)
    if not looks_like_hub_id(model):
        return model  # read_config names what is wrong with it
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, allow_patterns=HUB_FILES)
    except Exception as err:  # noqa: BLE001  (offline and not cached, unknown id, no network ...)
        raise ValueError(f"{model!r} is not a directory, and as a Hugging Face hub id it could not be found "
                         f"({type(err).__name__}: {err})") from None


def read_config(model_dir: str) -> ConfigJSON:
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
    return ConfigJSON(cfg, path)


def read_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files (single file or sharded index)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' of "
                             f"tensor -> file): {type(e).__name__}: {e}") from None
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
    return _auto_tokenizer().from_pretrained(model_dir)


def _auto_tokenizer():
    """transformers' AutoTokenizer. jspec uses only its tokenizers, so transformers' advice
    at import that PyTorch is missing (an advisory warning) is silenced for that import."""
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        from transformers import AutoTokenizer
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
    return AutoTokenizer


def _check_dtype(dtype):
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} or None, got {dtype!r}")


def _split_target(config, weights, mesh, where: str = "target"):
    """A target's config and weights (HostParams or arrays) -> split over `mesh` and placed
    (None: whole, on the default device)."""
    if mesh is None:
        return config, place(weights)
    try:
        config, weights, specs = family_for(config).split(config, weights, mesh.size)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return config, place(weights, sharding.shardings(mesh, specs))


def _split_draft(draft: DraftParams, mesh, where: str = "draft") -> DraftParams:
    if draft.weights is None:  # a proposer without weights (n-gram drafts): nothing to place
        return draft
    if mesh is None:
        return DraftParams(draft.config, place(draft.weights))
    try:
        kind, weights, specs = draft.config.split(draft.weights, mesh.size)
    except ValueError as e:
        raise ValueError(f"{where} ({draft.config.kind} draft): {e}") from None
    return DraftParams(kind, place(weights, sharding.shardings(mesh, specs)))


def load_target(model_dir: str, dtype: str | None = None, embedded_draft: str | None = None,
                mesh=None, quantization: str | None = None) -> Params:
    """A target; embedded_draft: also the draft kept in its checkpoint (`EMBEDDED_DRAFTS`),
    from the same tensors; mesh: split over its devices (`jspec.sharding`); quantization:
    "fp8" rounds its projection weights to block FP8 (`quantization.quantize_fp8`)."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    _check_dtype(dtype)
    cfg_json = read_config(model_dir)
    where = os.fspath(model_dir)
    family = family_for_hf(cfg_json, where)
    config = family.config_from_hf(cfg_json, dtype)
    keep = family.fp8_weights  # FP8 projections stay FP8 (an embedded MTP layer's too: `Tensors.linear`)
    tensors = dequantize(read_tensors(model_dir), cfg_json, where, keep=keep)
    if quantization == "fp8":
        tensors = quantize_fp8(tensors, keep=keep)
    whole = config  # on one device: what an embedded draft's layer is read as (its `split` splits it)
    config, weights = _split_target(config, family.weights_from_hf(tensors, config, where), mesh, where)
    params = Params(config=config, weights=weights, tokenizer=load_tokenizer(model_dir), mesh=mesh)
    if embedded_draft is not None:
        draft = embedded_kind(embedded_draft, whole).from_target_checkpoint(tensors, whole, where)
        params = params.with_draft(_split_draft(DraftParams(*draft), mesh, where))
    return params


def load_draft(draft_dir: str, target: Params) -> DraftParams:
    """Loads a draft and checks it against its target; the kind is recognised from the
    checkpoint (EAGLE, EAGLE-3, standalone: `jspec.drafts.DRAFT_KINDS`). It is split over
    the target's mesh, if it has one."""
    cfg_json = read_config(draft_dir)
    where = os.fspath(draft_dir)
    tensors = dequantize(read_tensors(draft_dir), cfg_json, where)
    kind = kind_of_checkpoint(cfg_json, tensors, where)
    return _split_draft(DraftParams(*kind.from_hf(cfg_json, tensors, target.config, where)), target.mesh, where)


def load(target_dir: str, *, draft: str | NgramDraft | None = None, dtype: str | None = None,
         devices=None, quantization: str | None = None) -> Params:
    """Loads a target (and optionally a draft) from Hugging Face directories, or hub ids
    ('Qwen/Qwen3-8B') resolved through huggingface_hub's cache (`resolve`).

    draft: a draft's directory; "mtp" for the MTP (NextN) layer inside the target's own
    checkpoint; "ngram" for n-gram (prompt lookup) drafts with their defaults, or a
    `jspec.NgramDraft(min_n=..., max_n=...)` (a directory named mtp or ngram: "./mtp").
    dtype: 'float32', 'bfloat16' or 'float16'
    for the weights and activations; None keeps the checkpoint's declared dtype.
    devices: split target and draft over several devices (Llama family: tensor
    parallelism; DeepSeek: attention by heads, routed experts by expert; see
    `jspec.sharding`): a count (the first n of `jax.devices()`), a list of devices or a
    1-D `jax.sharding.Mesh` with the axis "tp". Each device reads only its own part of
    every weight from the safetensors files. quantization: "fp8" rounds the target's
    projection weights to block FP8 on the host (FP8 checkpoints need nothing: they are
    recognised by their config; `jspec.quantization`).
    """
    mesh = None if devices is None else sharding.make_mesh(devices)
    target_dir = resolve(target_dir)
    if isinstance(draft, str) and draft not in EMBEDDED_DRAFTS and draft != "ngram":
        draft = resolve(draft)
    if draft == "ngram":
        draft = NgramDraft()
    if isinstance(draft, NgramDraft):
        return load_target(target_dir, dtype, mesh=mesh, quantization=quantization).with_draft(draft)
    if draft is not None and not isinstance(draft, (str, os.PathLike)):
        raise TypeError(f"draft must be a directory, 'mtp', 'ngram' or a jspec.NgramDraft, got {type(draft).__name__}")
    if isinstance(draft, str) and draft in EMBEDDED_DRAFTS:
        return load_target(target_dir, dtype, embedded_draft=draft, mesh=mesh, quantization=quantization)
    params = load_target(target_dir, dtype, mesh=mesh, quantization=quantization)
    if draft is not None:
        params = params.with_draft(load_draft(draft, params))
    return params


def shard(params: Params, devices) -> Params:
    """Weights already in memory (one device) split over `devices` as `load(...,
    devices=)` splits them: for models built or trained in Python."""
    if not isinstance(params, Params):
        raise TypeError(f"params must be a jspec.Params, got {type(params).__name__}")
    if params.mesh is not None:
        raise ValueError("these params are split over devices already")
    mesh = sharding.make_mesh(devices)
    config, weights = _split_target(params.config, params.weights, mesh)
    draft = None if params.draft is None else _split_draft(params.draft, mesh)
    return Params(config, weights, params.tokenizer, draft, mesh)
