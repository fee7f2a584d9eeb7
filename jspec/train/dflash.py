"""DFlash block-drafter training (the block-diffusion objective, one denoising step), and
export in z-lab's format.

The target runs frozen over a batch of sequences [B, T] and supplies, per position, the
context feature (its chosen layers' outputs) and its next-token distribution. Each row
gets A random anchors a (distinct, 0 <= a <= T - b): block a is the token at a followed by
b - 1 mask tokens at positions a..a+b-1, exactly as drafting sees it at inference. Every
block is trained at once in one forward: the context keys and values of all T positions
are written once, and block a's tokens see the context at positions < a and the tokens of
their own block (bidirectionally), nothing else. Block slot i (1 <= i < b) learns the
target's distribution of the token at a + i by cross-entropy, weighted by
exp(-(i - 1) / loss_decay) (loss_decay 0: equal weights).

Metrics: acc{i} (i = 1, ..., up to 4), how often slot i's argmax is the target's greedy
token there; and `tau`, 1 plus the expected count of leading slots whose argmax is the
target's greedy token: the mean accepted length greedy verification would give if the
context were the target's own output.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.cache.layout import prefill_meta
from jspec.drafts.dflash import DFlashDraft
from jspec.export import save_draft
from jspec.kernels.dispatch import use_backend
from jspec.kernels.meta import AttnMeta
from jspec.models import family_for
from jspec.params import DraftParams, Params
from jspec.train import common, data as data_mod


@dataclasses.dataclass(frozen=True)
class DFlashTrainConfig:
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 1.0
    block_size: int = 16
    blocks_per_seq: int | None = None  # anchors a sequence (A); None: seq_len // block_size
    num_layers: int = 1  # the draft's decoder layers
    intermediate_size: int | None = None  # None: the target's
    loss_decay: float = 0.0  # slot i's weight exp(-(i - 1) / loss_decay); 0: equal weights
    compute_dtype: str = "bfloat16"  # float32 master weights, this for the forward pass
    checkpoint_every: int = 500
    seed: int = 0
    # Windows of the corpus the target continues, greedy, for seq_len - 64 tokens each,
    # trained on before the corpus (`data.target_text`; 0: the corpus alone).
    target_text: int = 0

    def __post_init__(self):
        common.check_settings(self, ints=("steps", "batch_size", "seq_len", "block_size", "num_layers"),
                              counts=("warmup", "target_text"), positive=("lr", "clip"), non_negative=("weight_decay", "loss_decay"),
                              optional_ints=("blocks_per_seq", "intermediate_size"))
        if self.block_size < 2:
            raise ValueError(f"DFlashTrainConfig.block_size must be at least 2 (the root and a draft), "
                             f"got {self.block_size}")
        if self.seq_len < self.block_size + 1:
            raise ValueError(f"seq_len ({self.seq_len}) must exceed block_size ({self.block_size})")
        if self.anchors > self.seq_len - self.block_size + 1:
            raise ValueError(f"DFlashTrainConfig.blocks_per_seq must be in 1..{self.seq_len - self.block_size + 1} "
                             f"(distinct anchors in a sequence of {self.seq_len}), got {self.anchors}")

    @property
    def anchors(self) -> int:
        return self.blocks_per_seq if self.blocks_per_seq is not None else max(self.seq_len // self.block_size, 1)


def default_layer_ids(num_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """z-lab's choice for Qwen3-8B (36 layers: 1, 9, 17, 25, 33), spread the same way over n
    layers: `count` outputs evenly from layer 1 to layer n - 3, clamped into 0..n-1."""
    n = num_target_layers
    ids = {min(max(round(1 + j * (n - 4) / max(count - 1, 1)), 0), n - 1) for j in range(count)}
    return tuple(sorted(ids))


def mask_token(target: Params, counts: np.ndarray) -> int:
    """The block's mask id: the tokenizer's pad token if it has one, else the id least seen
    in the corpus (the highest among ties)."""
    pad = getattr(target.tokenizer, "pad_token_id", None) if target.tokenizer is not None else None
    if pad is not None and 0 <= pad < target.config.vocab_size:
        return int(pad)
    return int(len(counts) - 1 - np.argmin(counts[::-1]))


def draft_config(target: Params, cfg: DFlashTrainConfig, layer_ids, mask_id: int) -> DFlashDraft:
    tc = target.config
    n = tc.num_layers
    ids = tuple(int(i) for i in (layer_ids if layer_ids else default_layer_ids(n)))
    if not ids or any(not 0 <= i < n for i in ids):
        raise ValueError(f"DFlash target layer ids {list(ids)} do not fit the {n}-layer target: each must be in "
                         f"0..{n - 1} (jspec-train dflash --target-layer-ids)")
    m = tc.replace(num_layers=cfg.num_layers, sliding_windows=(0,) * cfg.num_layers,
                   intermediate_size=cfg.intermediate_size or tc.intermediate_size, tie_word_embeddings=False,
                   qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, model_type="qwen3",
                   architecture="DFlashDraftModel", bos_token_id=None, eos_token_ids=())
    return DFlashDraft(m, target_layer_ids=ids, num_target_layers=n, block_size=cfg.block_size, mask_token_id=mask_id)


def block_logits(params, d: DFlashDraft, tw, tc, tokens, feats, anchors, compute_dtype):
    """Every anchor's block in one forward: tokens [B,T], context features [B,T,F],
    anchors [B,A] -> logits [B,A,b-1,V] of block slots 1..b-1. No cache: each layer's
    context keys and values go before the blocks' in one attention (`train_blocks`)."""
    B, T = tokens.shape
    A, b = anchors.shape[1], d.block_size
    dc = dataclasses.replace(d, model=d.model.replace(dtype=jnp.dtype(compute_dtype).name))
    dw = {"params": common.cast_floats(params, compute_dtype)}
    ar = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B,A]
    blk = jnp.concatenate([first[..., None], jnp.full((B, A, b - 1), d.mask_token_id, jnp.int32)], -1)
    pos = (anchors[..., None] + jnp.arange(b, dtype=jnp.int32)).reshape(B, A * b)
    # keys: the context of every position, then every block; a block sees the context
    # before its anchor and its own block
    sees_ctx = jnp.arange(T)[None, None, :] < jnp.repeat(anchors, b, axis=1)[:, :, None]  # [B, A*b, T]
    block_id = jnp.arange(A * b) // b
    sees_blk = jnp.broadcast_to(block_id[:, None] == block_id[None, :], (B, A * b, A * b))
    meta = AttnMeta(positions=pos, prefix_len=jnp.zeros((B,), jnp.int32),
                    local_mask=jnp.concatenate([sees_ctx, sees_blk], axis=-1),
                    local_positions=jnp.concatenate([ar, pos], axis=1), write_index=jnp.zeros_like(pos),
                    page_table=None, prefill=True)
    hidden = dc.train_blocks(tc, tw, dw, blk.reshape(B, A * b), feats.astype(compute_dtype), meta)
    hidden = hidden.reshape(B, A, b, -1)[:, :, 1:]
    return dc.logits(tc, tw, dw, hidden)


