"""MTP drafts of Qwen3-Next and Qwen3.5 checkpoints: the checkpoint's own
multi-token-prediction layer (`mtp.*`), `jspec.load(dir, draft="mtp")`.

The layer (`jspec.models.qwen3_next.MtpLayer`) reads, with token i+1, the hidden state
that predicted it: first the target's hidden state at i *after* the target's final norm
(what SGLang's `qwen3_5_mtp.py` / `qwen3_next_mtp.py` and vLLM's models of the same names
feed `pre_fc_norm_hidden`: both take the backbone's normed output), then its own output
after `mtp.norm`, so one layer runs S times for a chain or a tree. fc reads
[embedding; hidden] in that order. It keeps its own KV cache (one gated full-attention
layer) and is extended on the accepted tokens after each round. The embedding and the LM
head are the target's.

Tensors: `mtp.fc.weight` [D, 2D], `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight` (all (1 + w) norms) and
`mtp.layers.0.*` named as a target layer (experts per expert or fused).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jspec.cache.kv import KVCacheKind
from jspec.drafts.mtp import MtpDraft
from jspec.models import qwen3_next_hf
from jspec.models.qwen3_next import MtpLayer
from jspec.models.qwen3_next_hf import FULL, HybridConfig
from jspec.models.qwen3_next_split import split_qwen3_next
from jspec.tensors import Tensors

PREFIX = "mtp."


def layer_config(c: HybridConfig) -> HybridConfig:
    """The MTP layer's config: one full-attention layer, MoE whenever the model has experts."""
    return c.replace(num_layers=1, layer_types=(FULL,), mlp_only_layers=(), decoder_sparse_step=1, mtp_num_layers=0)


@dataclasses.dataclass(frozen=True)
class QwenMtpDraft(MtpDraft):
    """`model`: the MTP layer's config (`layer_config`). DeepSeek's MTP draft in all but
    the layer, its KV cache and its weights (always the target's embedding and head)."""

    layer: ClassVar[type] = MtpLayer

    def cache_kind(self):
        m = self.model
        return KVCacheKind(1, m.num_heads, m.num_kv_heads, m.head_dim, m.dtype)

    @classmethod
    def serves(cls, tcfg) -> bool:
        return isinstance(tcfg, HybridConfig)

    def split(self, weights, n: int):
        """Split as the target's layers are (`models.qwen3_next_split.split_qwen3_next`); fc
        and the norms replicated."""
        model, weights, specs = split_qwen3_next(self.model, weights, n)
        return dataclasses.replace(self, model=model), weights, specs

    @classmethod
    def recognises(cls, cfg_json, tensors):
        return False  # only inside its target's checkpoint (`from_target_checkpoint`)

    def to_hf(self, weights, target_vocab: int):
        raise ValueError("a Qwen3-Next / Qwen3.5 MTP layer is saved with its target's checkpoint (mtp.*), not "
                         "as a draft directory")

    @classmethod
    def from_target_checkpoint(cls, tensors: dict, tcfg: HybridConfig, where: str) -> tuple["QwenMtpDraft", Any]:
        """The MTP layer of a target's own checkpoint (`draft="mtp"`)."""
        if PREFIX + "fc.weight" not in tensors:
            raise ValueError(f"{where}: draft='mtp' needs a checkpoint with an MTP layer (mtp.* tensors); this one "
                             f"has none (config.json mtp_num_hidden_layers is {tcfg.mtp_num_layers})")
        m = layer_config(tcfg)
        D = m.hidden_size
        t = Tensors({k: v for k, v in tensors.items() if k.startswith(PREFIX)}, where, m.dtype)
        p = {"fc": t.linear((PREFIX + "fc.weight", (D, 2 * D))),
             "pre_fc_norm_embedding": {"weight": t.param((PREFIX + "pre_fc_norm_embedding.weight", (D,)))},
             "pre_fc_norm_hidden": {"weight": t.param((PREFIX + "pre_fc_norm_hidden.weight", (D,)))},
             "norm": {"weight": t.param((PREFIX + "norm.weight", (D,)))},
             "layers_0": qwen3_next_hf.layer_params(t, PREFIX + "layers.0.", m, 0)}
        t.ignore(*[k for k in list(t.tensors) if k.startswith(PREFIX + "layers.") and
                   not k.startswith(PREFIX + "layers.0.")])  # further MTP layers: one is run S times
        t.finish()
        return cls(m), {"params": p}
