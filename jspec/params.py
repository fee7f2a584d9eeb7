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
    """A target's config (its family's config class), weights and tokenizer, and a draft;
    `mesh`: the 1-D device mesh both are split over (`jspec.sharding`), None on one device."""

    config: Any
    weights: Any
    tokenizer: Any = None
    draft: DraftParams | None = None
    mesh: Any = None

    def with_draft(self, draft) -> "Params":
        """These params with another draft: a `DraftParams`, a draft without weights (a
        `jspec.NgramDraft`), or None (plain decoding)."""
        if draft is not None and not isinstance(draft, DraftParams):
            draft = DraftParams(draft, None)
        return dataclasses.replace(self, draft=draft)

    def weight_bytes(self) -> tuple[int, int]:
        """(bytes of the target's and the draft's weights in device memory, of which in FP8
        arrays: projections kept FP8, `jspec.quantization`), over all devices."""
        import jax
        import numpy as np

        from jspec.quantization import FP8_DTYPES
        leaves = jax.tree.leaves((self.weights, None if self.draft is None else self.draft.weights))
        sizes = [(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize, np.dtype(a.dtype) in FP8_DTYPES)
                 for a in leaves if hasattr(a, "dtype")]
        return sum(n for n, _ in sizes), sum(n for n, fp8 in sizes if fp8)
