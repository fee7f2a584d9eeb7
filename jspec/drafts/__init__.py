"""Draft kinds, one file each, behind the protocol in `jspec.drafts.base`.

Registering a kind is one line in DRAFT_KINDS (checkpoints are recognised in this order).
EMBEDDED_DRAFTS names the kinds that live inside a target's own checkpoint
(`jspec.load(dir, draft="mtp")`).
"""
from __future__ import annotations

from jspec.drafts.base import Draft
from jspec.drafts.dflash import DFlashDraft
from jspec.drafts.eagle import EagleDraft
from jspec.drafts.eagle3 import Eagle3Draft
from jspec.drafts.mtp import MtpDraft
from jspec.drafts.qwen_mtp import QwenMtpDraft
from jspec.drafts.standalone import StandaloneDraft

DRAFT_KINDS: tuple[type[Draft], ...] = (DFlashDraft, Eagle3Draft, EagleDraft, MtpDraft, StandaloneDraft)
EMBEDDED_DRAFTS: dict[str, tuple[type[Draft], ...]] = {"mtp": (QwenMtpDraft, MtpDraft)}


def embedded_kind(name: str, tcfg) -> type[Draft]:
    """The kind of embedded draft `name` for a target of config `tcfg`: the first that
    serves it, else the last (whose loader names what the checkpoint lacks)."""
    kinds = EMBEDDED_DRAFTS[name]
    return next((k for k in kinds if k.serves(tcfg)), kinds[-1])


def kind_of_checkpoint(cfg_json: dict, tensors: dict, where: str) -> type[Draft]:
    """The draft kind that recognises a checkpoint (config.json, tensors by name)."""
    for kind in DRAFT_KINDS:
        if kind.recognises(cfg_json, tensors):
            return kind
    archs = cfg_json.get("architectures") or []
    raise ValueError(f"{where}: unknown draft architecture {archs!r}; expected an EAGLE head "
                     f"(LlamaForCausalLMEagle), an EAGLE-3 head (LlamaForCausalLMEagle3), a NextN layer "
                     f"(DeepseekV3ForCausalLMNextN), a DFlash block drafter (DFlashDraftModel) or a model of a target family")


__all__ = ["DRAFT_KINDS", "EMBEDDED_DRAFTS", "DFlashDraft", "Draft", "Eagle3Draft", "EagleDraft", "MtpDraft", "QwenMtpDraft",
           "StandaloneDraft", "embedded_kind", "kind_of_checkpoint"]
