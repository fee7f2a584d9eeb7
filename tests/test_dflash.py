"""DFlash block drafters (`jspec.drafts.dflash`, `jspec.loop.proposers.block`).

- The draft's block forward equals an independent numpy reading of z-lab's DFlash model
  (context keys and values from the target's layer outputs through fc and hidden_norm,
  bidirectional attention inside the block, RoPE at absolute positions, the target's LM
  head), with the target's features taken from transformers' hidden states.
- Greedy speculative output equals the target's own (chains of every block length,
  trees), dense and paged; seeded sampling gives plain sampling's very tokens
  (target-only verification); the draft's cache after rounds holds exactly the context
  of the committed tokens; engine rows with a plain tier, two block lengths and a tree
  equal the target's runs alone.
- Checkpoints: save and load round trip in z-lab's format; every bad checkpoint or
  setting gets an error naming it.
"""
from __future__ import annotations

import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
import tiny_models
from conftest import CACHES, PROMPTS, loop_state
from jspec.cache import kv as kvc
from jspec.cache import layout as lay
from jspec.drafts import DFlashDraft
from jspec.export import save_draft
from jspec.loading import load_draft, read_config, read_tensors
from jspec.safetensors_io import save as save_tensors
from test_tree import check_cache, check_target_cache, fresh_prefill


# ------------------------------------------------------------------ the forward

def rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x [T, h, Dh] rotated (rotate-half) by positions pos [T]."""
    Dh = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, Dh, 2) / Dh)
    ang = pos[:, None] * inv[None]  # [T, Dh/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., Dh // 2:], x[..., :Dh // 2]], -1)
    return x * cos + rot * sin


def reference_block(t, cfg, feats, block, embed, lm_head):
    """z-lab's DFlash forward read in numpy: t (the draft's tensors), cfg (its config.json),
    feats [n, F] (the context), block [T] token ids at positions n..n+T-1, the target's
    embedding [V, D] and LM head [V, D] -> logits [T, V]."""
    H, Hkv, Dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta, n, T = cfg["rope_theta"], feats.shape[0], len(block)
    ctx = rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    x = embed[block]
    pos = np.arange(n + T, dtype=np.float64)
    for i in range(cfg["num_hidden_layers"]):
        w = {k[len(f"layers.{i}."):]: v for k, v in t.items() if k.startswith(f"layers.{i}.")}

        def proj(x, name):  # q/k/v/o projections carry biases when attention_bias is set
            return x @ w[f"self_attn.{name}.weight"].T + w.get(f"self_attn.{name}.bias", 0)
        h = rms(x, w["input_layernorm.weight"])
        q = rms(proj(h, "q_proj").reshape(T, H, Dh), w["self_attn.q_norm.weight"])
        both = np.concatenate([ctx, h])
        k = rms(proj(both, "k_proj").reshape(n + T, Hkv, Dh), w["self_attn.k_norm.weight"])
        v = proj(both, "v_proj").reshape(n + T, Hkv, Dh)
        q, k = rope(q, pos[n:], theta), rope(k, pos, theta)
        out = np.zeros((T, H, Dh))
        for head in range(H):
            kv = head // (H // Hkv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(Dh)  # every block token sees everything: no mask
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + proj(out.reshape(T, H * Dh), "o_proj")
        h = rms(x, w["post_attention_layernorm.weight"])
        g, u = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w["mlp.down_proj.weight"].T
    return rms(x, t["norm.weight"]) @ lm_head.T


@functools.partial(jax.jit, static_argnums=(0, 1))
def jspec_block(tcfg, d, tw, dw, feats, block):
    """The draft's context over feats [1, n, F], then its block [1, T] at n.. -> logits [T, V]."""
    n, T = feats.shape[1], block.shape[1]
    cache, meta = fresh_prefill(n, n + T + 8, d.cache_kind())  # a cache of room for both
    meta = lay.make_meta(lay.CacheLayout(paged=False, capacity=n + T + 8), None,
                         positions=jnp.arange(n, dtype=jnp.int32)[None], prefix_len=jnp.zeros(1, jnp.int32),
                         local_mask=jnp.ones((1, n, n), bool), write_valid=jnp.ones((1, n), bool))
    cache = d.context(tcfg, tw, dw, feats, cache, meta)
    meta = lay.make_meta(lay.CacheLayout(paged=False, capacity=n + T + 8), None,
                         positions=n + jnp.arange(T, dtype=jnp.int32)[None], prefix_len=jnp.full((1,), n, jnp.int32),
                         local_mask=jnp.ones((1, T, T), bool), write_valid=jnp.ones((1, T), bool))
    hidden, _ = d.block(tcfg, tw, dw, block, cache, meta)
    return d.logits(tcfg, tw, dw, hidden)[0]


