"""DeepSeek-V3.2 targets (MLA + MoE + DSA sparse attention) against transformers, and
speculative decoding with the checkpoint's own MTP layer over latent caches that hold the
lightning indexer's keys beside the latent, dense and paged (pages of 1, 16, 64).

Ties at the top-k boundary: the index score is sum_h w_h relu(q_h . k), so a token whose
every head scores below zero gets exactly 0, and two correct implementations may select
different tokens of equal score. The tests use 8 indexer heads (such zeros are rare) and
check, on transformers' side, that no selection they make has a tie at its boundary
(`boundary_gaps`): where none has, any correct top-k selects the same tokens."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import PROMPTS, loop_state
from test_deepseek import COMMON, hf_greedy_tokens
from test_mtp import add_mtp_layer
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

import jspec
from jspec.cache import kv as kvc
from jspec.cache import layout as lay
from jspec.kernels.meta import AttnMeta
from jspec.models import family_for

TOPK = 4  # index_topk: below every context here but the shortest prompt's start
LAYERS = 2


def v32_checkpoint(path: str, seed: int = 0):
    """A tiny DeepSeek-V3.2 (one dense and one MoE layer, 8 indexer heads of 16) with one
    MTP layer at model.layers.{LAYERS} in DeepSeek's on-disk names (transformers saves the
    main model only), norms and the indexer's LayerNorm away from their defaults."""
    torch.manual_seed(seed)
    cfg = DeepseekV32Config(num_hidden_layers=LAYERS, num_key_value_heads=4, n_group=2, topk_group=1,
                            q_lora_rank=48, index_topk=TOPK, index_head_dim=16, index_n_heads=8,
                            num_nextn_predict_layers=1, **COMMON)
    model = DeepseekV32ForCausalLM(cfg)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "variance_epsilon"):
                mod.weight.copy_(1 + 0.3 * torch.randn_like(mod.weight))
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.copy_(1 + 0.3 * torch.randn_like(mod.weight))
                mod.bias.copy_(0.3 * torch.randn_like(mod.bias))
    model.save_pretrained(path)
    add_mtp_layer(path, LAYERS, seed, with_head=False)
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    return model.eval()


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v32"))
    return path, v32_checkpoint(path)


@contextlib.contextmanager
def boundary_gaps():
    """Records, for every top-`TOPK` selection transformers' indexer makes, the gap between
    the TOPK-th and the next visible score of each query (relative to the row's largest)."""
    gaps, topk = [], torch.Tensor.topk

    def recording(self, k, *args, **kw):
        if self.dim() == 3 and k == TOPK and self.dtype == torch.float32:
            v = torch.sort(self, dim=-1, descending=True).values
            finite = torch.isfinite(v).sum(-1)
            rows = finite > k
            if rows.any():
                scale = v[..., 0].abs().clamp_min(1e-30)
                gaps.append(float(((v[..., k - 1] - v[..., k]) / scale)[rows].min()))
        return topk(self, k, *args, **kw)
    torch.Tensor.topk = recording
    try:
        yield gaps
    finally:
        torch.Tensor.topk = topk


def test_logits_equal_transformers(v32):
    """Float32 logits of two 13-token rows (every query past the 4th selects 4 of its
    tokens) equal transformers' (relative max difference <= 1e-4), no tie at any boundary;
    attending to every token instead differs (the selection matters)."""
    path, model = v32
    toks = np.random.RandomState(1).randint(0, 128, (2, 13))
    with boundary_gaps() as gaps, torch.no_grad():
        want = model(torch.tensor(toks)).logits.numpy()
    assert len(gaps) == LAYERS and min(gaps) > 1e-5, gaps
    p = jspec.load(path, dtype="float32")
    assert p.config.index_topk == TOPK and p.config.model_type == "deepseek_v32"
    got = np.asarray(jspec.logits(p, toks.tolist()))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale
    dense = jspec.Params(config=p.config.replace(index_topk=64), weights=p.weights)
    assert np.abs(np.asarray(jspec.logits(dense, toks.tolist())) - want).max() > 1e-2 * scale


@pytest.mark.parametrize("cache", ["dense", "paged64"])
def test_greedy_equals_transformers(v32, cache):
    """Plain greedy generation (unequal prompts, 12 tokens) equals transformers' with its
    indexer key cache, no tie at any boundary on its side."""
    path, model = v32
    cfg = jspec.CacheConfig("dense") if cache == "dense" else jspec.CacheConfig("paged", page_size=64)
    out = jspec.generate(jspec.load(path, dtype="float32"), PROMPTS, max_new_tokens=12, stop_token_ids=[], cache=cfg)
    with boundary_gaps() as gaps:
        want = [hf_greedy_tokens(model, prompt, 12, cached=False) for prompt in PROMPTS]
    assert min(gaps) > 1e-5
    assert out.tokens == want


