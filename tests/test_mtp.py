"""MTP (NextN) drafts: a DeepSeek-V3 checkpoint's own MTP layer against transformers'
`MtpModel`, greedy speculative output over dense and paged latent caches, NextN
directories (SGLang's export format), and the errors for checkpoints without MTP."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import jspec
from jspec import safetensors_io
from jspec.cache.layout import prefill_meta
from jspec.drafts import MtpDraft
from jspec.drafts.mtp import layer_config
from jspec.export import save_draft
from conftest import PROMPTS, loop_state
from test_deepseek import COMMON, YARN, hf_greedy_tokens

LAYERS = 2


def mtp_checkpoint(path: str, seed: int = 0):
    """A tiny DeepSeek-V3 with one MTP layer at model.layers.{LAYERS}, in the on-disk names
    DeepSeek's checkpoints use (transformers saves the main model only)."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(num_hidden_layers=LAYERS, num_key_value_heads=4, n_group=2, topk_group=1, q_lora_rank=48,
                           rope_scaling=YARN, num_nextn_predict_layers=1, **COMMON)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # norms away from one: the final norm tells its input and output apart after hnorm
        for mod in model.modules():
            if hasattr(mod, "variance_epsilon"):
                mod.weight.copy_(1 + 0.3 * torch.randn_like(mod.weight))
    model.save_pretrained(path)
    add_mtp_layer(path, LAYERS, seed, with_head=True)
    return DeepseekV3ForCausalLM.from_pretrained(path).eval()