def test_block_forward_matches_reference(tmp_path):
    """A 3-layer Qwen3 target; a DFlash draft reading the outputs of target layers 0 and 2
    (the last: transformers' final-norm hidden state), random biases and norms."""
    tdir, ddir = str(tmp_path / "t"), str(tmp_path / "d")
    model = tiny_models.make_model(tdir, "qwen3", layers=3, seed=4)
    target = jspec.load(tdir)
    tc = target.config
    m = tc.replace(num_layers=2, sliding_windows=(0, 0), qkv_bias=True, o_bias=True)
    d = DFlashDraft(m, target_layer_ids=(0, 2), num_target_layers=3, block_size=5, mask_token_id=7)
    rng = np.random.RandomState(0)
    w = jax.tree.map(lambda a: jnp.asarray(rng.randn(*a.shape) * (0.2 if a.ndim == 2 else 0.1) + (a.ndim == 1)
                                           * (np.asarray(a) != 0), a.dtype), d.init(jax.random.key(0), tc.vocab_size))
    save_draft(ddir, d, w, tc.vocab_size)
    loaded = load_draft(ddir, target)
    prompt = [5, 17, 9, 40, 3, 22, 8]
    with torch.no_grad():
        hs = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    feats = np.concatenate([hs[i + 1][0].numpy() for i in (0, 2)], -1).astype(np.float64)
    block = [11] + [7] * 4
    t = {k: np.asarray(v, np.float64) for k, v in read_tensors(ddir).items()}
    embed = model.model.embed_tokens.weight.detach().numpy().astype(np.float64)
    head = model.lm_head.weight.detach().numpy().astype(np.float64)
    want = reference_block(t, read_config(ddir), feats, block, embed, head)
    # jspec's own features: the target's forward with the draft's capture
    hidden, aux, _ = family_forward(tc, loaded.config.target_layers, target.weights, jnp.asarray([prompt]))
    got_feats = loaded.config.target_features(hidden, aux)
    np.testing.assert_allclose(np.asarray(got_feats[0]), feats, atol=2e-5)
    got = jspec_block(tc, loaded.config, target.weights, loaded.weights, got_feats, jnp.asarray([block]))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=1e-4)
    # the context matters: another prompt's features give other logits
    other = jspec_block(tc, loaded.config, target.weights, loaded.weights, got_feats[:, ::-1], jnp.asarray([block]))
    assert np.abs(np.asarray(other) - want).max() > 1e-2


@functools.partial(jax.jit, static_argnums=(0, 1))
def family_forward(tcfg, capture, tw, tokens):
    from jspec.models import family_for
    meta = lay.prefill_meta(jnp.full((1,), tokens.shape[1], jnp.int32), tokens.shape[1])
    return family_for(tcfg).forward(tcfg, tw, tokens, None, meta, capture=capture)


# ------------------------------------------------------------------ exactness

@pytest.mark.parametrize("spec,cache", [
    (None, "dense"),  # the default: the whole block (S = 5)
    (dict(num_steps=2), "paged1"),
    pytest.param(dict(num_steps=4, topk=3, num_draft_tokens=8), "paged16", marks=pytest.mark.slow)],
    ids=["block6-dense", "block3-paged1", "tree-4x3x8-paged16"])
