"""DeepSeek-V2/V3 targets (MLA + MoE) against transformers, and speculative decoding over
their MLA latent cache: logits, greedy generation, chains and trees over dense and paged
latent caches, the cache invariant after tree compaction, and the latent's size."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

import jspec
from jspec.cache import kv as kvc
from jspec.cache import layout as lay
from jspec.config import ModelConfig
from jspec.tuning import Tuning
from jspec.drafts import StandaloneDraft
from jspec.export import save_draft, save_target
from jspec.models import family_for
from jspec.models.deepseek_hf import DeepseekConfig
from conftest import PROMPTS, layer_traces, loop_state
import tiny_models

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
              kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=256)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 1.0}
VARIANTS = {  # name -> (transformers class, config)
    "v3": (DeepseekV3ForCausalLM, lambda: DeepseekV3Config(num_hidden_layers=3, num_key_value_heads=4, n_group=2,
                                                           topk_group=1, q_lora_rank=48, rope_scaling=YARN, **COMMON)),
    "v3-rotate-half": (DeepseekV3ForCausalLM, lambda: DeepseekV3Config(
        num_hidden_layers=2, num_key_value_heads=4, n_group=1, topk_group=1, q_lora_rank=None, rope_interleave=False,
        norm_topk_prob=False, **COMMON)),
    "v2-group-limited": (DeepseekV2ForCausalLM, lambda: DeepseekV2Config(
        num_hidden_layers=2, q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5, **COMMON)),
    "v2-greedy-yarn": (DeepseekV2ForCausalLM, lambda: DeepseekV2Config(
        num_hidden_layers=2, q_lora_rank=24, topk_method="greedy", rope_scaling=YARN, **COMMON)),
}


def make_deepseek(path: str, name: str, seed: int = 0):
    cls, cfg = VARIANTS[name]
    torch.manual_seed(seed)
    model = cls(cfg()).eval()
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):  # non-zero: the choice must use it, the weights not
                mod.e_score_correction_bias.copy_(torch.randn_like(mod.e_score_correction_bias) * 0.1)
            if isinstance(mod, torch.nn.Module) and hasattr(mod, "variance_epsilon"):
                mod.weight.copy_(1 + 0.1 * torch.randn_like(mod.weight))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (directory, transformers model)."""
    out = {}
    for name in VARIANTS:
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, make_deepseek(path, name))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers(models, name):
    path, model = models[name]
    toks = np.random.RandomState(1).randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        want = model(torch.tensor(toks)).logits.numpy()
    got = np.asarray(jspec.logits(jspec.load(path, dtype="float32"), toks.tolist()))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_layers_of_a_kind_are_traced_once(models):
    """A program traces the stack's layers of one kind once (`jspec.models.layers.call_layer`):
    three layers (dense, MoE, MoE): two bodies."""
    assert layer_traces(jspec.load(models["v3"][0], dtype="float32")) == (3, 2)


def test_config_forms_and_cache_size(models):
    """rope_scaling + rope_theta (the older form) reads as rope_parameters; the latent cache
    keeps Dc + Dr values a token and layer: 576 for DeepSeek-V3's shape."""
    p = jspec.load(models["v3"][0], dtype="float32")
    c = p.config
    assert isinstance(c, DeepseekConfig) and c.rope.kind == "yarn" and c.q_lora_rank == 48 and c.n_group == 2
    old = dict(family_for(c).weights_to_hf(c, p.weights)[0])
    old.pop("rope_parameters")
    old.update(rope_theta=c.rope.theta, rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                                      "original_max_position_embeddings": 64, "mscale": 0.707,
                                                      "mscale_all_dim": 1.0})
    assert family_for(c).config_from_hf(old, "float32") == c
    v3 = c.replace(kv_lora_rank=512, qk_rope_head_dim=64, num_layers=61, dtype="bfloat16")
    kind = family_for(v3).cache_kind(v3)
    layout = lay.CacheLayout(paged=True, capacity=128, page_size=64, num_pages=4)
    bufs = jax.eval_shape(lambda: kind.init(layout, 2)).latent
    assert len(bufs) == 61 and all(b.shape == (5, 64, 576) for b in bufs)
    per_token_layer = bufs[0].size * bufs[0].dtype.itemsize // (5 * 64)
    assert per_token_layer == 576 * 2  # bytes: no per-head keys or values


