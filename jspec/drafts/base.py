"""The draft protocol: everything the loop, loading and export need of a draft kind.

A draft kind is a frozen, hashable dataclass (a static jit argument) holding the draft's
configuration; its methods are the only way the loop, the API, loading and export touch a
draft, so none of them asks which kind it runs. Weight arguments come in the order
(target weights, draft weights) everywhere, after the target's config.

Per-token features: an EAGLE-family head reads, with token i+1, a feature of position i
(the target's hidden state, or EAGLE-3's concatenated layer inputs); after its first step
it reads its own output instead. A standalone draft reads tokens only. `lag` says how
many slots the draft's cache runs ahead of the target's (see `Draft.lag`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jspec.cache.kv import KVCacheKind
from jspec.config import ModelConfig
from jspec.tuning import DEFAULT_TUNING
from jspec.models.llama import split_llama


def strip_model_prefix(tensors: dict) -> dict:
    """EAGLE checkpoints in the wild name their tensors with or without "model."."""
    return {(k[6:] if k.startswith("model.") else k): v for k, v in tensors.items()}


@dataclasses.dataclass(frozen=True)
class Draft:
    """Base class of draft kinds. `model` is the draft's own decoder (for EAGLE heads,
    num_layers counts the head's layers)."""

    kind: ClassVar[str]  # a name for messages; never compared outside the kind's own file
    # A block drafter (`jspec.drafts.dflash`): one forward proposes a whole block, run by the
    # block proposer (`jspec.loop.proposers.block`) instead of the step-by-step neural one.
    proposes_blocks: ClassVar[bool] = False
    model: ModelConfig

    @property
    def lag(self) -> int:
        """How many slots ahead of an EAGLE head this draft's cache runs (0 or 1): an EAGLE
        head's slot i pairs token i+1 with the target's feature at i; a standalone draft's
        slot i holds token i itself, so it also holds the current root token."""
        return 0

    @property
    def vocab_size(self) -> int:
        """Vd: the vocabulary `logits` ranges over (the draft's own; EAGLE-3 may reduce it)."""
        return self.model.vocab_size

    @property
    def hidden_size(self) -> int:
        """Width Dd of the hidden state `forward` returns."""
        return self.model.hidden_size

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Target layers whose inputs `target_features` reads (captured in the forward)."""
        return ()

    def target_features(self, hidden, aux):
        """The target's final-norm hidden [B,T,D] and captured layer inputs {i: [B,T,D]} ->
        the per-token feature [B,T,F] the draft reads (None: it reads none)."""
        return None

    def cache_kind(self) -> KVCacheKind:
        m = self.model
        return KVCacheKind(m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.dtype)

    def forward(self, tcfg, tw, dw, tokens, feats, cache, meta, from_target: bool, tuning=DEFAULT_TUNING):
        """tokens [B,T] (target ids), feats [B,T,F] -> (hidden [B,T,Dd], cache).

        from_target: feats are `target_features` (True) or the draft's own hidden from its
        previous step (False). tuning (`jspec.tuning.Tuning`): passed down to the modules
        and kernels the draft runs."""
        raise NotImplementedError

    def logits(self, tcfg, tw, dw, hidden, tuning=DEFAULT_TUNING):
        """hidden [..., Dd] -> float32 logits [..., Vd] over the draft vocabulary (tuning
        as `forward`)."""
        raise NotImplementedError

    def to_target_ids(self, dw, ids):
        """Draft-vocabulary ids -> target ids (identity unless the vocabulary is reduced)."""
        return ids

    def init(self, key, target_vocab: int) -> Any:
        """Random weights (normal(0.02), norms at one)."""
        raise NotImplementedError

    @classmethod
    def serves(cls, tcfg) -> bool:
        """Whether a kind kept inside its target's checkpoint (`EMBEDDED_DRAFTS`) is the one
        for a target of config `tcfg`."""
        return False

    @classmethod
    def recognises(cls, cfg_json: dict, tensors: dict) -> bool:
        """Whether a checkpoint (config.json, tensors by name) is of this kind."""
        raise NotImplementedError

    @classmethod
    def from_hf(cls, cfg_json: dict, tensors: dict, tcfg, where: str) -> tuple["Draft", Any]:
        """A checkpoint checked against its target's config -> (draft, weights)."""
        raise NotImplementedError

    def to_hf(self, weights, target_vocab: int) -> tuple[dict, dict]:
        """-> (config.json dict, {tensor name: numpy array}) in the format its loaders read."""
        raise NotImplementedError

    def split(self, weights, n: int) -> tuple["Draft", Any, Any]:
        """The draft for n devices (`jspec.sharding`) -> (draft, weights, PartitionSpec
        tree); weights may hold `jspec.tensors.HostParam`s, which must stay unread."""
        raise ValueError(f"{self.kind} drafts cannot be split over devices yet")


@dataclasses.dataclass(frozen=True)
class LlamaDraft(Draft):
    """A draft kind whose weights are Llama-architecture modules (EAGLE, EAGLE-3,
    standalone Llama-family drafts): split over devices as the Llama targets are."""

    def split(self, weights, n: int):
        model, weights, specs = split_llama(self.model, weights, n)
        return dataclasses.replace(self, model=model), weights, specs
