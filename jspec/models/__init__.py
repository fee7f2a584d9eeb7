"""Target families: one file per family behind `jspec.models.family.TargetFamily`.

Registering a family is one line in FAMILIES. `family_for(cfg)` finds the family of a
config by its type; `family_for_hf(cfg_json)` by the checkpoint's `architectures`.
"""
from __future__ import annotations

from jspec.models.family import TargetFamily
from jspec.models.deepseek import DEEPSEEK
from jspec.models.llama import LLAMA
from jspec.models.qwen3_next import QWEN3_NEXT

FAMILIES: tuple[TargetFamily, ...] = (LLAMA, DEEPSEEK, QWEN3_NEXT)


def family_for(cfg) -> TargetFamily:
    """The family whose config class `cfg` is an instance of."""
    for family in FAMILIES:
        if isinstance(cfg, family.config_type):
            return family
    raise TypeError(f"no target family owns a config of type {type(cfg).__name__}")


def family_for_hf(cfg_json: dict, where: str) -> TargetFamily:
    """The family that loads a checkpoint declaring these `architectures`."""
    archs = cfg_json.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.architectures for a in archs):
            return family
    known = sorted(a for f in FAMILIES for a in f.architectures)
    raise ValueError(f"{where}: unsupported architecture {archs or cfg_json.get('model_type')!r}; jspec "
                     f"supports {known}")
