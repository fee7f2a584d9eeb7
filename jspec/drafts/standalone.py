"""A standalone draft: a small model of any target family sharing the target's tokenizer."""
from __future__ import annotations

import dataclasses

from jspec.drafts.base import Draft
from jspec.models import FAMILIES, family_for, family_for_hf
from jspec.tuning import DEFAULT_TUNING


@dataclasses.dataclass(frozen=True)
class StandaloneDraft(Draft):
    """`model` is the draft's own config in its target family; its cache slot i holds token
    i (the root included), one slot ahead of an EAGLE head's."""

    kind = "standalone"

    @property
    def lag(self) -> int:
        return 1

    def forward(self, tcfg, tw, dw, tokens, feats, cache, meta, from_target: bool, tuning=DEFAULT_TUNING):
        hidden, _, cache = family_for(self.model).forward(self.model, dw, tokens, cache, meta, tuning=tuning)
        return hidden, cache

    def logits(self, tcfg, tw, dw, hidden, tuning=DEFAULT_TUNING):
        return family_for(self.model).logits(self.model, dw, hidden, tuning=tuning)

    def cache_kind(self):
        return family_for(self.model).cache_kind(self.model)

    def split(self, weights, n: int):
        model, weights, specs = family_for(self.model).split(self.model, weights, n)
        return dataclasses.replace(self, model=model), weights, specs

    def init(self, key, target_vocab: int):
        return family_for(self.model).init_weights(self.model, key)

    @classmethod
    def recognises(cls, cfg_json, tensors):
        archs = cfg_json.get("architectures") or []
        return any(a in f.architectures for f in FAMILIES for a in archs)

    @classmethod
    def from_hf(cls, cfg_json, tensors, tcfg, where):
        family = family_for_hf(cfg_json, where)
        m = family.config_from_hf(cfg_json, tcfg.dtype)
        if m.vocab_size != tcfg.vocab_size:
            raise ValueError(f"{where}: draft vocabulary ({m.vocab_size}) differs from the target's "
                             f"({tcfg.vocab_size}); a standalone draft must share the target's tokenizer")
        return cls(m), family.weights_from_hf(tensors, m, where)

    def to_hf(self, weights, target_vocab: int):
        return family_for(self.model).weights_to_hf(self.model, weights)