def test_prompt_in_blocks_equals_transformers(v32):
    """A prompt of 180 tokens prefilled in blocks of 64 (`Tuning.prefill_block`): the later
    blocks' indexer scores every cached key and picks its top-k over the whole prefix;
    transformers' greedy tokens, as the whole prompt at once gives."""
    path, model = v32
    prompt = np.random.default_rng(0).integers(3, COMMON["vocab_size"], 180).tolist()
    target = jspec.load(path, dtype="float32")
    prog = jspec.compile(target, prompt, max_new_tokens=4, stop_token_ids=[],
                         cache=jspec.CacheConfig("paged", page_size=16), tuning=jspec.Tuning(prefill_block=64))
    assert prog.plan.prefill_chunk == 64
    assert prog.run().tokens == hf_greedy_tokens(model, prompt, 4)


SPEC_CASES = [((3, 1, 4), "dense"), ((3, 2, 6), "paged1"), ((3, 1, 4), "paged16"), ((3, 2, 6), "paged64")]


@pytest.mark.parametrize("spec,cache", SPEC_CASES, ids=[f"{'chain' if s[1] == 1 else 'tree'}-{c}"
                                                        for s, c in SPEC_CASES])
def test_mtp_greedy_equals_target(v32, spec, cache):
    """The checkpoint's own MTP layer (with its indexer) drafting chains and trees: greedy
    speculative output of unequal prompts equals the target's greedy output, dense and
    paged at 1, 16 and 64 tokens a page."""
    path, _ = v32
    p = jspec.load(path, draft="mtp", dtype="float32")
    assert p.draft.config.model.index_topk == TOPK
    caches = {"dense": jspec.CacheConfig("dense"), "paged1": jspec.CacheConfig("paged", page_size=1),
              "paged16": jspec.CacheConfig("paged", page_size=16), "paged64": jspec.CacheConfig("paged", page_size=64)}
    plain = jspec.generate(p.with_draft(None), PROMPTS, max_new_tokens=16, stop_token_ids=[])
    sc = jspec.SpecConfig(num_steps=spec[0], topk=spec[1], num_draft_tokens=spec[2])
    out = jspec.generate(p, PROMPTS, max_new_tokens=16, stop_token_ids=[], spec=sc, cache=caches[cache])
    assert out.tokens == plain.tokens
    assert out.stats.mean_accept_length >= 1.0


def test_prefix_cache_hits_equal_misses(v32):
    """The serving engine's prefix caching over the latent cache with its indexer keys and
    the MTP draft's cache (pages of 8): requests that share a 40-token prefix with an
    earlier one take its pages (4 and 5 of them) and give the target's greedy tokens, and
    the draft accepts exactly what it accepts in an engine without the cache."""
    path, _ = v32
    p = jspec.load(path, draft="mtp", dtype="float32")
    system = np.random.default_rng(1).integers(3, COMMON["vocab_size"], 40).tolist()
    prompts = [system + [5, 6], system + [7, 8, 9], system + [5, 6]]
    want = jspec.generate(p.with_draft(None), prompts, max_new_tokens=10, stop_token_ids=[]).tokens

    def serve(caching):
        engine = jspec.Engine(p, max_batch=2, max_prompt_len=48, max_new_tokens=10, prefill_chunk=16,
                              cache=jspec.CacheConfig("paged", page_size=8), rounds_per_chunk=2,
                              prefix_caching=caching)
        first = engine.generate(prompts[0], max_new_tokens=10, stop_token_ids=[])
        handles = [engine.submit(q, max_new_tokens=10, stop_token_ids=[]) for q in prompts[1:]]
        while engine.step():
            pass
        return engine, [first.tokens] + [h.result().tokens for h in handles]
    cached, got = serve(True)
    assert got == want
    assert cached.stats.prefix_cache_hits == 8 * (4 + 5)  # the second differs at token 40, the page-4 key's last
    plain, again = serve(False)
    assert again == want and plain.stats.prefix_cache_hits == 0
    assert cached.stats.accept_tokens == plain.stats.accept_tokens > 0


