"""The Python standard library's own source files as a training corpus, with a fixed
held-out split (about 1 file in 20, chosen by a hash of its path)."""
from __future__ import annotations

import hashlib
import os
import sysconfig


def stdlib_files(root: str | None = None) -> list[str]:
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if d not in ("site-packages", "__pycache__", "dist-packages"))
        files += [os.path.join(dp, f) for f in sorted(fns) if f.endswith(".py")]
    return files


def is_held_out(path: str, root: str | None = None) -> bool:
    rel = os.path.relpath(path, root or sysconfig.get_paths()["stdlib"])
    return int(hashlib.md5(rel.encode()).hexdigest(), 16) % 20 == 0


def split(root: str | None = None) -> tuple[list[str], list[str]]:
    """-> (training files, held-out files)."""
    files = stdlib_files(root)
    held = [f for f in files if is_held_out(f, root)]
    return [f for f in files if not is_held_out(f, root)], held