def block_loss(params, d: DFlashDraft, tw, tc, tokens, anchors, compute_dtype=jnp.float32, loss_decay: float = 0.0):
    """(loss, metrics) of the blocks at `anchors` [B,A] over tokens [B,T] (module
    docstring). Attention runs the differentiable jnp reference."""
    with use_backend("reference"):
        return _block_loss(params, d, tw, tc, tokens, anchors, compute_dtype, loss_decay)


def _block_loss(params, d, tw, tc, tokens, anchors, compute_dtype, loss_decay):
    B, T = tokens.shape
    b = d.block_size
    family = family_for(tc)
    hidden, aux, _ = family.forward(tc, tw, tokens, None, prefill_meta(jnp.full((B,), T, jnp.int32), T),
                                    d.target_layers)
    feats = jax.lax.stop_gradient(d.target_features(hidden, aux))
    t_logits = jax.lax.stop_gradient(family.logits(tc, tw, hidden))  # [B,T,V]: position p predicts p+1
    q = block_logits(params, d, tw, tc, tokens, feats, anchors, compute_dtype).astype(jnp.float32)  # [B,A,b-1,V]
    at = (anchors[..., None] + jnp.arange(b - 1)).reshape(B, -1)  # slot i predicts a+i: logits at a+i-1
    t_at = jnp.take_along_axis(t_logits, at[..., None], axis=1).reshape(q.shape)
    ce = -(jax.nn.softmax(t_at, axis=-1) * jax.nn.log_softmax(q, axis=-1)).sum(-1)  # [B,A,b-1]
    i = jnp.arange(b - 1, dtype=jnp.float32)
    w = jnp.exp(-i / loss_decay) if loss_decay > 0 else jnp.ones_like(i)
    loss = (ce * w).sum(-1).mean() / w.sum()
    hit = jnp.argmax(q, axis=-1) == jnp.argmax(t_at, axis=-1)  # [B,A,b-1]
    metrics = {f"acc{k + 1}": hit[..., k].mean() for k in range(min(b - 1, 4))}
    metrics["tau"] = 1 + jnp.cumprod(hit, axis=-1).sum(-1).mean()
    metrics["loss"] = loss
    return loss, metrics