def test_export_round_trip(models, tmp_path):
    p = jspec.load(models["v2-greedy-yarn"][0], dtype="float32")
    save_target(str(tmp_path), p.config, p.weights)
    back = DeepseekV2ForCausalLM.from_pretrained(str(tmp_path)).eval()
    toks = [[3, 14, 15, 92, 65, 35]]
    with torch.no_grad():
        want = back(torch.tensor(toks)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jspec.logits(p, toks)), want, atol=1e-4)


def test_moe_reads_only_routed_experts(models):
    """An expert no token routes to may hold NaNs: the grouped products never touch it.
    Each expert of layer 1 is poisoned in turn; the logits stay finite (and unchanged)
    exactly for the experts the tokens did not choose."""
    p = jspec.load(models["v3"][0], dtype="float32")
    toks = [[5, 6, 7]]
    base = np.asarray(jspec.logits(p, toks))
    gate_up = np.asarray(p.weights["params"]["layers_1"]["mlp"]["experts"]["gate_up"])
    unused = []
    for e in range(p.config.n_routed_experts):
        poisoned = jax.tree.map(lambda a: a, p.weights)
        gu = gate_up.copy()
        gu[e] = np.nan
        poisoned["params"]["layers_1"]["mlp"]["experts"]["gate_up"] = jnp.asarray(gu)
        out = np.asarray(jspec.logits(dataclasses.replace(p, weights=poisoned), toks))
        if np.isfinite(out).all():
            unused.append(e)
            np.testing.assert_array_equal(out, base)
    assert 0 < len(unused) < p.config.n_routed_experts


def standalone_draft(path: str, target, seed: int = 3):
    cfg = ModelConfig(vocab_size=target.config.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    d = StandaloneDraft(cfg)
    w = jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a, d.init(jax.random.key(seed), cfg.vocab_size))
    save_draft(path, d, w, cfg.vocab_size)
    return path


@pytest.fixture(scope="module")
def with_draft(models, tmp_path_factory):
    path = models["v3"][0]
    target = jspec.load(path, dtype="float32")
    return jspec.load(path, draft=standalone_draft(str(tmp_path_factory.mktemp("ds_draft")), target), dtype="float32")


def hf_greedy_tokens(model, prompt, n, cached: bool = True):
    """transformers' greedy continuation, computed once per (model, prompt, n) in the run
    (`tiny_models.hf_greedy`: the tests sweeping drafts and caches over one model ask for
    the same reference again); cached False: run transformers now (a test that watches
    its forward)."""
    if cached:
        return tiny_models.hf_greedy(model, prompt, n)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("spec,cache", [
    (None, jspec.CacheConfig("dense")),
    ((3, 1, 4), jspec.CacheConfig("paged", page_size=16)),
    ((3, 4, 8), jspec.CacheConfig("dense")),
], ids=["plain-dense", "chain-paged16", "tree-dense"])
def test_greedy_equals_transformers(models, with_draft, spec, cache):
    """Batches of unequal prompts: plain and speculative greedy output equal transformers'
    (page sizes 1 and 64, with target and draft latent caches: tests/test_mtp.py)."""
    model = models["v3"][1]
    params = with_draft if spec else with_draft.with_draft(None)
    sc = None if spec is None else jspec.SpecConfig(num_steps=spec[0], topk=spec[1], num_draft_tokens=spec[2])
    out = jspec.generate(params, PROMPTS, max_new_tokens=16, stop_token_ids=[], spec=sc, cache=cache)
    for prompt, got in zip(PROMPTS, out.tokens):
        assert got == hf_greedy_tokens(model, prompt, 16)
    if spec:
        assert out.stats.mean_accept_length >= 1.0


