"""Qwen3-Next and Qwen3.5 hybrid targets (Gated DeltaNet + gated attention) against
transformers, and speculative decoding over their hybrid cache: logits, greedy
generation (dense and paged, unequal batches), chains and trees with standalone, n-gram,
EAGLE-3 and MTP drafts, and the invariant that after any round the conv and delta-rule
states equal what plain decoding of the committed tokens holds (replay and checkpoint)."""
from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import PROMPTS, layer_traces, loop_state
from safetensors.torch import load_file, save_file
from test_deepseek import standalone_draft

import jspec
from jspec.cache import kv as kvc
from jspec.cache import layout as lay
from jspec.config import ModelConfig
from jspec.tuning import Tuning
from jspec.drafts import Eagle3Draft
from jspec.export import save_draft, save_target
from jspec.models import family_for
from jspec.models.qwen3_next_hf import HybridConfig

VOCAB = 128
# Three layers, a full-attention one between two linear ones (the layer-to-state indexing is
# not the identity): XLA compiling the unrolled layers is most of these tests' time.
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
             layer_types=["linear_attention", "full_attention", "linear_attention"], num_attention_heads=4,
             num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=8, max_position_embeddings=256)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VARIANTS = {  # name -> (transformers CausalLM class, its config)
    "qwen3_next": (transformers.Qwen3NextForCausalLM, lambda: transformers.Qwen3NextConfig(
        **SHAPE, intermediate_size=96, mlp_only_layers=[1], **MOE)),
    "qwen3_5": (transformers.Qwen3_5ForCausalLM, lambda: transformers.Qwen3_5TextConfig(
        **SHAPE, intermediate_size=96)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeForCausalLM, lambda: transformers.Qwen3_5MoeTextConfig(**SHAPE, **MOE)),
}


def mtp_tensors(model, seed: int) -> dict:
    """Random `mtp.*` tensors for a transformers model (transformers keeps no MTP layer):
    fc, the three norms and one full-attention decoder layer of the model's own kind."""
    cfg = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 1,
                                    "layer_types": ["full_attention"], "mlp_only_layers": []})
    torch.manual_seed(seed)
    layer = type(model.model.layers[0])(cfg, 0)
    D = cfg.hidden_size
    out = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    out.update({"mtp.fc.weight": 0.2 * torch.randn(D, 2 * D)} |
               {f"mtp.{n}.weight": 0.3 * torch.randn(D) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    for k, v in out.items():
        if "norm" in k and v.ndim == 1:
            v.copy_(0.3 * torch.randn_like(v))
        elif v.ndim >= 2:
            v.copy_(0.2 * torch.randn_like(v))
    return {k: v.contiguous() for k, v in out.items()}


def make_hybrid(path: str, name: str, seed: int = 0, *, multimodal: bool = False, **fields):
    """A tiny random model of `name` saved to `path` with an MTP layer (multimodal: laid out
    as a Qwen3_5ForConditionalGeneration checkpoint: text_config, model.language_model.*);
    `fields` replace the variant's config fields."""
    cls, make_cfg = VARIANTS[name]
    cfg = make_cfg()
    for k, v in fields.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms, decays and dt biases
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("A_log", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors")) | mtp_tensors(model, seed + 1)
    with open(os.path.join(path, "config.json")) as f:
        cfg_json = json.load(f)
    cfg_json["mtp_num_hidden_layers"] = 1
    if multimodal:
        tensors = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in tensors.items()}
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
        arch = "Qwen3_5MoeForConditionalGeneration" if name == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
        cfg_json = {"architectures": [arch], "model_type": "qwen3_5", "text_config": cfg_json,
                    "vision_config": {}, "tie_word_embeddings": False}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_json, f)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (directory, transformers model)."""
    out = {}
    for name in VARIANTS:
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, make_hybrid(path, name))
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
    three layers (linear, full, linear): two bodies."""
    assert layer_traces(jspec.load(models["qwen3_5"][0], dtype="float32")) == (3, 2)


def test_multimodal_checkpoint_and_grouped_projections(models, tmp_path):
    """A Qwen3_5MoeForConditionalGeneration directory (text_config, model.language_model.*,
    a vision tower) loads as its text model; Qwen3-Next's grouped in_proj_qkvz / in_proj_ba
    and the experts survive export (transformers reads them back)."""
    path = str(tmp_path / "mm")
    model = make_hybrid(path, "qwen3_5_moe", multimodal=True)
    p = jspec.load(path, dtype="float32")
    assert isinstance(p.config, HybridConfig) and p.config.architecture == "Qwen3_5MoeForConditionalGeneration"
    toks = [[3, 14, 15, 92, 65, 35]]
    with torch.no_grad():
        want = model(torch.tensor(toks)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jspec.logits(p, toks)), want, atol=1e-4 * np.abs(want).max())
    nxt = jspec.load(models["qwen3_next"][0], dtype="float32")
    save_target(str(tmp_path / "out"), nxt.config, nxt.weights)
    back = transformers.Qwen3NextForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        want = back(torch.tensor(toks)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jspec.logits(nxt, toks)), want, atol=1e-4 * np.abs(want).max())


