"""Statistical exactness of sampling, plain and speculative.

A tiny Llama target (vocabulary = width = 32, weights of std 0.5: peaky next-token
distributions) and drafts of every kind for it that agree with it often, not always: an
EAGLE head and EAGLE-3 heads (full vocabulary, and a reduced one of 16 tokens) fitted to the
target around the prompt (random heads are almost never accepted by so peaky a target), and
a standalone draft that is the target with perturbed weights.

- The exact joint distribution of the first 3 generated tokens from one prompt is
  enumerated from the target itself: one batched `jspec.logits` call over every prefix of
  up to 2 generated tokens, processed by an independent numpy reference (`process`) of the
  documented processing: repetition / frequency / presence penalties (which read the path's
  own earlier tokens), temperature, top-k, top-p, min-p. 1024 seeded samples per processing
  configuration and mode through `jspec.compile(...).run(seed=...)` (configurations mixed in
  one batch, each row with its own values and seed) must fit it: no impossible outcome, a
  chi-square p-value > 1e-4 (`chi_square_p`) and a total-variation distance within a bound
  derived from the sample count (`tv_bound`, exceeded with probability < 1e-6). Against the
  exact distribution at another temperature (T * 1.25) the same samples must give
  p < 1e-6: the test has power. Modes: plain decoding; chains and trees verified by the
  target's own samples and chains with sampled drafts, each with every draft kind (n-gram
  drafts, which have no distribution to sample, in trees; a DFlash block drafter, whose
  slots each draw from their own distribution, in sampled chains and trees); dense caches
  and pages of 1 and 16 tokens.
- The accept length of the first round, with the standalone draft and target-only
  verification (chain and tree): its exact distribution is a mixture over the prefill's
  token y0 of the probabilities, under the target's processed distributions, that the
  target's own draw at each node is one of the node's drafted children (the draft's tree is
  rebuilt from the draft's logits: its greedy chain, or its EAGLE-2 selection). Chi-square
  and TV as above, and the wrong-temperature reference must be rejected.

Samples are drawn once per mode (one compile, runs with new seeds) and shared by its tests.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jspec
from conftest import CACHES
from jspec.cache.layout import prefill_meta
from jspec.config import ModelConfig
from jspec.drafts import DFlashDraft, Eagle3Draft, EagleDraft
from jspec.export import save_draft, save_target
from jspec.loading import load_draft
from jspec.models.llama import LLAMA
from jspec.models.llama_hf import gate_up_order, qkv_order

V = 32
PROMPT = [3, 17, 9, 25, 4]
DEPTH = 3  # generated tokens whose joint distribution is enumerated
CONFIGS = {  # processing configurations (unnamed values neutral)
    "T1": dict(temperature=1.0),
    "T0.7-topk5": dict(temperature=0.7, top_k=5),
    # each of the three filters binds somewhere (drop any one and some outcomes become possible)
    "T1.2-topk6-topp0.9-minp0.15": dict(temperature=1.2, top_k=6, top_p=0.9, min_p=0.15),
    "T0.8-penalties": dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
}
NEUTRAL = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
ROWS = 1024  # rows per run
P_MIN = 1e-4  # a right reference must give a chi-square p-value above this
P_POWER = 1e-6  # a wrong reference must give one below this
TV_DELTA = 1e-6  # the TV bound holds with probability >= 1 - TV_DELTA
WRONG_T = 1.25  # the wrong reference's temperature factor


@dataclasses.dataclass(frozen=True)
class Mode:
    """How samples are drawn: a draft kind (None: plain decoding), SpecConfig arguments, a
    cache, the configurations its rows carry (row i: configs[i % len(configs)]) and runs
    of ROWS rows (ROWS * runs / len(configs) samples per configuration)."""

    kind: str | None
    spec: dict | None
    cache: str
    configs: tuple
    runs: int = 2


CHAIN = dict(num_steps=2)
TREE = dict(num_steps=2, topk=2, num_draft_tokens=4)
SAMPLED = dict(num_steps=2, sample_drafts=True)
# A compile costs seconds on CPU (and a speculative run of 1024 rows about one), so each
# speculative mode carries two configurations, rotated so that every configuration meets
# every kind of verification; every draft kind drafts chains, trees and sampled chains
# (EAGLE-3 over the full vocabulary in trees, over a reduced one in chains). The position of
# a mode in this table fixes its seeds (distinct across modes, runs and rows).
MODES = {
    "plain": Mode(None, None, "dense", tuple(CONFIGS), runs=4),
    "sampled-standalone": Mode("standalone", SAMPLED, "dense", ("T0.8-penalties", "T1.2-topk6-topp0.9-minp0.15")),
    "tree-standalone": Mode("standalone", TREE, "dense", ("T0.7-topk5", "T0.8-penalties")),
    "plain-paged16": Mode(None, None, "paged16", ("T0.7-topk5", "T0.8-penalties")),
    "chain-standalone": Mode("standalone", CHAIN, "dense", ("T1", "T0.8-penalties")),
    "chain-eagle-paged1": Mode("eagle", CHAIN, "paged1", ("T0.7-topk5", "T1.2-topk6-topp0.9-minp0.15")),
    "chain-eagle3_reduced": Mode("eagle3_reduced", CHAIN, "dense", ("T1", "T0.8-penalties")),
    "tree-eagle-paged16": Mode("eagle", TREE, "paged16", ("T1", "T1.2-topk6-topp0.9-minp0.15")),
    "tree-eagle3": Mode("eagle3", TREE, "dense", ("T0.7-topk5", "T0.8-penalties")),
    "sampled-eagle": Mode("eagle", SAMPLED, "dense", ("T0.7-topk5", "T0.8-penalties")),
    "sampled-eagle3_reduced-paged1": Mode("eagle3_reduced", SAMPLED, "paged1", ("T1", "T1.2-topk6-topp0.9-minp0.15")),
    "tree-ngram-paged16": Mode("ngram", TREE, "paged16", ("T0.8-penalties", "T1.2-topk6-topp0.9-minp0.15")),
    "sampled-dflash-paged16": Mode("dflash", SAMPLED, "paged16", ("T1", "T0.7-topk5")),
    "tree-dflash": Mode("dflash", TREE, "dense", ("T0.8-penalties", "T1.2-topk6-topp0.9-minp0.15")),
}
FAST = ("plain", "sampled-standalone", "tree-standalone")


def mode_params(names):
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


# ----------------------------------------------------------------------------- models

def fused_order(path, cfg):
    """jspec's column order of a fused matrix (`llama_hf.qkv_order`, `gate_up_order`) if
    `path` names one, else None. The matrices here are drawn and perturbed in Hugging
    Face's [q; k; v] and [gate; up] order, so the models (and the seeds chosen for them)
    do not depend on how jspec orders fused columns."""
    name = jax.tree_util.keystr(path)
    if cfg is None or "kernel" not in name:
        return None
    if "qkv_proj" in name:
        return qkv_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if "gate_up_proj" in name:
        return gate_up_order(cfg.intermediate_size)
    return None


def random_weights(shapes, rng, std: float, cfg=None):
    """Weights for a tree of shapes (jax.eval_shape of an init): matrices N(0, std^2),
    norm weights 1 + 0.1 N(0, 1), biases 0.1 N(0, 1). Filled in numpy: no eager init to run.
    With the model's config, fused matrices are drawn in Hugging Face's order (`fused_order`)."""
    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 2:
            a = (std * rng.randn(*leaf.shape)).astype(leaf.dtype)
            order = fused_order(path, cfg)
            return a if order is None else a[:, order]
        if "bias" in name:
            return (0.1 * rng.randn(*leaf.shape)).astype(leaf.dtype)
        return (1 + 0.1 * rng.randn(*leaf.shape)).astype(leaf.dtype)
    return jax.tree_util.tree_map_with_path(fill, shapes)


def make_target(path: str, *, seed: int) -> jspec.Params:
    """A 3-layer Llama of width 32 over V = 32 tokens with weights of std 0.5 (like
    transformers' initializer_range 0.5): peaky enough that 1024 samples of the 3-token
    joint fill 9-18 cells with expected count >= 5, context-dependent enough that the
    temperature and every filter and penalty show. (Seed and prompt chosen, among a few,
    for the power of the tests: the wrong temperature, a dropped filter or penalty.)"""
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=8)
    shapes = jax.eval_shape(lambda: LLAMA.init_weights(cfg, jax.random.key(0)))
    save_target(path, cfg, random_weights(shapes, np.random.RandomState(seed), 0.5, cfg))
    return jspec.load(path)


def target_states(params):
    """{prefix g: (the target's final-norm hidden state [D], the inputs of its layers 1, 2, 3
    concatenated [3D])} after PROMPT + g, for every g of up to 2 tokens (one forward pass)."""
    prefixes = [g for d in range(3) for g in itertools.product(range(V), repeat=d)]
    tokens = np.array([PROMPT + list(g) + [0] * (2 - len(g)) for g in prefixes], np.int32)
    lens = jnp.asarray([len(PROMPT) + len(g) for g in prefixes], jnp.int32)
    h, aux, _ = jax.jit(LLAMA.forward, static_argnums=(0, 5))(
        params.config, params.weights, jnp.asarray(tokens), None, prefill_meta(lens, tokens.shape[1]), (1, 2, 3))
    rows = (np.arange(len(prefixes)), np.asarray(lens) - 1)
    h = np.asarray(h, np.float64)[rows]
    f = np.concatenate([np.asarray(aux[i], np.float64)[rows] for i in (1, 2, 3)], -1)
    return {g: (h[i], f[i]) for i, g in enumerate(prefixes)}


def head_weights(draft, rng):
    """Random weights for a one-layer EAGLE-family head whose layer adds nothing (its
    attention output and MLP down projections zero): its hidden is fc's output."""
    w = random_weights(jax.eval_shape(lambda: draft.init(jax.random.key(0), V)), rng, 0.2)
    layer = w["params"]["layers_0" if "layers_0" in w["params"] else "midlayer"]
    layer["self_attn"]["o_proj"]["kernel"][:] = 0
    layer["mlp"]["down_proj"]["kernel"][:] = 0
    return w


def make_eagle(path: str, target, states, *, eps: float, seed: int) -> str:
    """An EAGLE head fitted to the target around PROMPT. Its hidden is
    fc([e(token); feature]) = e(token) A + feature B + b, read by the target's LM head K
    (square: V = D): A, B, b solve, for every first token y0, e(y0) A + h(P) B + b = h(P y0)
    and e(d1) A + h(P y0) B + b = h(P y0 d1), with d1 the target's argmax after P y0 and h
    the target's final-norm hidden (noised by eps * its std * N(0, 1)). So the first two
    drafts of a chain are the target's greedy ones, give or take the noise: random heads
    are almost never accepted by this peaky target."""
    rng = np.random.RandomState(seed)
    noisy = lambda h: h + eps * h.std() * rng.randn(*h.shape)
    K = np.asarray(target.weights["params"]["lm_head"]["kernel"], np.float64)
    E = np.asarray(target.weights["params"]["embed_tokens"]["embedding"], np.float64)
    assert E.shape == K.shape == (V, V)
    h_p = states[()][0]
    h1 = np.stack([states[(y,)][0] for y in range(V)])
    d1 = np.argmax(h1 @ K, axis=1)
    h2 = np.stack([states[(y, int(d1[y]))][0] for y in range(V)])
    h1, h2 = noisy(h1), noisy(h2)
    A = np.linalg.solve(E, h1)  # with h(P) B + b = 0
    X = np.vstack([np.hstack([h1, np.ones((V, 1))]), np.append(h_p, 1)[None]])
    Bb = np.linalg.solve(X, np.vstack([h2 - E[d1] @ A, np.zeros((1, E.shape[1]))]))
    d = EagleDraft(target.config.replace(num_layers=1, sliding_windows=(0,)), fc_bias=True)
    w = head_weights(d, rng)
    w["params"]["fc"]["kernel"] = np.vstack([A, Bb[:-1]]).astype(np.float32)
    w["params"]["fc"]["bias"] = Bb[-1].astype(np.float32)
    save_draft(path, d, w, V)
    return path


def make_eagle3(path: str, target, states, *, eps: float, seed: int, draft_vocab: int = V) -> str:
    """An EAGLE-3 head (reading target layers 1, 2, 3) whose first draft after PROMPT is the
    target's argmax after PROMPT y* (y* the target's most likely first token), restricted to
    a draft vocabulary of the draft_vocab tokens most likely there (mapped by d2t): fc maps
    PROMPT's last features to h(P y*) (noised by eps * its std * N(0, 1)) and the head's LM
    head is the target's, so it agrees with the target when the prefill drew y*."""
    rng = np.random.RandomState(seed)
    K = np.asarray(target.weights["params"]["lm_head"]["kernel"], np.float64)
    y_star = int(np.argmax(states[()][0] @ K))
    f, h = states[()][1], states[(y_star,)][0]
    ids = np.sort(np.argsort(-(h @ K))[:draft_vocab])
    h = h + eps * h.std() * rng.randn(*h.shape)
    d = Eagle3Draft(target.config.replace(num_layers=1, sliding_windows=(0,)),
                    target_hidden_size=target.config.hidden_size, aux_layers=(1, 2, 3), draft_vocab_size=draft_vocab)
    w = head_weights(d, rng)
    w["params"]["fc"]["kernel"] = (np.outer(f, h) / (f @ f)).astype(np.float32)
    w["params"]["norm"]["weight"][:] = 1
    w["params"]["lm_head"]["kernel"] = (K[:, ids] * np.sqrt(np.mean(h ** 2))).astype(np.float32)  # undoes the norm
    w["d2t"] = (ids - np.arange(draft_vocab)).astype(np.int32)
    save_draft(path, d, w, V)
    return path


def make_dflash(path: str, target, states, *, seed: int) -> str:
    """A one-layer DFlash drafter (blocks of 3) whose MLP adds nothing and whose attention is
    random, so each slot's distribution depends on its position and the root; its mask
    token and final-norm scale are those (of all tokens and of 0.5, 1, 2) whose slot
    distribution overlaps most with the target's marginal distributions of the second and
    third generated tokens (the product of the two overlaps), so that drafts are accepted
    often, not always."""
    rng = np.random.RandomState(seed)
    K = np.asarray(target.weights["params"]["lm_head"]["kernel"], np.float64)
    E = np.asarray(target.weights["params"]["embed_tokens"]["embedding"], np.float64)
    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    p1 = softmax(states[()][0] @ K)
    p2 = {y: softmax(states[(y,)][0] @ K) for y in range(V)}
    second = sum(p1[y] * p2[y] for y in range(V))
    third = sum(p1[y] * p2[y][z] * softmax(states[(y, z)][0] @ K) for y in range(V) for z in range(V))
    unit = E / np.sqrt(np.mean(E ** 2, axis=1, keepdims=True))
    overlap = {}
    for t in range(V):
        for c in (0.5, 1, 2):
            q = softmax(c * unit[t] @ K)
            overlap[t, c] = np.minimum(q, second).sum() * np.minimum(q, third).sum()
    mask, scale = max(overlap, key=overlap.get)
    d = DFlashDraft(target.config.replace(num_layers=1, sliding_windows=(0,), qk_norm=True), target_layer_ids=(0, 2),
                    num_target_layers=3, block_size=3, mask_token_id=int(mask))
    w = random_weights(jax.eval_shape(lambda: d.init(jax.random.key(0), V)), rng, 0.2)
    w["params"]["layers_0"]["mlp"]["down_proj"]["kernel"][:] = 0
    w["params"]["norm"]["weight"][:] = scale
    save_draft(path, d, w, V)
    return path


def make_perturbed_copy(target, path: str, *, eps: float, seed: int) -> str:
    """The target with every matrix perturbed by eps * its std * N(0, 1), saved as a Llama
    checkpoint: a standalone draft that agrees with the target often, not always (here its
    first round's accept lengths 1, 2, 3 have probabilities 0.30, 0.26, 0.44 at T = 1)."""
    rng = np.random.RandomState(seed)

    def perturb(path, a):
        a = np.asarray(a)
        if a.ndim != 2:
            return a
        order = fused_order(path, target.config)
        a = a if order is None else a[:, np.argsort(order)]  # in Hugging Face's order
        a = a + (eps * a.std() * rng.randn(*a.shape)).astype(a.dtype)
        return a if order is None else a[:, order]

    save_target(path, target.config, jax.tree_util.tree_map_with_path(perturb, target.weights))
    return path


@dataclasses.dataclass
class Family:
    target: jspec.Params
    drafts: dict  # kind name -> draft directory
    standalone: jspec.Params  # the standalone draft loaded as a target (for its logits)
    loaded: dict = dataclasses.field(default_factory=dict)

    def with_draft(self, name):
        if name not in self.loaded:  # n-gram drafts look the prompt up from one token on
            draft = jspec.NgramDraft(min_n=1, max_n=2) if name == "ngram" else load_draft(self.drafts[name], self.target)
            self.loaded[name] = self.target.with_draft(draft)
        return self.loaded[name]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    target = make_target(str(root / "target"), seed=8)
    states = target_states(target)
    drafts = {"eagle": make_eagle(str(root / "eagle"), target, states, eps=0.5, seed=1),
              "eagle3": make_eagle3(str(root / "eagle3"), target, states, eps=0.5, seed=2),
              "eagle3_reduced": make_eagle3(str(root / "eagle3_reduced"), target, states, eps=0.5, seed=3,
                                            draft_vocab=16),
              "standalone": make_perturbed_copy(target, str(root / "standalone"), eps=0.1, seed=0),
              "dflash": make_dflash(str(root / "dflash"), target, states, seed=4)}
    return Family(target, drafts, jspec.load(drafts["standalone"]))


# ------------------------------------------------------------------- numpy reference

def process(z, prompt, gens, cfg):
    """Raw logits z [M,V] at M positions, the generated tokens before each (gens[m], a
    tuple) -> the processed distributions [M,V] (float64) that the sampler must draw from:
    1. repetition penalty r on tokens of the prompt or gens[m]: z / r where z > 0, else z * r;
    2. frequency f, presence pr on generated tokens: z - f * count - pr * [count > 0];
    3. x = z / T; 4. top-k: keep x >= the k-th largest; 5. top-p over the renormalised
    top-k set: keep an entry iff the mass strictly before it (sorted descending) < p, ties
    at the threshold kept; 6. min-p: keep x >= max(x) + log(m); 7. softmax over the kept."""
    cfg = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, **cfg}
    z = np.asarray(z, np.float64)
    counts = np.zeros(z.shape)
    for m, g in enumerate(gens):
        for t in g:
            counts[m, t] += 1
    in_prompt = np.zeros(z.shape[1], bool)
    in_prompt[list(prompt)] = True
    r = cfg["repetition_penalty"]
    z = np.where(in_prompt[None] | (counts > 0), np.where(z > 0, z / r, z * r), z)
    z = z - cfg["frequency_penalty"] * counts - cfg["presence_penalty"] * (counts > 0)
    x = z / cfg["temperature"]
    keep = np.ones(x.shape, bool)
    if cfg["top_k"] > 0:
        keep &= x >= -np.sort(-x, axis=1)[:, cfg["top_k"] - 1: cfg["top_k"]]
    if cfg["top_p"] < 1:
        xs = np.where(keep, x, -np.inf)
        order = np.argsort(-xs, axis=1, kind="stable")
        srt = np.take_along_axis(xs, order, axis=1)
        probs = np.exp(srt - srt[:, :1])
        probs /= probs.sum(1, keepdims=True)
        kept = (np.cumsum(probs, axis=1) - probs) < cfg["top_p"]
        keep &= x >= np.min(np.where(kept, srt, np.inf), axis=1, keepdims=True)
    if cfg["min_p"] > 0:
        keep &= x >= x.max(1, keepdims=True) + np.log(cfg["min_p"])
    xs = np.where(keep, x, -np.inf)
    e = np.exp(xs - xs.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


class Enumerated:
    """Raw logits of a model after PROMPT + every prefix g of up to DEPTH-1 generated tokens
    (one batched jspec.logits call): z[g] [V]."""

    def __init__(self, params):
        self.prefixes = [g for d in range(DEPTH) for g in itertools.product(range(V), repeat=d)]
        lg = np.asarray(jspec.logits(params, [PROMPT + list(g) for g in self.prefixes]))
        self.z = {g: lg[i, len(PROMPT) + len(g) - 1] for i, g in enumerate(self.prefixes)}
        self._probs = {}

    def probs(self, cfg) -> dict:
        """{prefix g: the processed distribution after PROMPT + g, with g generated}."""
        key = tuple(sorted(cfg.items()))
        if key not in self._probs:
            p = process(np.stack([self.z[g] for g in self.prefixes]), PROMPT, self.prefixes, cfg)
            self._probs[key] = dict(zip(self.prefixes, p))
        return self._probs[key]

    def joint(self, cfg):
        """The exact joint distribution [V]*DEPTH of the first DEPTH generated tokens."""
        p = self.probs(cfg)
        out = p[()]
        for d in range(1, DEPTH):
            cond = np.stack([p[g] for g in itertools.product(range(V), repeat=d)]).reshape((V,) * (d + 1))
            out = out[..., None] * cond
        return out


def draft_nodes(draft: Enumerated, y0: int, spec: dict) -> list[tuple]:
    """The deterministic draft's tree under root y0 (nodes as token paths below the root),
    from the draft's softmax at temperature 1 over its raw logits: a chain is the greedy
    continuation; a tree keeps the root's K most probable children, expands each with its K
    most probable children scored by the product of probabilities, and keeps the N-1
    best-scored candidates (EAGLE-2; with S = 2 there is no intermediate pruning)."""
    S, K, N = spec["num_steps"], spec.get("topk", 1), spec.get("num_draft_tokens", spec["num_steps"] + 1)
    assert S == 2, "the enumeration holds the draft's logits to depth 2"

    def children(path, score):
        z = draft.z[(y0,) + path].astype(np.float64)
        q = np.exp(z - z.max())
        q /= q.sum()
        top = np.argsort(-q, kind="stable")[:K]
        return [(path + (int(t),), score * q[t]) for t in top]

    level1 = children((), 1.0)
    cands = level1 + [c for path, s in level1 for c in children(path, s)]
    return [path for path, _ in sorted(cands, key=lambda c: -c[1])[: N - 1]]


def accept_distribution(target: Enumerated, draft: Enumerated, spec: dict, cfg) -> np.ndarray:
    """Exact P(first round's accept length = 1..S+1) under target-only verification: the
    prefill draws y0 ~ p(.|PROMPT); at each node the target's draw continues the path iff it
    is one of the node's drafted children: P(go to child c | at node v) = p_v(c)."""
    S = spec["num_steps"]
    p = target.probs(cfg)
    out = np.zeros(S + 1)
    for y0 in range(V):
        if p[()][y0] == 0:
            continue
        nodes = draft_nodes(draft, y0, spec)

        def visit(path, reach):
            kids = {n[-1] for n in nodes if len(n) == len(path) + 1 and n[:-1] == path}
            if not kids:  # a leaf: the path ends here
                out[len(path)] += reach
                return
            pv = p[(y0,) + path]
            out[len(path)] += reach * (1 - sum(pv[c] for c in kids))
            for c in kids:
                visit(path + (c,), reach * pv[c])

        visit((), p[()][y0])
    return out


# ----------------------------------------------------------------------------- statistics

def cells(counts, probs):
    """The chi-square's cells, fixed by probs and the sample count alone: every outcome with
    expected count >= 5 stands alone; the rest are lumped into one cell, topped up with the
    smallest outcomes until its expected count reaches 5 (dropped if it is 0: impossible
    outcomes are checked apart). -> (observed counts, probabilities) per cell."""
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    exp = counts.sum() * probs
    lumped = exp < 5
    order = np.argsort(exp, kind="stable")
    while exp[lumped].sum() < 5 and not lumped.all():
        lumped[order[lumped.sum()]] = True
    obs, p = np.append(counts[~lumped], counts[lumped].sum()), np.append(probs[~lumped], probs[lumped].sum())
    return (obs, p) if p[-1] > 0 else (obs[:-1], p[:-1])


def chi_square_p(counts, probs, exact_below: float = 1e-3) -> float:
    """Pearson's chi-square p-value of counts against probs (flat over every outcome) over
    `cells` (dof: cells - 1). Far in the tail the chi-square distribution understates the
    statistic's (cells of expected count 5-20 have heavier tails: 2-3 times the nominal rate
    below 1e-4 here), so between 1e-7 and `exact_below` the p-value is the Monte Carlo one:
    the fraction of 10^6 multinomial samples of the same size whose statistic is as large
    (below 1e-7 the chi-square's value stands: far below P_MIN either way)."""
    obs, p = cells(counts, probs)
    if len(p) < 2:
        return 1.0
    n = obs.sum()
    stat = np.sum((obs - n * p) ** 2 / (n * p))
    pv = float(stats.chi2.sf(stat, len(p) - 1))
    if pv >= exact_below or pv < 1e-7:
        return pv
    rng, hits = np.random.RandomState(0), 0
    for _ in range(10):
        sim = rng.multinomial(int(n), p / p.sum(), size=100_000)
        hits += int(np.sum(np.sum((sim - n * p) ** 2 / (n * p), axis=1) >= stat))
    return hits / 1_000_000


def tv_bound(probs, n: int) -> float:
    """A bound that the TV distance between the empirical distribution of n samples and
    probs exceeds with probability < TV_DELTA: E|p^_i - p_i| <= sqrt(p_i (1 - p_i) / n)
    (Jensen), so E[TV] <= 1/2 sum_i of that; TV moves by at most 1/n when one sample
    changes, so by McDiarmid P(TV >= E[TV] + t) <= exp(-2 n t^2): t = sqrt(ln(1/TV_DELTA) / (2n))."""
    p = np.asarray(probs, np.float64).ravel()
    return 0.5 * np.sum(np.sqrt(p * (1 - p) / n)) + math.sqrt(math.log(1 / TV_DELTA) / (2 * n))


def check_fit(counts, exact, wrong, what: str):
    """Counts of outcomes against the exact distribution: no impossible outcome, chi-square
    p > P_MIN, and the TV distance over the chi-square's cells (a partition fixed by the
    exact probabilities and n, so that the bound can be resolved by n samples) within
    tv_bound; against the wrong distribution: p < P_POWER."""
    counts, exact = np.asarray(counts).ravel(), np.asarray(exact).ravel()
    n = int(counts.sum())
    assert counts[exact == 0].sum() == 0, f"{what}: {counts[exact == 0].sum()} samples of impossible outcomes"
    p = chi_square_p(counts, exact)
    obs, pc = cells(counts, exact)
    tv, bound = 0.5 * np.abs(obs / n - pc).sum(), tv_bound(pc, n)
    p_wrong = chi_square_p(counts, wrong, exact_below=0)  # the chi-square's tail: far below 1e-6 here
    assert p > P_MIN, f"{what}: chi-square p = {p:.3g} against the exact distribution (n = {n})"
    assert tv <= bound, f"{what}: TV {tv:.4f} > {bound:.4f} (n = {n})"
    assert p_wrong < P_POWER, f"{what}: the wrong reference was not rejected: p = {p_wrong:.3g}"


# ----------------------------------------------------------------------------- sampling

@dataclasses.dataclass
class Samples:
    tokens: np.ndarray  # [n, DEPTH] the first generated tokens
    first_accept: np.ndarray  # [n] accept length of the first round (1 without a draft)
    config: np.ndarray  # [n] configuration names


def draw(fam: Family, name: str) -> Samples:
    """The mode's runs of ROWS rows of PROMPT through one compiled program; each row carries
    its configuration and its own seed (distinct across rows, runs and modes)."""
    mode = MODES[name]
    params = fam.target if mode.kind is None else fam.with_draft(mode.kind)
    cfg_of_row = [mode.configs[i % len(mode.configs)] for i in range(ROWS)]
    per_row = {k: [{**NEUTRAL, **CONFIGS[c]}[k] for c in cfg_of_row] for k in ("temperature", *NEUTRAL)}
    # Speculative modes: room for the whole first round (y0, then up to S+1 tokens), so
    # that its accept length is never cut.
    max_new = DEPTH if mode.spec is None else max(DEPTH, mode.spec["num_steps"] + 2)
    base = list(MODES).index(name) * 100_000
    seeds = lambda r: [base + r * ROWS + i for i in range(ROWS)]
    prog = jspec.compile(params, [PROMPT] * ROWS, max_new_tokens=max_new, stop_token_ids=[],
                         cache=CACHES[mode.cache], spec=None if mode.spec is None else jspec.SpecConfig(**mode.spec),
                         seed=seeds(0), **per_row)
    toks, acc = [], []
    for r in range(mode.runs):
        out = prog.run(seed=seeds(r))
        assert all(len(t) == max_new for t in out.tokens)
        toks += [t[:DEPTH] for t in out.tokens]
        acc += [a[0] for a in out.stats.accept_lengths]
    return Samples(np.array(toks), np.array(acc), np.array(cfg_of_row * mode.runs))


@pytest.fixture(scope="module")
def samples(family):
    """samples(mode) -> Samples, drawn once per mode for the module."""
    drawn = {}

    def get(mode):
        if mode not in drawn:
            drawn[mode] = draw(family, mode)
        return drawn[mode]
    return get


@pytest.fixture(scope="module")
def exact(family):
    return Enumerated(family.target)


@pytest.fixture(scope="module")
def draft_logits(family):
    return Enumerated(family.standalone)


# ----------------------------------------------------------------------------- tests

def test_reference_processing():
    """The numpy reference on hand-made logits (what the statistical tests lean on)."""
    z = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda **cfg: (process(z, [], [()], dict(temperature=1.0, **cfg)) > 0)[0].tolist()
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # mass before the 3rd: 0.7, not < 0.7
    assert kept(top_p=0.71) == [True, True, True, False, False]
    assert kept(top_k=3, top_p=0.7) == [True, True, False, False, False]  # 0.7 / 0.85 of the top 3 before
    assert kept(top_k=4, top_p=0.8) == [True, True, True, False, False]  # renormalised on the top 4
    assert kept(min_p=0.25) == [True, True, True, False, False]  # p >= 0.5 * 0.25
    np.testing.assert_allclose(process(z, [], [()], dict(temperature=1.0))[0], [0.5, 0.2, 0.15, 0.1, 0.05])
    # Penalties: repetition on prompt and generated tokens, the others on generated ones only.
    z = np.array([[2.0, -1.0, 0.5, 0.0]])
    x = np.log(process(z, [0], [(1, 1)], dict(temperature=2.0, repetition_penalty=2.0, frequency_penalty=0.5,
                                             presence_penalty=0.25)))[0]
    want = np.array([2.0 / 2, -1.0 * 2 - 0.5 * 2 - 0.25, 0.5, 0.0]) / 2.0
    np.testing.assert_allclose(x - x[3], want - want[3])


def test_statistics_helpers():
    """The chi-square and the TV bound are calibrated: samples from the distribution pass,
    samples from a neighbour fail."""
    rng = np.random.RandomState(0)
    p = rng.dirichlet(np.full(40, 0.3))
    q = rng.dirichlet(np.full(40, 0.3))
    ps, tvs = [], []
    for _ in range(200):
        c = rng.multinomial(2000, p)
        ps.append(chi_square_p(c, p))
        tvs.append(0.5 * np.abs(c / 2000 - p).sum())
    assert 0.3 < np.mean(np.array(ps) < 0.5) < 0.7  # roughly uniform p-values under the null
    assert max(tvs) <= tv_bound(p, 2000)
    assert chi_square_p(rng.multinomial(2000, 0.8 * p + 0.2 * q), p) < P_POWER
    # Expected 50, 30, 10, 6, 4, 0: the 4 and the impossible outcome are lumped, topped up with the 6.
    obs, pc = cells([48, 33, 9, 5, 5, 0], [0.5, 0.3, 0.1, 0.06, 0.04, 0.0])
    assert obs.tolist() == [48, 33, 9, 10] and np.allclose(pc, [0.5, 0.3, 0.1, 0.1])


@pytest.mark.parametrize("mode", mode_params(MODES))
def test_first_tokens_follow_the_exact_joint(exact, samples, mode):
    """The first DEPTH tokens of each configuration's rows fit the enumerated joint
    distribution (chi-square, TV) and reject it at the wrong temperature (T * 1.25). In a
    speculative mode with a draft model, first rounds ended at every depth: drafts were
    rejected, accepted, and accepted whole."""
    s = samples(mode)
    for name in MODES[mode].configs:
        cfg = CONFIGS[name]
        counts = np.zeros((V,) * DEPTH, np.int64)
        np.add.at(counts, tuple(s.tokens[s.config == name].T), 1)
        wrong = dict(cfg, temperature=cfg["temperature"] * WRONG_T)
        check_fit(counts, exact.joint(cfg), exact.joint(wrong), f"{mode}, {name}")
    if MODES[mode].kind is not None:
        hist = np.bincount(s.first_accept, minlength=MODES[mode].spec["num_steps"] + 2)[1:]
        assert hist.sum() == len(s.first_accept), f"{mode}: first-round accept lengths {hist}"
        # Every draft model here agrees with the target often; n-gram drafts repeat PROMPT,
        # which this random target does not continue (its accepted paths under sampling:
        # test_ngram.py::test_sampled_equals_plain_sampling).
        # Every accept length occurs, except with n-gram drafts (none may match) and the
        # DFlash tree: its slots' distributions are nearly one (the drafter's MLP is off
        # and the mask tokens differ only by position), so the depth-2 node repeats its
        # parent's token, which the target does not emit twice here; its sampled chains
        # (each slot drawing on its own) reach every length.
        depths = hist[:2] if mode == "tree-dflash" else hist
        assert (depths > 0).all() or MODES[mode].kind == "ngram", f"{mode}: first-round accept lengths {hist}"


@pytest.mark.parametrize("mode", mode_params(["tree-standalone", "chain-standalone"]))
def test_first_round_accept_length_is_exact(exact, draft_logits, samples, mode):
    """Target-only verification with a deterministic draft: the first round's accept length
    follows its exact distribution from the target's probabilities of the drafted children
    (chi-square, TV), and not the one at the wrong temperature (T * 1.25)."""
    spec = MODES[mode].spec
    assert MODES[mode].kind == "standalone" and not spec.get("sample_drafts")
    s = samples(mode)
    for name in MODES[mode].configs:
        cfg = CONFIGS[name]
        counts = np.bincount(s.first_accept[s.config == name] - 1, minlength=spec["num_steps"] + 1)
        wrong = dict(cfg, temperature=cfg["temperature"] * WRONG_T)
        check_fit(counts, accept_distribution(exact, draft_logits, spec, cfg),
                  accept_distribution(exact, draft_logits, spec, wrong), f"{mode} accept lengths, {name}")
