"""The bundled models: a small Python-code target trained on the standard library, its
EAGLE-3 head, a DFlash block drafter and a tiny standalone draft (see
scripts/make_bundle.py for the recipe)."""
from __future__ import annotations

import os


def bundle_path() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def load(draft: str | None = "eagle3", dtype: str | None = None, quantization: str | None = None):
    """The bundled target with the draft 'eagle3', 'dflash', 'standalone' or None
    (quantization: as `jspec.load`)."""
    import jspec
    root = bundle_path()
    if not os.path.isfile(os.path.join(root, "target", "config.json")):
        raise FileNotFoundError(f"the bundled models are missing from {root}")
    return jspec.load(os.path.join(root, "target"), draft=None if draft is None else os.path.join(root, draft),
                      dtype=dtype, quantization=quantization)