def test_cache_bytes_per_request():
    """Per request: (C - 1) Ch conv values (model dtype) and Hv Dk Dv float32 delta-rule
    values a linear layer, KV of the full-attention layers per slot. Qwen3.5-27B's shape:
    48 linear layers of 3 x 10240 bf16 and 48 x 128 x 128 float32 values."""
    c = HybridConfig(vocab_size=248320, hidden_size=5120, num_layers=64,
                     layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)),
                     num_heads=24, num_kv_heads=4, head_dim=256, rotary_dim=64, linear_num_key_heads=16,
                     linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                     intermediate_size=17408, dtype="bfloat16")
    kind = family_for(c).cache_kind(c)
    assert kind.state_bytes() == 48 * (3 * 10240 * 2 + 48 * 128 * 128 * 4)
    layout = lay.CacheLayout(paged=False, capacity=1023)
    shapes = jax.eval_shape(lambda: kind.init(layout, 2))
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    kv_per_row = 16 * 1024 * 2 * 4 * 256 * 2  # 16 layers, C + 1 slots, keys and values of 4 heads
    assert total == 2 * (kind.state_bytes() + kv_per_row)


def hf_greedy_tokens(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _eagle3_head(path: str, seed: int = 4):
    """A random EAGLE-3 head reading the inputs of layers 1 and 2 of the 3-layer hybrid target and
    its last layer's output (3)."""
    m = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=16)
    d = Eagle3Draft(m, target_hidden_size=64, aux_layers=(1, 2, 3), draft_vocab_size=VOCAB)
    save_draft(path, d, jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a, d.init(jax.random.key(seed), VOCAB)),
               VOCAB)
    return path


@pytest.fixture(scope="module")
def drafted(models, tmp_path_factory):
    """Qwen3.5 with its MTP layer, a standalone draft, an EAGLE-3 head and the n-gram proposer."""
    path = models["qwen3_5"][0]
    target = jspec.load(path, dtype="float32")
    standalone = standalone_draft(str(tmp_path_factory.mktemp("q35_draft")), target)
    eagle3 = _eagle3_head(str(tmp_path_factory.mktemp("q35_eagle3")))
    return {"mtp": jspec.load(path, draft="mtp", dtype="float32"),
            "standalone": jspec.load(path, draft=standalone, dtype="float32"),
            "eagle3": jspec.load(path, draft=eagle3, dtype="float32"),
            "ngram": jspec.load(path, draft="ngram", dtype="float32"), "none": target}


GREEDY = [  # (draft, spec, cache, family)
    ("none", None, jspec.CacheConfig("paged", page_size=1), "qwen3_next"),
    ("none", None, jspec.CacheConfig("dense"), "qwen3_5_moe"),
    ("mtp", (3, 1, 4), jspec.CacheConfig("paged", page_size=16), "qwen3_5"),
    ("mtp", (3, 4, 8), jspec.CacheConfig("dense"), "qwen3_5"),
    ("standalone", (3, 4, 8), jspec.CacheConfig("paged", page_size=64), "qwen3_5"),
    ("eagle3", (3, 2, 5), jspec.CacheConfig("paged", page_size=16), "qwen3_5"),
    ("ngram", (4, 1, 5), jspec.CacheConfig("paged", page_size=1), "qwen3_5"),
]