def random_anchors(key, batch: int, seq_len: int, block: int, count: int):
    """[batch, count] distinct anchors in 0..seq_len-block, sorted, a row each."""
    keys = jax.random.split(key, batch)
    pick = jax.vmap(lambda k: jax.random.choice(k, seq_len - block + 1, (count,), replace=False))(keys)
    return jnp.sort(pick, axis=1).astype(jnp.int32)


def train_dflash(target: Params | str, data, out_dir: str | None = None, config: DFlashTrainConfig | None = None, *,
                 layer_ids=None, mask_token_id: int | None = None, extensions=None, resume: bool = True,
                 progress: bool = True, export_dtype: str | None = None, log_every: int = 10, print_every: int = 0):
    """Trains a DFlash block drafter for `target` and exports it to `out_dir` (z-lab's
    `DFlashDraftModel` format, which `jspec.load(target, draft=out_dir)` reads).

    data: as `jspec.train.train_eagle3`. layer_ids: the target layers (0-based outputs)
    the draft reads (None: `default_layer_ids`); mask_token_id: None: `mask_token`.
    Returns (DraftParams, history of logged metrics)."""
    cfg = config or DFlashTrainConfig()
    target = common.load_target(target, out_dir)
    tc = target.config
    stream = data_mod.token_stream(target, data, extensions)
    if cfg.target_text:
        own = data_mod.target_text(target, stream, cfg.target_text, max(cfg.seq_len - data_mod.TARGET_TEXT_PROMPT, 1),
                                   seed=cfg.seed)
        stream = np.concatenate([own, stream])
    if mask_token_id is None:
        mask_token_id = mask_token(target, data_mod.token_counts(stream, tc.vocab_size))
    if not 0 <= mask_token_id < tc.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target's vocabulary of {tc.vocab_size}")
    d = draft_config(target, cfg, layer_ids, int(mask_token_id))
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), d.init(jax.random.key(cfg.seed), tc.vocab_size)["params"])
    opt = common.make_optimizer(cfg.lr, cfg.steps, cfg.warmup, cfg.weight_decay, cfg.clip)
    opt_state = opt.init(params)
    meta = {"target": repr(tc), "draft": repr(d),
            "config": repr({k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("steps", "checkpoint_every")})}
    ckpt_dir = f"{out_dir}/checkpoint" if out_dir else None
    start = 0
    if ckpt_dir and resume:
        got = common.load_checkpoint(ckpt_dir, params, opt_state, meta)
        if got is not None:
            start, params, opt_state = got
    cdt = jnp.dtype(cfg.compute_dtype)
    tw = target.weights
    key = jax.random.key(cfg.seed + 1)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_jit(params, opt_state, tokens, step, tw):
        B, T = tokens.shape
        anchors = random_anchors(jax.random.fold_in(key, step), B, T, cfg.block_size, cfg.anchors)
        (_, metrics), grads = jax.value_and_grad(block_loss, has_aux=True)(params, d, tw, tc, tokens, anchors, cdt,
                                                                           cfg.loss_decay)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    counter = [start]

    def step(params, opt_state, tokens):
        counter[0] += 1
        return step_jit(params, opt_state, tokens, jnp.int32(counter[0]), tw)

    def show(m):
        accs = " ".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("acc"))
        return f"loss {m['loss']:.3f} tau {m['tau']:.2f} acc/slot {accs}"

    checkpoint = (lambda s, p, o: common.save_checkpoint(ckpt_dir, s, p, o, meta)) if ckpt_dir else None
    batches = data_mod.batches(stream, cfg.batch_size, cfg.seq_len, cfg.seed, start)
    params, _, history = common.train_loop(step, params, opt_state, batches, cfg.steps, start=start, desc="dflash",
                                           checkpoint=checkpoint, checkpoint_every=cfg.checkpoint_every,
                                           show=show, progress=progress, log_every=log_every, print_every=print_every)
    dtype = export_dtype or tc.dtype
    out_cfg = dataclasses.replace(d, model=d.model.replace(dtype=dtype))
    weights = {"params": common.cast_floats(params, jnp.dtype(dtype))}
    if out_dir:
        save_draft(out_dir, out_cfg, weights, tc.vocab_size)
    return DraftParams(config=out_cfg, weights=weights), history