def test_latent_cache_holds_what_plain_decoding_writes(with_draft):
    """After tree rounds over a paged latent cache, latent slots [0, L) of every request
    equal a fresh prefill of its committed tokens (the dense layout's moves: the test below)."""
    cfg = jspec.CacheConfig("paged", page_size=16)
    p = with_draft
    plan, st = loop_state(p, PROMPTS, 30, cfg, jspec.SpecConfig(num_steps=3, topk=4, num_draft_tokens=8), rounds=4)
    c = p.config
    family = family_for(c)
    Ls = np.asarray(st.L)
    for b, prompt in enumerate(PROMPTS):
        assert not st.finished[b] and Ls[b] >= len(prompt) + 4
    B, Lmax = len(PROMPTS), int(Ls.max())  # one fresh prefill of every request's committed tokens
    layout = lay.CacheLayout(paged=False, capacity=Lmax)
    pm = lay.prefill_meta(jnp.asarray(Ls[:B], jnp.int32), Lmax)
    meta = lay.make_meta(layout, None, positions=pm.positions, prefix_len=jnp.zeros(B, jnp.int32),
                         local_mask=pm.local_mask, write_valid=jnp.arange(Lmax)[None, :] < Ls[:B, None], prefill=True)
    forward = jax.jit(lambda w, toks, cache: family.forward(c, w, toks, cache, meta)[2])
    fresh = forward(p.weights, st.tokens[:B, :Lmax], family.cache_kind(c).init(layout, B))
    for b in range(B):
        L = int(Ls[b])
        table = st.pages.page_table[b: b + 1] if plan.layout.paged else None
        for layer, (buf, want) in enumerate(zip(st.tcache.latent, fresh.latent)):
            got = kvc.read_kv(buf if table is not None else buf[b: b + 1], table)[0, :L]
            np.testing.assert_allclose(np.asarray(got), np.asarray(want[b, :L]), atol=2e-5,
                                       err_msg=f"layer {layer}, request {b}")


