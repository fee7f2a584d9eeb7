"""Optimiser, checkpoints and the training loop shared by every trainer."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization


def check_settings(cfg, ints=(), counts=(), positive=(), non_negative=(), optional_ints=()):
    """A trainer's config checked field by field, errors naming `Class.field`: `ints` at
    least 1 and `counts` at least 0 (ints, not bools); `positive` and `non_negative`
    finite numbers; `optional_ints` None or at least 1; compute_dtype a float type."""
    name = type(cfg).__name__

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    for field in (*ints, *counts):
        v = getattr(cfg, field)
        if not is_int(v) or v < (1 if field in ints else 0):
            raise ValueError(f"{name}.{field} must be a positive int, got {v!r}")
    for field in (*positive, *non_negative):
        v = getattr(cfg, field)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (v <= 0 if field in positive else v < 0):
            raise ValueError(f"{name}.{field} must be a finite {'positive' if field in positive else 'non-negative'}"
                             f" number, got {v!r}")
    for field in optional_ints:
        v = getattr(cfg, field)
        if v is not None and (not is_int(v) or v < 1):
            raise ValueError(f"{name}.{field} must be a positive int or None (the default), got {v!r}")
    if cfg.compute_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, got {cfg.compute_dtype!r}")


def load_target(target, out_dir: str | None):
    """A trainer's target: jspec Params, or a model directory loaded; out_dir checked."""
    import jspec
    from jspec.params import Params
    if isinstance(target, (str, os.PathLike)):
        target = jspec.load(target)
    if not isinstance(target, Params):
        raise TypeError(f"target must be a model directory or jspec.Params, got {type(target).__name__}")
    if out_dir and os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"out_dir {out_dir!r} exists and is not a directory")
    return target


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.01, clip: float = 1.0):
    """AdamW with linear warm-up then cosine decay to lr/10, and global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


def cast_floats(tree, dtype):
    """Casts floating leaves (compute copies of float32 master weights)."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


CKPT = "checkpoint.msgpack"
META = "checkpoint.json"


def save_checkpoint(directory: str, step: int, params, opt_state, meta: dict):
    os.makedirs(directory, exist_ok=True)
    blob = serialization.to_bytes({"params": params, "opt_state": opt_state})
    tmp = os.path.join(directory, CKPT + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, os.path.join(directory, CKPT))
    with open(os.path.join(directory, META), "w") as f:
        json.dump(dict(meta, step=step), f, indent=1)


def load_checkpoint(directory: str, params, opt_state, meta: dict):
    """-> (step, params, opt_state) or None; refuses a checkpoint made for other settings."""
    path = os.path.join(directory, CKPT)
    if not os.path.isfile(path):
        return None
    with open(os.path.join(directory, META)) as f:
        saved = json.load(f)
    for k, v in meta.items():
        if saved.get(k) != v:
            raise ValueError(f"checkpoint in {directory!r} was made with {k}={saved.get(k)!r}, not {v!r}; "
                             f"use another output directory or resume=False")
    with open(path, "rb") as f:
        state = serialization.from_bytes({"params": params, "opt_state": opt_state}, f.read())
    return int(saved["step"]), state["params"], state["opt_state"]


def train_loop(step_fn: Callable, params, opt_state, data: Iterator[np.ndarray], steps: int, *, start: int = 0,
               desc: str = "train", checkpoint: Callable[[int, Any, Any], None] | None = None,
               checkpoint_every: int = 0, log_every: int = 10, show: Callable[[dict], str] | None = None,
               progress: bool = True, print_every: int = 0) -> tuple[Any, Any, list[dict]]:
    """Runs `step_fn(params, opt_state, batch) -> (params, opt_state, metrics)` with a tqdm
    bar (or, with progress=False, a printed line every `print_every` steps); returns the
    final params, optimiser state and the logged metrics."""
    from tqdm.auto import tqdm
    history = []
    bar = tqdm(total=steps, initial=start, desc=desc, disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in range(start, steps):
        params, opt_state, metrics = step_fn(params, opt_state, jnp.asarray(next(data)))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            m["step"] = step + 1
            m["time_s"] = time.perf_counter() - t0
            history.append(m)
            text = show(m) if show else f"loss {m['loss']:.3f}"
            bar.set_postfix_str(text)
            if not progress and print_every and (step + 1) % print_every == 0:
                print(f"{desc} step {step + 1}/{steps} {text} ({m['time_s']:.0f}s)", flush=True)
        bar.update(1)
        if checkpoint and checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            checkpoint(step + 1, params, opt_state)
    bar.close()
    if checkpoint:
        checkpoint(steps, params, opt_state)
    return params, opt_state, history