@pytest.mark.slow
def test_the_top_k_kernel_in_the_loop(v32, monkeypatch, fresh_compiles):
    """The top-k selection kernel (`kernels.dsa.topk`, interpret mode) in an MTP tree over a
    paged cache: the same tokens as the reference selection (the sparse MLA kernel takes
    rope dims of 16 and up, this model's are 8: it keeps its reference)."""
    from jspec.kernels.dsa import topk as dsa_topk
    path, _ = v32
    p = jspec.load(path, draft="mtp", dtype="float32")
    kw = dict(max_new_tokens=4, stop_token_ids=[], spec=jspec.SpecConfig(3, 2, 6),
              cache=jspec.CacheConfig("paged", page_size=16))
    want = jspec.generate(p, PROMPTS[:2], **kw).tokens
    calls = []
    real = dsa_topk.topk_slots
    monkeypatch.setattr(dsa_topk, "uses_kernel", lambda scores, k: True)
    monkeypatch.setattr(dsa_topk, "topk_slots", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    jspec.clear_caches()
    assert jspec.generate(p, PROMPTS[:2], **kw).tokens == want
    assert calls  # decode and verification selections ran through it


@pytest.mark.parametrize("page", [64])
def test_index_keys_hold_what_plain_decoding_writes(v32, page):
    """After tree rounds (compaction moving latent rows and indexer keys together) over a
    paged cache, both the latent and the indexer keys at slots [0, L) of every request
    equal a fresh prefill of its committed tokens (pages of 1 and 16: the MTP tests' equal
    outputs; the commit's moves at a page of 4: tests/test_deepseek.py)."""
    path, _ = v32
    p = jspec.load(path, draft="mtp", dtype="float32")
    plan, st = loop_state(p, PROMPTS, 30, jspec.CacheConfig("paged", page_size=page),
                          jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), rounds=4)
    c = p.config
    family = family_for(c)
    Ls = np.asarray(st.L)
    assert len(st.tcache.index_keys) == LAYERS and st.tcache.index_keys[0].shape[-1] == 16
    B, Lmax = len(PROMPTS), int(Ls.max())
    layout = lay.CacheLayout(paged=False, capacity=Lmax)
    pm = lay.prefill_meta(jnp.asarray(Ls[:B], jnp.int32), Lmax)
    meta = lay.make_meta(layout, None, positions=pm.positions, prefix_len=jnp.zeros(B, jnp.int32),
                         local_mask=pm.local_mask, write_valid=jnp.arange(Lmax)[None, :] < Ls[:B, None], prefill=True)
    fresh = jax.jit(lambda w, toks, cache: family.forward(c, w, toks, cache, meta)[2])(
        p.weights, st.tokens[:B, :Lmax], family.cache_kind(c).init(layout, B))
    moved = 0
    for b in range(B):
        L = int(Ls[b])
        assert L >= len(PROMPTS[b]) + 4
        table = st.pages.page_table[b: b + 1]
        for name in ("latent", "index_keys"):
            for layer, (buf, want) in enumerate(zip(getattr(st.tcache, name), getattr(fresh, name))):
                got = kvc.read_kv(buf, table)[0, :L]
                np.testing.assert_allclose(np.asarray(got), np.asarray(want[b, :L]), atol=2e-5,
                                           err_msg=f"{name}, layer {layer}, request {b}")
        moved += L
    assert moved > 0


def test_config_errors(v32, tmp_path):
    path, _ = v32
    c = jspec.load(path, dtype="float32").config
    with pytest.raises(ValueError, match="needs a query latent"):
        c.replace(q_lora_rank=0)
    with pytest.raises(ValueError, match="index_head_dim >= qk_rope_head_dim"):
        c.replace(index_head_dim=4)


def test_split_over_devices(v32):
    """Split over 2 devices (attention by heads, experts by expert; the indexer and its keys
    whole on every device, so every device selects the same tokens): logits and greedy MTP
    tree output equal one device's (float32)."""
    path, _ = v32
    one = jspec.load(path, draft="mtp", dtype="float32")
    two = jspec.load(path, draft="mtp", dtype="float32", devices=2)
    toks = np.random.RandomState(2).randint(0, 128, (2, 11)).tolist()
    np.testing.assert_allclose(np.asarray(jspec.logits(two, toks)), np.asarray(jspec.logits(one, toks)),
                               atol=1e-5 * float(np.abs(np.asarray(jspec.logits(one, toks))).max()))
    sc = jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    cache = jspec.CacheConfig("paged", page_size=16)
    assert (jspec.generate(two, PROMPTS, max_new_tokens=10, stop_token_ids=[], spec=sc, cache=cache).tokens
            == jspec.generate(one, PROMPTS, max_new_tokens=10, stop_token_ids=[], spec=sc, cache=cache).tokens)


def test_export_round_trip(v32, tmp_path):
    """`save_target` writes a directory transformers loads as DeepseekV32ForCausalLM (the
    indexer's tensors included, weights_proj float32) with the same logits."""
    from jspec.export import save_target
    path, _ = v32
    p = jspec.load(path, dtype="float32")
    save_target(str(tmp_path), p.config, p.weights)
    back = DeepseekV32ForCausalLM.from_pretrained(str(tmp_path)).eval()
    toks = [[3, 14, 15, 92, 65, 35, 8, 9, 79]]
    with torch.no_grad():
        want = back(torch.tensor(toks)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jspec.logits(p, toks)), want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("paged", [False, True])
