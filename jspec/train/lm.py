"""Llama-architecture language models trained from scratch (the bundled target) or
distilled from a teacher (a standalone draft), with optax."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jspec.cache.layout import prefill_meta
from jspec.config import ModelConfig
from jspec.models.llama import LLAMA
from jspec.train import common


def init_lm(cfg: ModelConfig, seed: int = 0):
    return LLAMA.init_weights(cfg, jax.random.key(seed))


def lm_logits(weights, cfg: ModelConfig, tokens):
    """tokens [B,T] -> float32 logits [B,T,V] (causal, no cache)."""
    B, T = tokens.shape
    hidden, _, _ = LLAMA.forward(cfg, weights, tokens, None, prefill_meta(jnp.full((B,), T, jnp.int32), T))
    return LLAMA.logits(cfg, weights, hidden)


def lm_loss(params, cfg: ModelConfig, tokens, teacher_logits=None, compute_dtype=jnp.float32):
    """Next-token cross-entropy; with teacher logits [B,T,V], cross-entropy to the teacher's
    distribution (distillation). Returns (loss, metrics)."""
    w = {"params": common.cast_floats(params, compute_dtype)}
    logits = lm_logits(w, cfg.replace(dtype=jnp.dtype(compute_dtype).name), tokens)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    if teacher_logits is None:
        labels = tokens[:, 1:]
        loss = -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()
        agree = (jnp.argmax(logits, -1) == labels).mean()
    else:
        p = jax.nn.softmax(teacher_logits[:, :-1], axis=-1)
        loss = -(p * logp).sum(-1).mean()
        agree = (jnp.argmax(logits, -1) == jnp.argmax(teacher_logits[:, :-1], -1)).mean()
    return loss, {"loss": loss, "agree": agree}


def train_lm(cfg: ModelConfig, data, steps: int, *, lr: float = 1e-3, warmup: int = 100, weight_decay: float = 0.1,
             clip: float = 1.0, seed: int = 0, teacher=None, compute_dtype: str = "float32", progress: bool = True,
             desc: str = "lm", init_params=None, log_every: int = 10, print_every: int = 0):
    """Trains a ModelConfig-shaped model on batches from `data` ([B,T] token arrays).

    teacher: a jspec.Params whose logits the model learns to match (standalone drafts).
    Returns (weights {"params": ...} in float32, history of logged metrics).
    """
    params = init_params if init_params is not None else init_lm(cfg.replace(dtype="float32"), seed)["params"]
    params = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), params)  # donated below
    opt = common.make_optimizer(lr, steps, warmup, weight_decay, clip)
    opt_state = opt.init(params)
    cdt = jnp.dtype(compute_dtype)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_jit(params, opt_state, tokens, teacher_weights):
        tl = None if teacher is None else jax.lax.stop_gradient(lm_logits(teacher_weights, teacher.config, tokens))
        (_, metrics), grads = jax.value_and_grad(lm_loss, has_aux=True)(params, cfg, tokens, tl, cdt)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def step(params, opt_state, tokens):
        return step_jit(params, opt_state, tokens, None if teacher is None else teacher.weights)

    params, _, history = common.train_loop(step, params, opt_state, data, steps, desc=desc, progress=progress,
                                           show=lambda m: f"loss {m['loss']:.3f} agree {m['agree']:.2f}",
                                           log_every=log_every, print_every=print_every)
    return {"params": params}, history