def test_greedy_equals_target(target, with_draft, hf_greedy, spec, cache):
    p = with_draft("dflash")
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    out = jspec.generate(p, prompts, max_new_tokens=20, stop_token_ids=[],
                         spec=None if spec is None else jspec.SpecConfig(**spec), cache=CACHES[cache])
    for q, toks in zip(prompts, out.tokens):
        assert toks == hf_greedy(q, 20)
    assert out.stats.rounds[0] >= 4


def test_seeded_sampling_gives_plain_sampling_tokens(target, with_draft):
    """Target-only verification: the same seed gives plain sampling's tokens, chain and
    tree alike; another seed gives others."""
    p = with_draft("dflash")
    kw = dict(max_new_tokens=16, stop_token_ids=[], temperature=0.9, top_k=40)
    prompts = [PROMPTS[0], PROMPTS[1]]
    plain = jspec.generate(target, prompts, seed=5, **kw).tokens
    assert jspec.generate(p, prompts, seed=5, **kw).tokens == plain
    tree = jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    assert jspec.generate(p, prompts, seed=5, spec=tree, **kw).tokens == plain
    assert jspec.generate(p, prompts, seed=6, **kw).tokens != plain


# ------------------------------------------------------------------ confidence-budgeted verification

def test_budget_choice_equals_a_reading_of_its_rule():
    """`budget.choose` picks, over random survivals, the length of most expected tokens of
    the active rows per unit of cost (rows that do not speculate count one token), as a
    loop in numpy reads the rule; `chain_survival` is the cumulative product; a wrong rule
    (costs ignored) disagrees."""
    from jspec.loop import budget
    rng = np.random.default_rng(0)
    spec = jspec.SpecConfig(num_steps=6, verify_lengths=(1, 2, 4), verify_costs=(1.0, 1.15, 1.3, 1.6))
    wrong = 0
    for trial in range(40):
        B = 1 + trial % 5
        logp = np.log(rng.uniform(0.05, 1.0, (B, 6)) ** rng.uniform(0.2, 3.0))
        surv = np.asarray(budget.chain_survival(jnp.asarray(logp, jnp.float32)))
        np.testing.assert_allclose(surv, np.concatenate([np.ones((B, 1)), np.exp(np.cumsum(logp, 1))], 1), rtol=1e-5)
        half = np.asarray(budget.chain_survival(jnp.asarray(logp, jnp.float32), 0.5))
        np.testing.assert_allclose(half, np.sqrt(surv), rtol=1e-5)
        active, drafting = rng.random(B) < 0.8, rng.random(B) < 0.7
        active[0] = True
        drafting &= active

        def rate(i, costs):
            n = spec.verify_choices[i]
            rows = sum(1 + (surv[r, 1:n + 1].sum() if drafting[r] else 0.0) for r in range(B) if active[r])
            return rows / costs[i]
        rates = [rate(i, spec.verify_costs) for i in range(4)]
        got = int(budget.choose(jnp.asarray(surv), jnp.asarray(active), jnp.asarray(drafting), spec))
        assert got == int(np.argmax(rates)), (trial, rates, got)
        wrong += got != int(np.argmax([rate(i, (1.0,) * 4) for i in range(4)]))
        # costs measured at 1, 2 and 4 rows, read at the round's active rows
        rows_spec = jspec.SpecConfig(6, verify_lengths=(1, 2, 4), verify_cost_rows=(1, 2, 4),
                                     verify_costs=((1.0, 1.0, 1.05, 1.1), (1.0, 1.1, 1.3, 1.6), (1.0, 1.4, 1.9, 2.5)))
        n = int(active.sum())
        at_n = [np.interp(n, [1, 2, 4], [c[i] for c in rows_spec.verify_costs]) for i in range(4)]
        got = int(budget.choose(jnp.asarray(surv), jnp.asarray(active), jnp.asarray(drafting), rows_spec))
        assert got == int(np.argmax([rate(i, at_n) for i in range(4)])), (trial, n, got)
    assert wrong >= 5  # the costs decide


