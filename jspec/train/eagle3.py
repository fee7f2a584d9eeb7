"""EAGLE-3 head training with training-time test (TTT), and export.

The target runs frozen and supplies, per position i, its feature (the inputs of three
layers) and its next-token distribution. The head is unrolled `ttt_steps` times: step 0
reads (token i+1, target feature i) at every position; step k reads (token i+1+k, the
head's own step k-1 output at i), exactly as drafting does at inference. Step k's query at
position i sees step 0's keys at positions <= i and its own earlier steps' keys at i
(the same attention code and KV layout as inference: one buffer of ttt_steps x T slots).
Each step learns the target's distribution of the token it drafts (i+2+k), restricted to
the draft vocabulary, by cross-entropy.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.cache.layout import CacheLayout, make_meta, prefill_meta
from jspec.drafts.eagle3 import Eagle3Draft, check_aux_layers, default_aux_layers
from jspec.export import save_draft
from jspec.kernels.dispatch import use_backend
from jspec.models import family_for
from jspec.params import DraftParams, Params
from jspec.train import common, data as data_mod


@dataclasses.dataclass(frozen=True)
class Eagle3TrainConfig:
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 5e-4
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 0.5
    ttt_steps: int = 4
    draft_vocab_size: int | None = None  # None: min(target vocab, 32000)
    intermediate_size: int | None = None  # None: the target's
    compute_dtype: str = "bfloat16"  # float32 master weights, this for the forward pass
    checkpoint_every: int = 500
    seed: int = 0

    def __post_init__(self):
        common.check_settings(self, ints=("steps", "batch_size", "seq_len", "ttt_steps"), counts=("warmup",),
                              positive=("lr", "clip"), non_negative=("weight_decay",),
                              optional_ints=("draft_vocab_size", "intermediate_size"))
        if self.seq_len < self.ttt_steps + 2:
            raise ValueError(f"seq_len ({self.seq_len}) must exceed ttt_steps + 1 ({self.ttt_steps + 1})")


def head_config(target: Params, cfg: Eagle3TrainConfig, aux_layers=None) -> Eagle3Draft:
    tc = target.config
    V = tc.vocab_size
    Vd = min(V, 32000) if cfg.draft_vocab_size is None else cfg.draft_vocab_size
    if not 0 < Vd <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {Vd}")
    n = tc.num_layers
    aux = check_aux_layers(aux_layers if aux_layers else default_aux_layers(n), n,
                           "choose them with aux_layers (jspec-train --aux-layer-ids)")
    m = tc.replace(num_layers=1, sliding_windows=(0,), intermediate_size=cfg.intermediate_size or tc.intermediate_size,
                   tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                   architecture="LlamaForCausalLMEagle3", model_type="llama")
    return Eagle3Draft(m, target_hidden_size=tc.hidden_size, aux_layers=aux, draft_vocab_size=Vd)


def draft_vocab(counts: np.ndarray, Vd: int) -> np.ndarray:
    """The Vd most frequent target ids (ties: lower id), sorted; d2t = ids - arange(Vd)."""
    order = np.lexsort((np.arange(counts.shape[0]), -counts))[:Vd]
    ids = np.sort(order)
    return (ids - np.arange(Vd)).astype(np.int32)


def init_head(target: Params, d: Eagle3Draft, d2t: np.ndarray, seed: int) -> dict:
    """Random head; its LM head and final norm start from the target's (rows of the draft
    vocabulary), which speeds training up."""
    w = d.init(jax.random.key(seed), target.config.vocab_size)
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), w["params"])
    tp = target.weights["params"]
    ids = np.arange(d.draft_vocab_size) + d2t
    if target.config.tie_word_embeddings:  # [V, D] rows
        head = jnp.asarray(tp["embed_tokens"]["embedding"], jnp.float32)[ids].T
    else:  # [D, V] columns
        head = jnp.asarray(tp["lm_head"]["kernel"], jnp.float32)[:, ids]
    p["lm_head"]["kernel"] = head
    p["norm"]["weight"] = jnp.array(tp["norm"]["weight"], jnp.float32, copy=True)  # params get donated
    return p


def ttt_logits(params, d: Eagle3Draft, d2t, tw, tc, tokens, feats, ttt_steps: int, compute_dtype):
    """Unrolled drafting: tokens [B,T], target features [B,T,F] -> logits [K][B,T,Vd]."""
    B, T = tokens.shape
    m = d.model.replace(dtype=jnp.dtype(compute_dtype).name)
    dc = dataclasses.replace(d, model=m)
    dw = {"params": common.cast_floats(params, compute_dtype), "d2t": d2t}
    layout = CacheLayout(paged=False, capacity=ttt_steps * T)
    cache = dc.cache_kind().init(layout, B)
    causal, eye = jnp.tril(jnp.ones((T, T), bool)), jnp.eye(T, dtype=bool)
    ar = jnp.arange(T, dtype=jnp.int32)
    hidden, out = feats.astype(compute_dtype), []
    for k in range(ttt_steps):
        tok_in = jnp.pad(tokens[:, 1 + k:], ((0, 0), (0, 1 + k)))
        local = jnp.concatenate([causal] + [eye] * k, axis=1)[None]  # [1, T, (k+1)T]
        pos = jnp.broadcast_to(ar + k, (B, T))
        local_pos = jnp.broadcast_to(jnp.concatenate([ar + j for j in range(k + 1)]), (B, (k + 1) * T))
        meta = make_meta(layout, None, positions=pos, prefix_len=jnp.zeros((B,), jnp.int32),
                         local_mask=jnp.broadcast_to(local, (B, T, (k + 1) * T)), local_positions=local_pos,
                         write_valid=jnp.ones((B, T), bool)).replace(differentiable=True)
        hidden, cache = dc.forward(tc, tw, dw, tok_in, hidden, cache, meta, k == 0)
        out.append(dc.logits(tc, tw, dw, hidden))
    return out


def ttt_loss(params, d: Eagle3Draft, d2t, tw, tc, tokens, ttt_steps: int, compute_dtype=jnp.float32):
    """(loss, metrics): mean over steps of the cross-entropy to the target's restricted
    distribution; acc{k}: how often step k's draft equals the target's greedy token.
    Attention runs the differentiable jnp reference (the Pallas kernel has no gradient)."""
    with use_backend("reference"):
        return _ttt_loss(params, d, d2t, tw, tc, tokens, ttt_steps, compute_dtype)


def _ttt_loss(params, d, d2t, tw, tc, tokens, ttt_steps, compute_dtype):
    B, T = tokens.shape
    family = family_for(tc)
    hidden, aux, _ = family.forward(tc, tw, tokens, None, prefill_meta(jnp.full((B,), T, jnp.int32), T),
                                    d.target_layers)
    feats = jax.lax.stop_gradient(d.target_features(hidden, aux))
    t_logits = jax.lax.stop_gradient(family.logits(tc, tw, hidden))  # [B,T,V]
    ids = jnp.arange(d.draft_vocab_size) + d2t
    p = jax.nn.softmax(t_logits[..., ids], axis=-1)  # [B,T,Vd]
    greedy = jnp.argmax(t_logits, axis=-1)
    metrics, losses = {}, []
    for k, q in enumerate(ttt_logits(params, d, d2t, tw, tc, tokens, feats, ttt_steps, compute_dtype)):
        # Slot i at step k drafts token i+2+k: the target's distribution at position i+1+k.
        valid = (jnp.arange(T) + 1 + k < T)[None, :]
        tgt_p = jnp.pad(p[:, 1 + k:], ((0, 0), (0, 1 + k), (0, 0)))
        tgt_g = jnp.pad(greedy[:, 1 + k:], ((0, 0), (0, 1 + k)))
        logq = jax.nn.log_softmax(q.astype(jnp.float32), axis=-1)
        ce = -(tgt_p * logq).sum(-1)
        w = valid.astype(jnp.float32) * jnp.ones((B, 1))
        losses.append((ce * w).sum() / w.sum())
        hit = ids[jnp.argmax(q, axis=-1)] == tgt_g
        metrics[f"acc{k}"] = (hit * w).sum() / w.sum()
    loss = jnp.mean(jnp.stack(losses))
    metrics["loss"] = loss
    return loss, metrics


def train_eagle3(target: Params | str, data, out_dir: str | None = None, config: Eagle3TrainConfig | None = None, *,
                 aux_layers=None, extensions=None, resume: bool = True, progress: bool = True,
                 export_dtype: str | None = None, log_every: int = 10, print_every: int = 0):
    """Trains an EAGLE-3 head for `target` and exports it to `out_dir` (SGLang/vLLM format).

    data: text files, directories, .jsonl files (a "text" field per line), or an int token
    array. Checkpoints go to out_dir/checkpoint every config.checkpoint_every steps and are
    resumed when resume=True. Returns (DraftParams, history of logged metrics).
    """
    cfg = config or Eagle3TrainConfig()
    target = common.load_target(target, out_dir)
    tc = target.config
    d = head_config(target, cfg, aux_layers)
    stream = data_mod.token_stream(target, data, extensions)
    d2t = draft_vocab(data_mod.token_counts(stream, tc.vocab_size), d.draft_vocab_size)
    params = init_head(target, d, d2t, cfg.seed)
    opt = common.make_optimizer(cfg.lr, cfg.steps, cfg.warmup, cfg.weight_decay, cfg.clip)
    opt_state = opt.init(params)
    meta = {"target": repr(tc), "head": repr(d), "d2t_sum": int(d2t.astype(np.int64).sum()),
            "config": repr({k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("steps", "checkpoint_every")})}
    ckpt_dir = os.path.join(out_dir, "checkpoint") if out_dir else None
    start = 0
    if ckpt_dir and resume:
        got = common.load_checkpoint(ckpt_dir, params, opt_state, meta)
        if got is not None:
            start, params, opt_state = got
    d2t_j = jnp.asarray(d2t)
    cdt = jnp.dtype(cfg.compute_dtype)
    tw = target.weights

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_jit(params, opt_state, tokens, tw):  # tw is an argument: never baked in as a constant
        (_, metrics), grads = jax.value_and_grad(ttt_loss, has_aux=True)(params, d, d2t_j, tw, tc, tokens,
                                                                         cfg.ttt_steps, cdt)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def step(params, opt_state, tokens):
        return step_jit(params, opt_state, tokens, tw)

    def show(m):
        accs = " ".join(f"{m[f'acc{k}']:.2f}" for k in range(cfg.ttt_steps))
        return f"loss {m['loss']:.3f} acc/step {accs}"

    checkpoint = (lambda s, p, o: common.save_checkpoint(ckpt_dir, s, p, o, meta)) if ckpt_dir else None
    batches = data_mod.batches(stream, cfg.batch_size, cfg.seq_len, cfg.seed, start)
    params, _, history = common.train_loop(step, params, opt_state, batches, cfg.steps, start=start, desc="eagle3",
                                           checkpoint=checkpoint, checkpoint_every=cfg.checkpoint_every,
                                           show=show, progress=progress, log_every=log_every, print_every=print_every)
    dtype = export_dtype or tc.dtype
    out_cfg = dataclasses.replace(d, model=d.model.replace(dtype=dtype))
    weights = {"params": common.cast_floats(params, jnp.dtype(dtype)), "d2t": d2t_j}
    draft = DraftParams(config=out_cfg, weights=weights)
    if out_dir:
        save_draft(out_dir, out_cfg, weights, tc.vocab_size)
    return draft, history