@pytest.mark.parametrize("draft,spec,cache,family", GREEDY,
                         ids=["plain-paged1-next", "plain-dense-moe", "mtp-chain-paged16", "mtp-tree-dense",
                              "standalone-tree-paged64", "eagle3-tree-paged16", "ngram-chain-paged1"])
def test_greedy_equals_transformers(models, drafted, draft, spec, cache, family):
    """Unequal prompts: plain and speculative greedy output equal transformers' token for
    token (dense, paged 1 / 16 / 64; chains and trees)."""
    model = models[family][1]
    params = drafted[draft] if family == "qwen3_5" else jspec.load(models[family][0], dtype="float32")
    sc = None if spec is None else jspec.SpecConfig(num_steps=spec[0], topk=spec[1], num_draft_tokens=spec[2])
    out = jspec.generate(params, PROMPTS, max_new_tokens=16, stop_token_ids=[], spec=sc, cache=cache)
    for prompt, got in zip(PROMPTS, out.tokens):
        assert got == hf_greedy_tokens(model, prompt, 16)


def test_mtp_layer_equals_its_definition(models, drafted):
    """The MTP draft's logits over a prompt equal the layer computed with transformers'
    modules: fc([norm_e(embed(t+1)); norm_h(final-norm hidden at t)]), one gated
    full-attention layer, mtp.norm, the target's head (what SGLang and vLLM compute)."""
    model = models["qwen3_5"][1]
    p = drafted["mtp"]
    toks = [[5, 9, 2, 77, 31, 8, 100, 64]]
    T = len(toks[0]) - 1
    cfg = model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 1,
                                    "layer_types": ["full_attention"]})
    layer = type(model.model.layers[0])(cfg, 0).eval()
    t = load_file(os.path.join(models["qwen3_5"][0], "model.safetensors"))
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in t.items() if k.startswith("mtp.layers.0.")})

    def norm(x, name):  # Qwen's (1 + w) RMSNorm
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * (1 + t[f"mtp.{name}.weight"])

    with torch.no_grad():
        ids = torch.tensor(toks)
        hidden = model.model(ids).last_hidden_state  # after the final norm
        emb = model.model.embed_tokens(ids[:, 1:])
        x = torch.cat([norm(emb, "pre_fc_norm_embedding"), norm(hidden[:, :-1], "pre_fc_norm_hidden")], -1)
        x = x @ t["mtp.fc.weight"].T
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        want = model.lm_head(norm(x, "norm")).numpy()
    d, c = p.draft.config, p.config

    @jax.jit  # one program, not one per operation
    def logits(tw, dw, tokens):
        meta = lay.prefill_meta(jnp.full((1,), T, jnp.int32), T)
        feats = family_for(c).forward(c, tw, tokens, None, lay.prefill_meta(jnp.full((1,), T + 1, jnp.int32),
                                                                              T + 1))[0][:, :-1]
        return d.logits(c, tw, dw, d.forward(c, tw, dw, tokens[:, 1:], feats, None, meta, True)[0])
    got = np.asarray(logits(p.weights, p.draft.weights, jnp.asarray(toks)))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_sampling_emits_plain_sampling(drafted):
    """Sampled requests with the MTP draft (target-only verification of a tree over a paged
    hybrid cache) emit what plain sampling emits for the same seeds, token for token."""
    kw = dict(max_new_tokens=10, stop_token_ids=[], temperature=[0.0, 1.0, 0.8], top_p=[1.0, 1.0, 0.9],
              repetition_penalty=[1.0, 1.0, 1.2], seed=[0, 1, 2])
    want = jspec.generate(drafted["none"], PROMPTS, **kw).tokens
    out = jspec.generate(drafted["mtp"], PROMPTS, spec=jspec.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4),
                         cache=jspec.CacheConfig("paged", page_size=16), **kw)
    assert out.tokens == want
    assert want[1] != jspec.generate(drafted["none"], PROMPTS, **(kw | {"seed": [0, 5, 2]})).tokens[1]


