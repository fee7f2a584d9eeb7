"""What `jspec.load` returns: configs and weights of a target and its draft."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, eq=False)
class DraftParams:
    """A loaded draft: its kind (a `jspec.drafts.Draft`, which holds its config) and weights."""

    config: Any
    weights: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Params:
    """A target's config (its family's config class), weights and tokenizer, and a draft."""

    config: Any
    weights: Any
    tokenizer: Any = None
    draft: DraftParams | None = None

    def with_draft(self, draft: DraftParams | None) -> "Params":
        return dataclasses.replace(self, draft=draft)