def test_budget_spec_errors(with_draft):
    for kw, match in [(dict(verify_lengths=(3,)), "verify_costs must hold 2"),
                      (dict(verify_lengths=(5,), verify_costs=(1, 1)), r"\[1, 5\)"),
                      (dict(verify_lengths=(3, 2), verify_costs=(1, 1, 1)), "ascending"),
                      (dict(verify_lengths=(2,), verify_costs=(1, 0)), "positive"),
                      (dict(verify_costs=(1.0,)), "need verify_lengths"),
                      (dict(survival_power=0.5), "need verify_lengths"),
                      (dict(verify_lengths=(2,), verify_costs=((1, 2), (1, 3)), verify_cost_rows=(4, 2)), "ascending"),
                      (dict(verify_lengths=(2,), verify_costs=((1, 2),), verify_cost_rows=(1, 8)), "one tuple for each"),
                      (dict(verify_lengths=(2,), verify_costs=(1, 2), verify_cost_rows=(1,)), "one tuple for each"),
                      (dict(verify_lengths=(2,), verify_costs=(1, 2), survival_power=0), "survival_power"),
                      (dict(topk=2, num_draft_tokens=6, verify_lengths=(2,), verify_costs=(1, 2)), "chains")]:
        with pytest.raises(ValueError, match=match):
            jspec.SpecConfig(num_steps=5, **kw)
    spec = jspec.SpecConfig(num_steps=3, verify_lengths=[1], verify_costs=[1, 2])
    assert spec.verify_lengths == (1,) and spec.verify_costs == (1.0, 2.0) and hash(spec)
    with pytest.raises(ValueError, match="estimates each draft's chance"):
        jspec.generate(with_draft("eagle3"), [PROMPTS[0]], max_new_tokens=2, spec=spec)


def test_budgeted_verification_is_exact(target, with_draft, hf_greedy):
    """Verifying a round's first l drafts: greedy output equals the target's whatever the
    costs; costs that always favour one draft give rounds of at most 2 tokens; costs that
    always favour the whole block give the unbudgeted block's very rounds; seeded sampling
    under costs between them gives plain sampling's tokens."""
    p = with_draft("dflash")
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    kw = dict(max_new_tokens=20, stop_token_ids=[], cache=CACHES["dense"])
    whole = jspec.generate(p, prompts, **kw)
    short = jspec.generate(p, prompts, spec=jspec.SpecConfig(5, verify_lengths=(1, 3), verify_costs=(1, 50, 50)),
                           **kw)
    full = jspec.generate(p, prompts, spec=jspec.SpecConfig(5, verify_lengths=(1, 3), verify_costs=(50, 50, 1)),
                          **kw)
    for i, q in enumerate(prompts):
        assert short.tokens[i] == full.tokens[i] == hf_greedy(q, 20)
        assert max(short.stats.accept_lengths[i]) <= 2
    assert full.stats.accept_lengths == whole.stats.accept_lengths
    # What each program verified: a round writes the target's keys at the slots of the nodes
    # it verifies, from the root at L on; a fresh dense cache stays zero where nothing was.
    # The last round wrote L' .. L' + l (L' = L - its accepted length a): l - a slots past L.
    for costs, length in [((1, 50, 50), 1), ((50, 50, 1), 5)]:
        spec = jspec.SpecConfig(5, verify_lengths=(1, 3), verify_costs=costs)
        plan, st = loop_state(p, prompts[:2], 40, CACHES["dense"], spec, rounds=14)
        for b in range(2):
            L, a = int(st.L[b]), int(st.hist[b, int(st.rounds[b]) - 1])
            assert L > 16 and not st.finished[b]  # past the prompt pass's slots
            keys = np.asarray(kvc.read_kv(st.tcache.kv[0][b: b + 1], None))[0, :, 0]  # [slots, Hkv, Dh]
            written = np.abs(keys).reshape(keys.shape[0], -1).max(1) > 0
            past = max(length - a, 0)
            assert written[:L].all() and written[L + 1: L + 1 + past].all() and written[L + 1:].sum() == past, \
                (costs, b, a, written[L - 2:L + 8])
    sampled = dict(max_new_tokens=16, stop_token_ids=[], temperature=0.9, top_k=40)
    plain = jspec.generate(target, prompts[:2], seed=5, **sampled).tokens
    mixed = jspec.SpecConfig(5, verify_lengths=(1, 3), verify_costs=(1.0, 1.02, 1.05), survival_power=0.5)
    assert jspec.generate(p, prompts[:2], seed=5, spec=mixed, **sampled).tokens == plain