def test_mtp_needs_mtp_weights(tmp_path):
    path = str(tmp_path)
    VARIANTS["qwen3_5"][0](VARIANTS["qwen3_5"][1]()).save_pretrained(path)
    with pytest.raises(ValueError, match="MTP layer"):
        jspec.load(path, draft="mtp")


@pytest.mark.parametrize("commit,draft,spec", [
    ("replay", "mtp", (3, 2, 6)), ("checkpoint", "mtp", (3, 2, 6)), ("replay", "ngram", (3, 1, 4))],
    ids=["replay-tree", "checkpoint-tree", "replay-ngram-chain"])
def test_recurrent_state_equals_plain_decoding(drafted, commit, draft, spec):
    """After 12 rounds over a paged cache (accept lengths 1, where the random MTP draft offers
    nothing useful, and more; where the n-gram proposer finds no match it offers no valid
    node at all), every row's conv and delta-rule states equal those of plain
    decoding over its committed tokens (float32, <= 1e-5), and its KV slots a fresh
    prefill's. Plain decoding here is the same forward, one token at a time."""
    p = drafted[draft]
    cache = jspec.CacheConfig("paged", page_size=16)
    sc = jspec.SpecConfig(num_steps=spec[0], topk=spec[1], num_draft_tokens=spec[2])
    plan, st = loop_state(p, PROMPTS, 30, cache, sc, rounds=12, tuning=Tuning(recurrent_commit=commit))
    c = p.config
    family, kind = family_for(c), family_for(c).cache_kind(c)
    B = len(PROMPTS)
    Ls = np.asarray(st.L)[:B]
    assert st.tcache.pending is None and (Ls >= np.array([len(q) for q in PROMPTS]) + 12).all()
    hist = np.asarray(st.hist)[:B, :12]
    assert hist.min() == 1 and (draft == "ngram" or hist.max() > 1)  # rounds that kept the root alone, and longer
    Lmax = int(Ls.max())
    layout = lay.CacheLayout(paged=False, capacity=Lmax + 64)
    pm = lay.prefill_meta(jnp.ones((B,), jnp.int32), 1)
    meta0 = lay.make_meta(layout, None, positions=pm.positions, prefix_len=jnp.zeros(B, jnp.int32),
                          local_mask=pm.local_mask, write_valid=jnp.ones((B, 1), bool), prefill=True)
    step = jax.jit(lambda w, tok, cache, L: family.forward(c, w, tok, cache, dataclasses.replace(
        lay.make_meta(layout, None, positions=L[:, None], prefix_len=L, local_mask=jnp.ones((B, 1, 1), bool),
                      write_valid=(L < jnp.asarray(Ls))[:, None]), valid=(L < jnp.asarray(Ls))[:, None]))[2])
    first = jax.jit(lambda w, tok, cache: family.forward(c, w, tok, cache, meta0)[2])
    tokens = jnp.asarray(st.tokens)
    fresh = first(p.weights, tokens[:B, :1], kind.init(layout, B))
    for i in range(1, Lmax):  # token i of every row still short of its L
        fresh = step(p.weights, tokens[:B, i:i + 1], fresh, jnp.full((B,), i, jnp.int32))
    for layer, (got, want) in enumerate(zip(st.tcache.ssm, fresh.ssm)):
        np.testing.assert_allclose(np.asarray(got)[:B], np.asarray(want), atol=1e-5, err_msg=f"ssm {layer}")
    for layer, (got, want) in enumerate(zip(st.tcache.conv, fresh.conv)):
        np.testing.assert_allclose(np.asarray(got)[:B], np.asarray(want), atol=1e-5, err_msg=f"conv {layer}")
    for b in range(B):
        table = st.pages.page_table[b: b + 1]
        for layer, (buf, want) in enumerate(zip(st.tcache.kv.kv, fresh.kv.kv)):
            got = kvc.read_kv(buf, table)[0, :Ls[b]]
            np.testing.assert_allclose(np.asarray(got), np.asarray(want[b, :Ls[b]]), atol=2e-5,
                                       err_msg=f"kv {layer}, request {b}")