def test_sparse_mla_kernel_equals_references(paged):
    """Sparse MLA attention over selected slots (-1: none; a token with none gets zeros):
    the Pallas kernel (interpret mode, several splits) equals the gather reference, which
    equals the dense reference restricted to the same slots by a mask; dense and paged
    (pages of 4 interleaved in the pool)."""
    from jspec.kernels.mla.decode import mla_attention_reference
    from jspec.kernels.mla.sparse import sparse_mla_attention, sparse_mla_reference
    rng = np.random.RandomState(0)
    B, T, H, Dc, Dr, S, Ki, P = 2, 3, 4, 32, 16, 40, 20, 4
    q_lat = jnp.asarray(rng.randn(B, T, H, Dc).astype(np.float32))
    q_pe = jnp.asarray(rng.randn(B, T, H, Dr).astype(np.float32))
    if paged:
        table = np.array([[b + B * g for g in range(S // P)] for b in range(B)], np.int32)
        buf = jnp.asarray(rng.randn(B * S // P + 1, P, Dc + Dr).astype(np.float32))
    else:
        table = None
        buf = jnp.asarray(rng.randn(B, S + 1, Dc + Dr).astype(np.float32))
    index = np.full((B, T, Ki), -1, np.int32)
    for b in range(B):
        for t in range(T):
            n = [Ki, 7, 0][t] if b == 0 else Ki - t
            index[b, t, :n] = rng.choice(S, n, replace=False)
    index = jnp.asarray(index)
    tab = None if table is None else jnp.asarray(table)
    ref = np.asarray(sparse_mla_reference(q_lat, q_pe, buf, tab, index, scale=0.3))
    got = np.asarray(sparse_mla_attention(q_lat, q_pe, buf, tab, index, scale=0.3, interpret=True, block_k=16,
                                          num_splits=2))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
    assert np.all(ref[0, 2] == 0)  # nothing selected
    select = np.zeros((B, T, S if paged else S + 1), bool)  # the slots the dense reference reads
    for b in range(B):
        for t in range(T):
            select[b, t, [i for i in np.asarray(index[b, t]) if i >= 0]] = True
    meta = AttnMeta(positions=jnp.full((B, T), S - 1, jnp.int32), prefix_len=jnp.full((B,), S, jnp.int32),
                        local_mask=jnp.ones((B, T, 1), bool), local_positions=jnp.zeros((B, 1), jnp.int32),
                        write_index=jnp.zeros((B, T), jnp.int32), page_table=tab, page_size=P if paged else 0)
    dense = np.asarray(mla_attention_reference(q_lat, q_pe, buf, meta, scale=0.3, select=jnp.asarray(select)))
    np.testing.assert_allclose(ref[select.any(-1)], dense[select.any(-1)], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_index_score_kernel_equals_reference(paged):
    """The indexer-score Pallas kernel (interpret mode; 6 heads padded to 16, key blocks of
    16 over 40 slots) equals its reference, dense and paged (pages of 4 interleaved)."""
    from jspec.kernels.dsa.index import index_scores, index_scores_reference
    rng = np.random.RandomState(1)
    B, T, Hi, Di, S, P = 2, 3, 6, 16, 40, 4
    q = jnp.asarray(rng.randn(B, T, Hi, Di).astype(np.float32))
    w = jnp.asarray(rng.randn(B, T, Hi).astype(np.float32))
    if paged:
        table = jnp.asarray(np.array([[b + B * g for g in range(S // P)] for b in range(B)], np.int32))
        buf = jnp.asarray(rng.randn(B * S // P + 1, P, Di).astype(np.float32))
    else:
        table, buf = None, jnp.asarray(rng.randn(B, S + 1, Di).astype(np.float32))
    want = np.asarray(index_scores_reference(q, w, buf, table, scale=0.25))
    got = np.asarray(index_scores(q, w, buf, table, scale=0.25, interpret=True, block_k=16))
    assert got.shape == want.shape == (B, T, S if paged else S + 1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert (want < 0).any() and (want > 0).any()  # signed weights: both signs occur
    # The reference scores slots a block at a time (bounded memory at any context): blocks
    # of 16 over 40 or 41 slots (the last one partial) give the whole scores.
    blocked = np.asarray(index_scores_reference(q, w, buf, table, scale=0.25, block=16))
    np.testing.assert_allclose(blocked, want, atol=1e-6, rtol=1e-6)
    assert not np.allclose(np.asarray(index_scores_reference(q, w, buf, table, scale=0.3, block=16)), want)