@pytest.mark.parametrize("spec,cache", [((5, 1, 6), "paged16"), ((3, 2, 6), "dense")], ids=["chain-paged16",
                                                                                           "tree-dense"])
def test_cache_holds_the_committed_context(with_draft, spec, cache):
    """After rounds, draft slots [0, L) of every row hold the context keys and values of
    the committed tokens: a fresh context write from the target's features of a fresh
    prefill (the block's own writes past L were overwritten or lie past L)."""
    p = with_draft("dflash")
    d = p.draft.config
    S, K, N = spec
    plan, st = loop_state(p, PROMPTS, 30, CACHES[cache], jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N),
                          rounds=4)
    for b, n in enumerate(len(q) for q in PROMPTS):
        L = int(st.L[b])
        assert not st.finished[b] and L >= n + 4
        seq, hidden, aux = check_target_cache(st, plan, p, b, tuple(d.target_layers))
        fresh = context_prefill(p.config, d, p.weights, p.draft.weights, d.target_features(hidden, aux), L)
        check_cache(st, plan, st.proposal.cache, fresh, b, L, "draft")


@functools.partial(jax.jit, static_argnums=(0, 1))
def context_prefill(tcfg, d, tw, dw, feats, n):
    cache, meta = fresh_prefill(n, feats.shape[1], d.cache_kind())
    return d.context(tcfg, tw, dw, feats, cache, meta)


@pytest.mark.slow
def test_engine_rows_equal_the_target_alone(target, with_draft):
    """Engine rows under adaptive tiers (plain, blocks of 3 and 6, a tree, a block of 6
    with budgeted verification, its costs by running rows; the tier switched before every
    chunk) on a paged pool,
    requests joining while others run, greedy and seeded sampling: each equals the
    target's own run alone."""
    from test_engine import MAX_NEW, SAMPLING, alone
    import itertools
    p = with_draft("dflash")
    tiers = (None, jspec.SpecConfig(2), jspec.SpecConfig(5), jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6),
             jspec.SpecConfig(5, verify_lengths=(2,), verify_costs=((1.0, 1.05), (1.0, 1.5)), verify_cost_rows=(1, 3)))
    costs = {(t, n): 1.0 for t in range(5) for n in (1, 2, 4)}
    engine = jspec.Engine(p, max_batch=3, max_prompt_len=16, max_new_tokens=16, cache=CACHES["paged16"],
                          spec=jspec.Adaptive(tiers=tiers, costs=costs), rounds_per_chunk=2, prefill_chunk=8)
    engine._ready()
    order = itertools.cycle([1, 2, 3, 4, 0])
    engine.scheduler.chooser.choose = lambda current, running: next(order)
    from test_engine import staggered
    got = staggered(engine)
    for i, out in got.items():
        assert out.tokens == alone(target, i)[0], i
    assert all(n > 0 for n in engine.stats.tier_chunks.values()), engine.stats
    assert engine.stats.accept_rounds > 0
    del MAX_NEW, SAMPLING


# ------------------------------------------------------------------ checkpoints and errors