@pytest.mark.parametrize("paged", [False, True])
def test_latent_commit_moves_the_accepted_path(paged):
    """Tree compaction over latent rows and (DeepSeek-V3.2) indexer keys: slot L + path[d]
    moves to L + d for d < accept_len on active rows in both, nothing else changes (against
    a plain-Python reference; pages of 4 interleaved in the pool)."""
    from jspec.cache.latent import LatentCacheKind
    rng = np.random.RandomState(0)
    B, C, P = 3, 24, 4
    layout = lay.CacheLayout(paged=True, capacity=C, page_size=P, num_pages=B * C // P) if paged else \
        lay.CacheLayout(paged=False, capacity=C)
    kind = LatentCacheKind(num_layers=2, kv_lora_rank=5, rope_dim=3, dtype="float32", index_dim=2)  # DSA's keys too
    pages = None
    if paged:  # row b holds pages b, b+B, b+2B, ... (interleaved, so slot order differs from pool order)
        table = np.array([[b + B * g for g in range(C // P)] for b in range(B)], np.int32)
        pages = lay.init_page_state(B, C // P, layout.num_pages).replace(page_table=jnp.asarray(table))
    cache = kind.init(layout, B)
    cache = cache.replace(latent=tuple(jnp.asarray(rng.randn(*b.shape).astype(np.float32)) for b in cache.latent),
                          index_keys=tuple(jnp.asarray(rng.randn(*b.shape).astype(np.float32)) for b in cache.index_keys))
    L = np.array([3, 7, 10], np.int32)
    path = np.array([[0, 2, 5, 6], [0, 1, 3, 4], [0, 3, 4, 7]], np.int32)
    accept = np.array([4, 3, 2], np.int32)
    active = np.array([True, True, False])
    out = kind.commit(cache, layout, pages, jnp.asarray(L), jnp.asarray(path), jnp.asarray(accept), jnp.asarray(active))
    assert len(out.index_keys) == 2
    for buf, got in zip(cache.latent + cache.index_keys, out.latent + out.index_keys):
        rows = lambda a, b: (kvc.read_kv(a, pages.page_table[b: b + 1]) if paged else a[b: b + 1])[0]  # noqa: E731
        for b in range(B):
            want = np.asarray(rows(buf, b)).copy()
            if active[b]:
                src = want.copy()
                for d in range(accept[b]):
                    want[L[b] + d] = src[L[b] + path[b, d]]
            np.testing.assert_array_equal(np.asarray(rows(got, b))[:C], want[:C])


def test_one_row_products_padded_to_two_rows(models):
    """The GPU's one-row padding (`layers.pad_one_row`: XLA would turn these products into a
    multiply plus a reduction), forced on here for every size by a tuning: a product gives
    the values of the plain product, and batch-1 greedy decoding of a bfloat16 model (whose
    projections all take the padding) the same tokens."""
    from jspec.models import layers

    x = jax.random.normal(jax.random.key(0), (1, 1, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 48), jnp.bfloat16)
    params = jspec.load(models["v3"][0], dtype="bfloat16", draft=None)

    def run(tuning):
        jspec.clear_caches()
        out = jspec.generate(params, [PROMPTS[0]], max_new_tokens=8, stop_token_ids=[], tuning=tuning)
        hlo = jax.jit(lambda x, w: layers.product(x, w, float32_out=True, tuning=tuning)).lower(x, w).as_text()
        return layers.product(x, w, float32_out=True, tuning=tuning), out.tokens[0], hlo

    plain = run(Tuning())
    everywhere = Tuning(two_row_backends=(jax.default_backend(),), two_row_elements=(1, 1 << 40))
    assert not layers.pad_one_row(1, w.size)  # by default from 1M elements on, and on GPUs only
    assert layers.pad_one_row(1, w.size, everywhere) and not layers.pad_one_row(2, w.size, everywhere)
    padded = run(everywhere)
    jspec.clear_caches()
    assert "tensor<2x64xbf16>" in padded[2] and "tensor<2x64xbf16>" not in plain[2]  # the padded rows
    assert padded[0].shape == (1, 1, 48)
    np.testing.assert_allclose(np.asarray(padded[0]), np.asarray(plain[0]), rtol=1e-6, atol=1e-6)
    assert padded[1] == plain[1]


@pytest.mark.parametrize("name", ["v2-greedy-yarn", "v3"])
def test_one_token_equals_transformers(models, name):
    """One token (batch-1 decoding's shape): the shared experts run in the routed experts'
    products (`MoE`'s fused path); the logits and the greedy output still equal
    transformers'."""
    path, model = models[name]
    params = jspec.load(path, dtype="float32")
    with torch.no_grad():
        want = model(torch.tensor([[5]])).logits.numpy()
    got = np.asarray(jspec.logits(params, [[5]]))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    out = jspec.generate(params, [PROMPTS[1]], max_new_tokens=12, stop_token_ids=[])
    assert out.tokens[0] == hf_greedy_tokens(model, PROMPTS[1], 12)


def test_tuning_reaches_the_kernels(monkeypatch):
    """With the kernels forced, a decoding step and a prefill of the DeepSeek family hand a
    tuning's groups to every kernel they run: the MLA inputs, attention and output
    kernels, the row products and the expert kernel, the grouped kernel (traced only)."""
    from jspec.kernels.moe.experts import ExpertTiles
    from jspec.kernels.moe.grouped import GroupedTiles
    from jspec.kernels.mla.decode import MlaDecodeTiles
    from jspec.kernels.mla.inputs import MlaInputsTiles
    from jspec.kernels.mla.output import MlaOutputTiles
    from jspec.kernels.moe.route import RouteTiles
    from jspec.kernels.mla import decode as mla_decode, inputs as mla_inputs, output as mla_output
    from jspec.kernels.moe import experts as moe_experts, grouped as moe_grouped, route as moe_route

    tuning = Tuning(experts=ExpertTiles(block_k=32), grouped=GroupedTiles(block_k=32), route=RouteTiles(block_k=32),
                    mla_inputs=MlaInputsTiles(block_c=16), mla_decode=MlaDecodeTiles(block_k=32),
                    mla_output=MlaOutputTiles(block_n=32))
    cfg = DeepseekConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                         kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
                         first_k_dense_replace=1)
    family = family_for(cfg)
    weights = family.init_weights(cfg, jax.random.key(0))
    seen = {}  # kernel -> the tiles (or block_c) it was handed
    for module, name, key in ((mla_inputs, "mla_inputs", "block_c"), (mla_decode, "paged_mla_attention_splits", "tiles"),
                              (mla_output, "mla_output", "tiles"), (moe_experts, "expert_matmul", "tiles"),
                              (moe_grouped, "grouped_experts", "tiles")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, _k=key, **k:
                            seen.setdefault(_n, set()).add(k.get(_k)) or _r(*a, **k))
    route_products = []
    real_route = moe_route.expert_matmul  # the router product: expert_matmul as moe_route imported it
    monkeypatch.setattr(moe_route, "expert_matmul", lambda *a, **k: route_products.append(k) or real_route(*a, **k))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    layout = lay.CacheLayout(paged=False, capacity=16)
    cache = family.cache_kind(cfg).init(layout, 1)
    step = lay.make_meta(layout, None, positions=jnp.full((1, 1), 3), prefix_len=jnp.full((1,), 3),
                         local_mask=jnp.ones((1, 1, 1), bool), write_valid=jnp.ones((1, 1), bool))
    T = 8  # a prefill of 8 tokens x 2 experts: grouped (16 experts)
    prefill = lay.make_meta(layout, None, positions=jnp.arange(T)[None], prefix_len=jnp.zeros((1,), jnp.int32),
                            local_mask=jnp.tril(jnp.ones((T, T), bool))[None], write_valid=jnp.ones((1, T), bool),
                            prefill=True)
    jax.make_jaxpr(lambda w, c: family.forward(cfg, w, jnp.ones((1, 1), jnp.int32), c, step, tuning=tuning))(
        weights, cache)
    jax.make_jaxpr(lambda w, c: family.forward(cfg, w, jnp.ones((1, T), jnp.int32), c, prefill, tuning=tuning))(
        weights, cache)
    assert seen == {"mla_inputs": {16}, "paged_mla_attention_splits": {tuning.mla_decode},
                    "mla_output": {tuning.mla_output}, "expert_matmul": {tuning.experts},
                    "grouped_experts": {tuning.grouped}}
    assert route_products and all(k["tiles"] == tuning.experts and k["block_k"] == 32 for k in route_products)


@pytest.mark.slow
@pytest.mark.parametrize("q_lora", [24, None])
def test_batch_one_through_row_kernels(monkeypatch, fresh_compiles, q_lora):
    """Batch-1 decoding with the kernels forced (interpret mode): the fused query/latent
    projection with the input norm in its prologue and the output projection run as
    `matvec`, the dense first layer's MLP as one expert of `routed_experts` (the
    post-attention norm in its prologue or before it, `Tuning.mlp_norm_in_kernel`); without
    q_lora the projection's K splits go to `mla_inputs` (query absorption, RoPE, latent
    norm); the greedy tokens equal the reference path's."""
    from jspec.kernels.mla import inputs as mla_inputs
    from jspec.kernels.moe import experts as moe_experts

    tuning = Tuning(mlp_norm_in_kernel=q_lora is None)  # both ways of the MLP's norm
    cfg = DeepseekConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                         kv_lora_rank=32, q_lora_rank=q_lora, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                         first_k_dense_replace=1)
    weights = jax.tree.map(lambda a: a * 8 if a.ndim >= 2 else a,  # peaked logits
                           family_for(cfg).init_weights(cfg, jax.random.key(0)))
    params = jspec.Params(cfg, weights)
    kw = dict(max_new_tokens=5, stop_token_ids=[], tuning=tuning)
    monkeypatch.setenv("JSPEC_KERNELS", "reference")
    want = jspec.generate(params, [PROMPTS[1]], **kw).tokens
    calls = []  # (function, experts for routed_experts / output columns for matvec / heads)
    for module, name, what in ((moe_experts, "matvec", lambda a: a[1].shape[1]),
                               (moe_experts, "routed_experts", lambda a: a[2].shape[0]),
                               (mla_inputs, "mla_inputs", lambda a: a[4].shape[1])):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, _w=what, **k:
                            calls.append((_n, _w(a))) or _r(*a, **k))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    jspec.clear_caches()
    assert jspec.generate(params, [PROMPTS[1]], **kw).tokens == want
    # qkv_a_proj: q (q_lora 24, or 2 heads x 32) + latent 32 + rope 16 columns, o_proj: hidden 32;
    # the dense MLP: one expert
    expect = {("matvec", (q_lora or 64) + 48), ("matvec", 32), ("routed_experts", 1), ("routed_experts", 8)}
    assert expect <= set(calls)
    assert (("mla_inputs", 2) in calls) == (q_lora is None)
    jax.clear_caches()


def test_export_round_trip_with_attention_biases(tmp_path):
    """attention_bias: q_a_proj's and kv_a_proj_with_mqa's biases live in the fused
    `qkv_a_proj` and come back apart on export (q_proj has none)."""
    for q_lora in (24, None):
        cfg = DeepseekV2Config(num_hidden_layers=2, q_lora_rank=q_lora, attention_bias=True, topk_method="greedy",
                               **COMMON)
        torch.manual_seed(4)
        model = DeepseekV2ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, t in model.named_parameters():
                if name.endswith(".bias"):
                    t.copy_(torch.randn_like(t) * 0.5)
        src, dst = tmp_path / f"src{q_lora}", tmp_path / f"dst{q_lora}"
        model.save_pretrained(str(src))
        p = jspec.load(str(src), dtype="float32")
        toks = [[3, 14, 15, 92, 65, 35]]
        with torch.no_grad():
            want = model(torch.tensor(toks)).logits.numpy()
        assert np.abs(np.asarray(jspec.logits(p, toks)) - want).max() <= 1e-4 * np.abs(want).max()
        save_target(str(dst), p.config, p.weights)
        back = DeepseekV2ForCausalLM.from_pretrained(str(dst)).eval()
        for name, t in model.state_dict().items():
            np.testing.assert_array_equal(back.state_dict()[name].numpy(), t.numpy(), err_msg=name)