@pytest.mark.parametrize("edit,match", [
    ({"layer_types": ["linear_attention"] * 2}, "layer_types must name"),
    ({"layer_types": ["mamba"] * 4}, "layer_types must name"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"linear_num_key_heads": None}, "lacks 'linear_num_key_heads'"),
    ({"architectures": ["Qwen3_5ForConditionalGeneration"]}, "under text_config"),
])
def test_bad_config_gets_a_clear_error(models, tmp_path, edit, match):
    """A malformed config.json fails at load with a ValueError naming the file and the field."""
    import shutil
    src = models["qwen3_5"][0]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(edit)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f)
    with pytest.raises(ValueError, match=match) as err:
        jspec.load(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value)


def test_prefix_cache_restores_recurrent_states(drafted):
    """The serving engine's prefix caching on a hybrid target with its MTP draft (pages of
    4, prompt blocks of 16): the linear layers' states are saved where a prompt block ends
    inside the prompt and at the prompt's last page boundary (a pass stops there), and
    restored into a request that begins with that prefix, which is prefilled from there.
    The rest of a prompt past that boundary passes in the call that saves the state there
    (its first token comes a call sooner). Run one after the other, a 38-token prompt and
    a 10-token one; then, together: one sharing 20 tokens of the first finds 16 (a block's
    end), one sharing all 38 finds 36 (the first's last page boundary), the short one's
    next turn 8 of its 10 (no block ended in it). (Where a shared prefix found ends is
    tested in `tests/test_scheduler.py`: here the engine's 4 snapshots would be reused
    before it.) Every output equals the target's greedy tokens, with its logprobs (a
    wrong restored state changes them even where the tiny model's tokens stay the same)."""
    p = drafted["mtp"]
    rng = np.random.default_rng(2)
    system, short = rng.integers(3, VOCAB, 36).tolist(), rng.integers(3, VOCAB, 10).tolist()
    prompts = [system + [5, 6], short, system[:20] + [7, 8, 9], system + [5, 6, 4], short + [9, 9, 9]]
    want = jspec.generate(p.with_draft(None), prompts, max_new_tokens=10, stop_token_ids=[], logprobs=0)
    engine = jspec.Engine(p, max_batch=2, max_prompt_len=48, max_new_tokens=10, prefill_chunk=16,
                          cache=jspec.CacheConfig("paged", page_size=4), rounds_per_chunk=2)
    first, calls = engine.submit(prompts[0], max_new_tokens=10, stop_token_ids=[], logprobs=0), 0
    while not first.tokens:  # blocks 0-16 and 16-32, then 32-36 (a state saved) and 36-38 in one call
        engine.step()
        calls += 1
    assert calls == 3
    while engine.step():
        pass
    got = [first.result(), engine.generate(prompts[1], max_new_tokens=10, stop_token_ids=[], logprobs=0)]
    handles = [engine.submit(q, max_new_tokens=10, stop_token_ids=[], logprobs=0) for q in prompts[2:]]
    while engine.step():
        pass
    got += [h.result() for h in handles]
    assert engine.plan.layout.snapshots > 0 and engine.runner.prefix_caching
    assert [o.tokens for o in got] == want.tokens
    assert engine.stats.prefix_cache_hits == 16 + 36 + 8
    assert engine.stats.accept_tokens > 0
    for out, lps in zip(got, want.logprobs):
        np.testing.assert_allclose([t.logprob for t in out.logprobs], [t.logprob for t in lps], atol=2e-5)