def test_checkpoint_round_trip_and_errors(llama_dir, target, drafts, tmp_path):
    d = load_draft(drafts["dflash"], target)
    assert isinstance(d.config, DFlashDraft) and d.config.block_size == 6
    assert jspec.load(llama_dir[0], draft=drafts["dflash"]).draft.config == d.config
    cfg = read_config(drafts["dflash"])
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [0, 1]
    tensors = read_tensors(drafts["dflash"])
    assert "fc.weight" in tensors and "layers.1.self_attn.k_norm.weight" in tensors
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)

    def broken(name, edit=None, drop=()):
        path = str(tmp_path / name)
        os.makedirs(path)
        c = json.loads(json.dumps(cfg))
        if edit:
            edit(c)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f)
        save_tensors(os.path.join(path, "model.safetensors"), {k: v for k, v in tensors.items() if k not in drop})
        return path

    cases = {
        "deep": (lambda c: c["dflash_config"].update(target_layer_ids=[0, 5]), "do not fit the 2-layer target"),
        "depth": (lambda c: c.update(num_target_layers=36), "36-layer target"),
        "nomask": (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        "badmask": (lambda c: c["dflash_config"].update(mask_token_id=10 ** 6), "has no embedding"),
        "vocab": (lambda c: c.update(vocab_size=cfg["vocab_size"] + 1), "vocab_size"),
        "dflash2": (lambda c: c.update(architectures=["DFlash2DraftModel"]), "not supported"),
        "sliding": (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "sliding-window"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_draft(broken(name, edit), target)
    with pytest.raises(ValueError, match="fc.weight"):
        load_draft(broken("nofc", drop=("fc.weight",)), target)
    p = target.with_draft(d)
    with pytest.raises(ValueError, match="block_size is 6"):
        jspec.generate(p, [PROMPTS[1]], max_new_tokens=4, spec=jspec.SpecConfig(num_steps=6))


# ------------------------------------------------------------------ training

def test_training_blocks_equal_inference_blocks(target, with_draft):
    """The training forward (every anchor's block at once, masked to the context before its
    anchor and its own block) gives each block the logits drafting gives it: the context
    of the tokens before the anchor, then the anchor's token and mask tokens."""
    from jspec.train.dflash import block_logits
    p = with_draft("dflash")
    d, tc = p.draft.config, p.config
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 250, size=(1, 24)), jnp.int32)
    anchors = jnp.asarray([[2, 5, 13, 18]], jnp.int32)
    hidden, aux, _ = family_forward(tc, d.target_layers, p.weights, tokens)
    feats = d.target_features(hidden, aux)
    got = jax.jit(block_logits, static_argnums=(1, 3, 7))(p.draft.weights["params"], d, p.weights, tc, tokens, feats,
                                                          anchors, jnp.float32)
    for j, a in enumerate(np.asarray(anchors[0])):
        block = jnp.asarray([[int(tokens[0, a])] + [d.mask_token_id] * (d.block_size - 1)])
        want = jspec_block(tc, d, p.weights, p.draft.weights, feats[:, :a], block)
        np.testing.assert_allclose(np.asarray(got[0, j]), np.asarray(want[1:]), atol=2e-4, err_msg=f"anchor {a}")


def test_training_differentiates_over_many_keys(with_draft):
    """Over more keys than the reference attends at once (1,024: it then runs an online
    softmax over blocks of them), the training loss still has gradients."""
    from jspec.kernels.attention.decode import REFERENCE_BLOCK_K
    from jspec.train import block_loss
    p = with_draft("dflash")
    d, tc = p.draft.config, p.config
    T, A = 540, 90  # keys: 540 + 90 * 6 > 1024
    assert T + A * d.block_size > REFERENCE_BLOCK_K
    tokens = jnp.asarray(np.random.RandomState(2).randint(3, 250, size=(1, T)), jnp.int32)
    anchors = jnp.asarray(np.sort(np.random.RandomState(3).choice(T - d.block_size + 1, A, replace=False))[None],
                          jnp.int32)
    grads, metrics = jax.jit(jax.grad(block_loss, has_aux=True), static_argnums=(1, 3))(
        p.draft.weights["params"], d, p.weights, tc, tokens, anchors)
    norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and max(norms) > 0 and np.isfinite(float(metrics["loss"]))


def test_target_text_is_the_targets_greedy_continuation(target, hf_greedy):
    """`data.target_text`: seeded windows of the corpus, each followed by transformers'
    own greedy continuation (to the end-of-text token) and that token."""
    from jspec.train.data import TARGET_TEXT_PROMPT, target_text
    stream = np.arange(3, 203, dtype=np.int32)
    got = target_text(target, stream, windows=3, new_tokens=6, seed=5)
    want = []
    for s in np.random.RandomState(5).randint(0, stream.size - TARGET_TEXT_PROMPT + 1, size=3):
        window = stream[s:s + TARGET_TEXT_PROMPT].tolist()
        cont = list(hf_greedy(window, 6, stop=(2,)))
        want += window + cont + ([] if cont[-1:] == [2] else [2])
    assert got.tolist() == want
    with pytest.raises(ValueError, match="fewer than a window"):
        target_text(target, stream[:10], windows=1, new_tokens=6)


@pytest.mark.slow
def test_training_lowers_loss_exports_resumes_and_cli(target, llama_dir, tmp_path, capsys):
    from jspec.train import DFlashTrainConfig, train_dflash
    from jspec.train.cli import main as cli_main
    rng = np.random.RandomState(1)
    unit = rng.randint(3, 250, size=7)
    stream = np.concatenate([unit] * 60 + [rng.randint(3, 250, size=50)]).astype(np.int32)  # a repeating corpus
    out = str(tmp_path / "dflash")
    cfg = DFlashTrainConfig(steps=24, batch_size=4, seq_len=32, block_size=4, lr=1e-2, warmup=2,
                            compute_dtype="float32", checkpoint_every=12)
    draft, hist = train_dflash(target, stream, out, cfg, layer_ids=(0, 1), progress=False, log_every=1)
    losses = [h["loss"] for h in hist]
    assert np.mean(losses[-5:]) < losses[0] - 0.3, losses
    assert {"loss", "tau", "acc1", "acc2", "acc3"} <= set(hist[-1])
    cfg_json = read_config(out)
    assert cfg_json["architectures"] == ["DFlashDraftModel"] and cfg_json["block_size"] == 4
    assert cfg_json["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [0, 1]}  # the tokenizer's pad
    loaded = load_draft(out, target)
    assert loaded.config == draft.config
    chex.assert_trees_all_close(jax.tree.map(np.asarray, loaded.weights), jax.tree.map(np.asarray, draft.weights))
    # speculation with it equals plain decoding
    q = [int(t) for t in unit] * 2
    assert jspec.generate(target.with_draft(loaded), [q], max_new_tokens=12).tokens == \
        jspec.generate(target, [q], max_new_tokens=12).tokens
    # resume, then the CLI over text
    _, hist2 = train_dflash(target, stream, out, DFlashTrainConfig(**{**cfg.__dict__, "steps": 28}),
                            layer_ids=(0, 1), progress=False, log_every=1)
    assert hist2[0]["step"] == 25
    text = tmp_path / "c.py"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    rc = cli_main(["dflash", "--target", llama_dir[0], "--data", str(text), "--out", str(tmp_path / "cli"),
                   "--steps", "3", "--batch-size", "2", "--seq-len", "24", "--block-size", "4", "--dtype", "float32",
                   "--target-layer-ids", "1", "--target-text", "2"])
    assert rc == 0 and read_config(str(tmp_path / "cli"))["dflash_config"]["target_layer_ids"] == [1]
    assert cli_main(["dflash", "--target", llama_dir[0], "--data", str(text), "--out", str(tmp_path / "bad"),
                     "--block-size", "1"]) == 2
    assert "block_size must be at least 2" in capsys.readouterr().err