def add_mtp_layer(path: str, layers: int, seed: int, with_head: bool):
    """Adds a random MTP layer (jspec's init, norms and weights away from their defaults)
    at model.layers.{layers} of the saved checkpoint in `path`; with_head: also the copies
    of the embedding and LM head that V3 ships beside it."""
    tcfg = jspec.load(path, dtype="float32").config
    draft = MtpDraft(layer_config(tcfg))
    w = draft.init(jax.random.key(seed + 1), tcfg.vocab_size)
    keys = iter(jax.random.split(jax.random.key(seed + 2), 64))
    w = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(next(keys), a.shape, a.dtype) if a.ndim == 1 else a * 4, w)
    tensors = {k: np.array(v) for k, v in safetensors_io.load(os.path.join(path, "model.safetensors")).items()}
    tensors.update({k.replace("model.layers.0.", f"model.layers.{layers}."): v for k, v in draft.to_hf(w, 0)[1].items()})
    if with_head:
        tensors[f"model.layers.{layers}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[f"model.layers.{layers}.shared_head.head.weight"] = tensors["lm_head.weight"]
    safetensors_io.save(os.path.join(path, "model.safetensors"), tensors)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v3_mtp"))
    return path, mtp_checkpoint(path)


def _nextn_export(src: str, dst: str):
    """What SGLang's export_deepseek_nextn.py writes: the config with one layer and the
    NextN architecture, the MTP layer's tensors renamed to model.layers.0 without the
    embedding and head."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=1, architectures=["DeepseekV3ForCausalLMNextN"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    prefix = f"model.layers.{LAYERS}."
    tensors = {k.replace(prefix, "model.layers.0."): v for k, v in
               safetensors_io.load(os.path.join(src, "model.safetensors")).items()
               if k.startswith(prefix) and "embed_tokens" not in k and "shared_head.head" not in k}
    safetensors_io.save(os.path.join(dst, "nextn_layer_parameters.safetensors"), tensors)


def test_mtp_layer_equals_transformers(mtp_target):
    """The draft's logits equal transformers' MtpModel on the same checkpoint, fed the way
    transformers' MTPCandidateGenerator feeds it: hidden_states[-1], which is the target's
    final-norm output (checked here), with token i+1 at position i+1."""
    from transformers.modeling_layers import MtpModel
    path, model = mtp_target
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]  # transformers assumes V3's 61
    mtp = MtpModel.from_pretrained(model)
    p = jspec.load(path, draft="mtp", dtype="float32")
    assert set(p.draft.weights) == {"params"}  # the embedding and head equal the target's: shared, not copied
    toks = np.random.RandomState(0).randint(0, 128, (2, 10))
    with torch.no_grad():
        out = model(torch.tensor(toks), output_hidden_states=True)
        final = model.model(torch.tensor(toks)).last_hidden_state
        assert torch.equal(out.hidden_states[-1], final)
        h = out.hidden_states[-1][:, :-1]
        pos = torch.arange(1, 10)[None].expand(2, -1)
        want = mtp._project_to_logits(mtp.forward_layer(0, h, pos, None, input_ids=torch.tensor(toks[:, 1:]))).numpy()
    d, meta = p.draft.config, prefill_meta(jnp.full((2,), 9, jnp.int32), 9)
    meta = meta.replace(positions=meta.positions + 1)

    @jax.jit  # one program, not one per operation
    def logits(tw, dw, tokens, h, meta):
        return d.logits(p.config, tw, dw, d.forward(p.config, tw, dw, tokens, h, None, meta, True)[0])
    got = np.asarray(logits(p.weights, p.draft.weights, jnp.asarray(toks[:, 1:]), jnp.asarray(h.numpy()), meta))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_tuning_reaches_every_product(mtp_target):
    """The DeepSeek family's and the MTP draft's forward and logits pass their tuning down
    to every layer (MLA, the dense MLP, the MoE layer, the MTP layer, the LM heads): with
    `cpu_matmul_max_rows=0` no product of the program runs the native CPU loops, with the
    default tuning (few float32 rows) they do."""
    from jspec.tuning import Tuning
    from jspec.models import family_for
    from test_models import native_products
    p = jspec.load(mtp_target[0], draft="mtp", dtype="float32")
    c, d, T = p.config, p.draft.config, 3
    family = family_for(c)
    meta = prefill_meta(jnp.full((1,), T, jnp.int32), T)
    tokens = jnp.ones((1, T), jnp.int32)
    hidden = family.forward(c, p.weights, tokens, None, meta)[0]
    draft_weights = dict(p.draft.weights, head=p.weights["params"]["lm_head"]["kernel"])  # its own head too

    def target(tuning):
        def fn(w, tokens):
            return family.logits(c, w, family.forward(c, w, tokens, None, meta, tuning=tuning)[0], tuning=tuning)
        return native_products(fn, p.weights, tokens)

    def draft(tuning, dw):
        def fn(tw, dw, tokens, feats):
            h, _ = d.forward(c, tw, dw, tokens, feats, None, meta, True, tuning=tuning)
            return d.logits(c, tw, dw, h, tuning=tuning)
        return native_products(fn, p.weights, dw, tokens, hidden)

    assert target(Tuning()) and not target(Tuning(cpu_matmul_max_rows=0))
    for dw in (p.draft.weights, draft_weights):  # the target's LM head, its own
        assert draft(Tuning(), dw) and not draft(Tuning(cpu_matmul_max_rows=0), dw)


def test_first_draft_matches_transformers_mtp(mtp_target):
    """The hidden-state convention inside the loop: after the prompt's prefill and draft
    extend, the draft's first-level candidates are the top-K of transformers' MtpModel fed
    as its MTPCandidateGenerator feeds it (the target's last hidden states, the prompt
    shifted by one plus the target's next token)."""
    from transformers.modeling_layers import MtpModel
    path, model = mtp_target
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    mtp = MtpModel.from_pretrained(model)
    p = jspec.load(path, draft="mtp", dtype="float32")
    K = 4
    plan, st = loop_state(p, PROMPTS, 4, jspec.CacheConfig("dense"),
                          jspec.SpecConfig(num_steps=2, topk=K, num_draft_tokens=5), rounds=0)
    first_tokens, _, _ = plan.proposer.first_level(plan, p.weights, p.draft.weights, st.proposal, st)
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = model(torch.tensor([prompt]), output_hidden_states=True)
            ids = torch.tensor([prompt[1:] + [int(out.logits[0, -1].argmax())]])
            pos = torch.arange(1, len(prompt) + 1)[None]
            logits = mtp._project_to_logits(mtp.forward_layer(0, out.hidden_states[-1], pos, None, input_ids=ids))
        want = torch.topk(logits[0, -1], K).indices.tolist()
        assert sorted(np.asarray(first_tokens[b]).tolist()) == sorted(want), b


@pytest.mark.parametrize("spec,cache", [
    ((3, 1, 4), jspec.CacheConfig("paged", page_size=16)),
    ((3, 4, 8), jspec.CacheConfig("dense")),
    ((2, 3, 6), jspec.CacheConfig("paged", page_size=64)),
    pytest.param((2, 1, 3), jspec.CacheConfig("paged", page_size=1), marks=pytest.mark.slow),
], ids=["chain-paged16", "tree-dense", "tree-paged64", "chain-paged1"])
def test_mtp_greedy_equals_transformers(mtp_target, spec, cache):
    """One MTP layer drafting chains and trees over its own latent cache: batches of unequal
    prompts give transformers' greedy output token for token."""
    path, model = mtp_target
    p = jspec.load(path, draft="mtp", dtype="float32")
    sc = jspec.SpecConfig(num_steps=spec[0], topk=spec[1], num_draft_tokens=spec[2])
    out = jspec.generate(p, PROMPTS, max_new_tokens=14, stop_token_ids=[], spec=sc, cache=cache)
    for prompt, got in zip(PROMPTS, out.tokens):
        assert got == hf_greedy_tokens(model, prompt, 14)
    assert out.stats.mean_accept_length >= 1.0


def test_nextn_directory_loads_as_the_embedded_layer(mtp_target, tmp_path):
    """SGLang's NextN export and jspec's own export of the draft load to the same weights as
    draft="mtp"; speculative output is the same."""
    path, _ = mtp_target
    embedded = jspec.load(path, draft="mtp", dtype="float32")
    _nextn_export(path, str(tmp_path / "sglang"))
    save_draft(str(tmp_path / "jspec"), embedded.draft.config, embedded.draft.weights, 128)
    sc = jspec.SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    want = jspec.generate(embedded, PROMPTS[:2], max_new_tokens=8, stop_token_ids=[], spec=sc)
    for d in ("sglang", "jspec"):
        p = jspec.load(path, draft=str(tmp_path / d), dtype="float32")
        assert isinstance(p.draft.config, MtpDraft) and p.draft.config == embedded.draft.config
        jax.tree.map(np.testing.assert_array_equal, p.draft.weights, embedded.draft.weights)
    out = jspec.generate(p, PROMPTS[:2], max_new_tokens=8, stop_token_ids=[], spec=sc)
    assert out.tokens == want.tokens
    assert out.stats.accept_lengths == want.stats.accept_lengths


def test_mtp_errors(mtp_target, llama_dir, tmp_path):
    """draft="mtp" without MTP weights, on a non-DeepSeek target, or a NextN layer of another
    width: a ValueError naming the problem."""
    path, _ = mtp_target
    with pytest.raises(ValueError, match="needs a checkpoint with MTP layers"):
        jspec.load(llama_dir[0], draft="mtp")
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    tensors = {k: np.array(v) for k, v in safetensors_io.load(str(bare / "model.safetensors")).items()
               if not k.startswith(f"model.layers.{LAYERS}.")}
    safetensors_io.save(str(bare / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match="safetensors hold no"):
        jspec.load(str(bare), draft="mtp")
    cfg = json.loads((bare / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        jspec.load(str(bare), draft="mtp")
    nextn = tmp_path / "nextn"
    _nextn_export(path, str(nextn))
    cfg = json.loads((nextn / "config.json").read_text())
    cfg["hidden_size"] = 32
    (nextn / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        jspec.load(path, draft=str(nextn))


def test_mtp_sampling_emits_plain_sampling(mtp_target):
    """Sampled requests with the MTP draft (target-only verification of a tree over a paged
    latent cache) emit what plain sampling emits for the same seeds, token for token."""
    p = jspec.load(mtp_target[0], draft="mtp", dtype="float32")
    kw = dict(max_new_tokens=10, stop_token_ids=[], temperature=[0.0, 1.0, 0.8], top_p=[1.0, 1.0, 0.9],
              repetition_penalty=[1.0, 1.0, 1.2], seed=[0, 1, 2])
    want = jspec.generate(p.with_draft(None), PROMPTS, **kw).tokens
    out = jspec.generate(p, PROMPTS, spec=jspec.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4),
                         cache=jspec.CacheConfig("paged", page_size=16), **kw)
    assert out.tokens == want


@pytest.mark.slow
def test_deepseek_and_mtp_through_pallas_kernels(monkeypatch, fresh_compiles):
    """A DeepSeek target and its MTP draft with the MLA and MoE kernels forced (interpret
    mode) give the reference path's greedy tokens; every kernel runs in the loop."""
    through_kernels(monkeypatch)


def through_kernels(monkeypatch, devices: int | None = None, moe_width: int = 16):
    """A tiny DeepSeek target with its MTP draft: greedy tokens with the MLA and expert
    kernels forced (interpret mode; split over `devices` if given) equal the reference
    path's on one device, and every kernel ran."""
    from jspec.kernels.mla import decode as mla_decode, output as mla_output
    from jspec.kernels.moe import experts as moe_experts
    from jspec.models import family_for
    from jspec.models.deepseek_hf import DeepseekConfig
    cfg = DeepseekConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                         kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         moe_intermediate_size=moe_width, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                         first_k_dense_replace=1, num_nextn_predict_layers=1)
    draft = MtpDraft(layer_config(cfg))
    scale = lambda w: jax.tree.map(lambda a: a * 8 if a.ndim >= 2 else a, w)  # noqa: E731  (peaked logits)
    p = jspec.Params(cfg, scale(family_for(cfg).init_weights(cfg, jax.random.key(0)))).with_draft(
        jspec.DraftParams(draft, scale(draft.init(jax.random.key(1), cfg.vocab_size))))
    kw = dict(max_new_tokens=5, stop_token_ids=[], spec=jspec.SpecConfig(num_steps=2),
              cache=jspec.CacheConfig("paged", page_size=16))
    monkeypatch.setenv("JSPEC_KERNELS", "reference")
    want = jspec.generate(p, PROMPTS[:2], **kw).tokens
    calls = []
    kernels = ((mla_decode, "paged_mla_attention_splits"), (mla_output, "mla_output"), (moe_experts, "expert_matmul"))
    for mod, name in kernels:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    jspec.clear_caches()
    assert jspec.generate(p if devices is None else jspec.shard(p, devices), PROMPTS[:2], **kw).tokens == want
    assert {name for _, name in kernels} <= set(calls)
    jax.clear_caches()