def test_prefix_hits_pass_short_blocks_narrow(drafted):
    """Prefix caching on the hybrid target with its MTP draft in prompt blocks of 32 (a
    narrow block of 8, pages of 4): a 30-token prompt saves its state at 28 (its last page
    boundary); a request sharing its first 29 tokens finds 28 and passes 28-32 (to a
    block's end, where its state is saved) through the narrow program, then (34 tokens)
    its last 2 in the same call, or (58 tokens) its next block from 32. Every output
    equals the target's greedy tokens and logprobs."""
    p = drafted["mtp"]
    rng = np.random.default_rng(7)
    x = rng.integers(3, VOCAB, 30).tolist()
    prompts = [x, x[:29] + rng.integers(3, VOCAB, 5).tolist(), x[:29] + rng.integers(3, VOCAB, 29).tolist()]
    want = jspec.generate(p.with_draft(None), prompts, max_new_tokens=6, stop_token_ids=[], logprobs=0)
    engine = jspec.Engine(p, max_batch=2, max_prompt_len=64, max_new_tokens=6, prefill_chunk=32,
                          cache=jspec.CacheConfig("paged", page_size=4), rounds_per_chunk=2)
    assert engine.runner.narrow == 8
    got = [engine.generate(prompts[0], max_new_tokens=6, stop_token_ids=[], logprobs=0)]
    before = engine.runner.narrow_passes
    second = engine.submit(prompts[1], max_new_tokens=6, stop_token_ids=[], logprobs=0)
    engine.step()  # its hit, the pass 28-32 and the tail 32-34 in one call: its first token
    assert second.tokens and engine.stats.prefix_cache_hits == 28
    assert engine.runner.narrow_passes == before + 2
    while engine.step():
        pass
    got += [second.result(), engine.generate(prompts[2], max_new_tokens=6, stop_token_ids=[], logprobs=0)]
    assert engine.stats.prefix_cache_hits == 28 + 28
    assert [o.tokens for o in got] == want.tokens
    for out, lps in zip(got, want.logprobs):
        np.testing.assert_allclose([t.logprob for t in out.logprobs], [t.logprob for t in lps], atol=2e-5)


def test_preempted_requests_resume_exactly(drafted):
    """A pool of 7 pages of 8 tokens under 2 rows of the hybrid target with its MTP draft:
    both rows are admitted by the pages they hold, outgrow the pool, and the latest is
    preempted; it resumes by prefilling its prompt and output so far (its conv and
    delta-rule states rebuilt, or restored from a snapshot of its own prefix), and every
    output equals the target's greedy tokens, and a seeded sampled request equals the same
    request run alone."""
    p = drafted["mtp"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (10, 9, 12)]
    want = jspec.generate(p.with_draft(None), prompts, max_new_tokens=20, stop_token_ids=[]).tokens
    sampled = dict(temperature=0.9, seed=4)
    alone = jspec.generate(p, prompts[1], max_new_tokens=20, stop_token_ids=[], **sampled).tokens
    engine = jspec.Engine(p, max_batch=2, max_prompt_len=16, max_new_tokens=20, prefill_chunk=16,
                          cache=jspec.CacheConfig("paged", page_size=8, num_pages=7), rounds_per_chunk=2)
    handles = [engine.submit(q, max_new_tokens=20, stop_token_ids=[]) for q in prompts]
    handles.append(engine.submit(prompts[1], max_new_tokens=20, stop_token_ids=[], **sampled))
    while engine.step():
        pass
    assert [h.result().tokens for h in handles[:3]] == want
    assert handles[3].result().tokens == alone
    assert engine.stats.num_preemptions > 0 and engine.stats.accept_tokens > 0


@pytest.mark.parametrize("spec", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_constrained_mtp_equals_plain(drafted, target, spec):
    """Structured output on the hybrid target with its MTP draft (the tests' byte-level
    tokenizer, whose letters fall in this 128-token vocabulary): constrained speculative
    greedy output equals constrained plain greedy output, chain and tree, paged."""
    pytest.importorskip("outlines_core")
    tok = target.tokenizer
    p = dataclasses.replace(drafted["mtp"], tokenizer=tok)
    prompts = [[5, 9, 2, 77, 31], [100, 101, 102]]
    constraint = [jspec.Regex(r"(ab|c)+d{2,3}"), jspec.Choice(["deaf", "bead", "cab"])]
    kw = dict(max_new_tokens=24, stop_token_ids=[], constraint=constraint,
              cache=jspec.CacheConfig("paged", page_size=16))
    want = jspec.generate(p.with_draft(None), prompts, **kw)
    got = jspec.generate(p, prompts, spec=jspec.SpecConfig(*spec), **kw)
    assert got.tokens == want.tokens
    assert got.finish_reasons[1] == "stop" and tok.decode(got.tokens[1]) in ("deaf", "bead", "cab")
