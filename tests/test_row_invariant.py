"""`Tuning.row_invariant` (issue 40): the setting (auto, refusals, XLA options), the loop
through the row-invariant kernels (interpret mode: greedy speculative output equals plain
output and every row kernel ran), and the CLI's line about the outputs."""
from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch
from tiny_models import make_model

import jspec
from jspec.config import CacheConfig
from jspec.tuning import Tuning
from jspec.kernels.attention import gqa
from jspec.kernels.row import matmul as row_matmul, norm as row_norm
from jspec.loop.plan import make_plan
from jspec.models import family_for
from jspec.models.deepseek_hf import DeepseekConfig


def _plan_tuning(params, tuning):
    return make_plan(params, [8], [4], 1, False, CacheConfig(), None, tuning).tuning


def test_the_setting_auto_and_refusals(monkeypatch, tmp_path):
    with pytest.raises(TypeError, match="row_invariant must be True, False or None"):
        Tuning(row_invariant=1)
    make_model(str(tmp_path), hidden=128, vocab=384)
    small = jspec.load(str(tmp_path), dtype="bfloat16")
    assert _plan_tuning(small, Tuning()).row_invariant is True  # auto: a small Llama target
    assert _plan_tuning(small, Tuning(row_invariant=False)).row_invariant is False
    llama = family_for(small.config)
    wide = small.config.replace(hidden_size=4096)  # the 8B shape: on at batch 1 only (dearer in larger batches)
    h100, h200 = (SimpleNamespace(platform="gpu", device_kind=f"NVIDIA {k} 80GB HBM3") for k in ("H100", "H200"))
    cpu = jax.devices("cpu")[0]
    assert llama.row_invariant_by_default(wide, 1, h100) and not llama.row_invariant_by_default(wide, 2, h100)
    assert llama.row_invariant_by_default(wide, 1, cpu)  # no GPU kernels: nothing to pay
    assert not llama.row_invariant_by_default(wide, 1, h200)  # measured 5.8% dearer a step there
    assert llama.row_invariant_by_default(small.config, 32, h200)  # small targets: on everywhere
    odd = jspec.Params(small.config.replace(vocab_size=300), small.weights)  # a head the row kernel does not take
    assert _plan_tuning(odd, Tuning()).row_invariant is False
    with pytest.raises(ValueError, match=r"the LM head is \[128, 300\]"):
        _plan_tuning(odd, Tuning(row_invariant=True))
    cfg = DeepseekConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                         kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                         first_k_dense_replace=1)
    deepseek = jspec.Params(cfg, family_for(cfg).init_weights(cfg, jax.random.key(0)))
    assert _plan_tuning(deepseek, Tuning()).row_invariant is False
    with pytest.raises(ValueError, match=r"qkv_a_proj is \[32, 112\]"):  # K: a multiple of the kernel's 64
        _plan_tuning(deepseek, Tuning(row_invariant=True))
    fits = jspec.Params(DEEPSEEK, family_for(DEEPSEEK).init_weights(DEEPSEEK, jax.random.key(0)))
    assert _plan_tuning(fits, Tuning(row_invariant=True)).row_invariant is True
    assert _plan_tuning(fits, Tuning()).row_invariant is True  # DeepSeek: auto up to batch 4 (docs/benchmarks.md)
    deepseek_family = family_for(DEEPSEEK)
    assert deepseek_family.row_invariant_by_default(DEEPSEEK, 4, h100)
    assert not deepseek_family.row_invariant_by_default(DEEPSEEK, 8, h100)
    assert not deepseek_family.row_invariant_by_default(DEEPSEEK, 1, h200)
    large = make_plan(fits, [8] * 5, [4] * 5, 1, False, CacheConfig(), None, Tuning()).tuning  # a batch of 8
    assert large.row_invariant is False
    sparse = DEEPSEEK.replace(index_topk=8, index_head_dim=16, index_n_heads=2, q_lora_rank=64)
    assert "sparse attention" in family_for(sparse).row_invariant_problem(sparse, Tuning())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert Tuning(row_invariant=True).compiler_options() == {"xla_allow_excess_precision": False}
    assert Tuning(row_invariant=False).compiler_options() == {}


@pytest.mark.slow
def test_greedy_speculative_output_through_the_row_kernels(monkeypatch, fresh_compiles, tmp_path):
    """bf16 target, kernels forced (interpret mode): n-gram chains and trees, dense and paged,
    and an EAGLE-3 chain give plain decoding's tokens, and the row kernels ran in the loop (a
    product, a norm and attention)."""
    make_model(str(tmp_path), hidden=128, heads=4, kv_heads=2, inter=128, vocab=384, dtype=torch.bfloat16)
    p = jspec.load(str(tmp_path), dtype="bfloat16")
    calls = set()
    for mod, name in ((row_matmul, "row_matmul"), (row_norm, "rms_norm"), (gqa, "row_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.add(_n) or _r(*a, **k))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 384, size=n).tolist() for n in (40, 23)]
    kw = dict(max_new_tokens=12, stop_token_ids=[], tuning=Tuning(row_invariant=True))
    plain = jspec.generate(p, prompts, **kw).tokens
    assert calls == {"row_matmul", "rms_norm", "row_attention"}
    ngram = p.with_draft(jspec.NgramDraft())
    assert jspec.generate(ngram, prompts, spec=jspec.SpecConfig(3), **kw).tokens == plain
    assert jspec.generate(ngram, prompts, spec=jspec.SpecConfig(3, 2, 6), cache=CacheConfig("paged", page_size=16),
                          **kw).tokens == plain
    n = p.config.num_layers  # an EAGLE-3 head: the target's layers captured while their residuals are pending
    head = jspec.Eagle3Draft(p.config.replace(num_layers=1, sliding_windows=(0,)), target_hidden_size=128,
                             aux_layers=(0, n // 2, n - 1), draft_vocab_size=384)
    eagle3 = p.with_draft(jspec.DraftParams(config=head, weights=head.init(jax.random.key(1), 384)))
    assert jspec.generate(eagle3, prompts, spec=jspec.SpecConfig(2), **kw).tokens == plain


# A DeepSeek target the row kernels take (products' K multiples of 64, 16 experts for the
# router's product), with an MTP layer
DEEPSEEK = DeepseekConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                          kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                          moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
                          first_k_dense_replace=1, num_nextn_predict_layers=1)


DEEPSEEK_PROMPTS = [[5, 17, 33, 2, 9, 71, 40, 3, 8, 60, 12], [7, 7, 21, 90, 4]]
DEEPSEEK_RUN = dict(max_new_tokens=8, stop_token_ids=[], tuning=Tuning(row_invariant=True))


def _deepseek_params(dtype):
    """`DEEPSEEK` with random weights times 8 (peaked logits) and a random MTP layer."""
    from jspec.drafts import MtpDraft
    from jspec.drafts.mtp import layer_config
    cfg = DEEPSEEK.replace(dtype=dtype)
    draft = MtpDraft(layer_config(cfg))
    scale = lambda w: jax.tree.map(lambda a: a * 8 if a.ndim >= 2 else a, w)  # noqa: E731
    return jspec.Params(cfg, scale(family_for(cfg).init_weights(cfg, jax.random.key(0)))).with_draft(
        jspec.DraftParams(draft, scale(draft.init(jax.random.key(1), cfg.vocab_size))))


@pytest.mark.slow
def test_deepseek_row_kernels_give_the_reference_paths_tokens(monkeypatch, fresh_compiles):
    """DeepSeek (MLA + MoE), float32, kernels forced (interpret mode): plain output through
    the row kernels (the deferred input norm, row MLA, the experts with one token's tiles)
    equals the reference path's, and each row kernel ran."""
    from jspec.kernels.mla import inputs as mla_inputs
    from jspec.kernels.moe import experts as moe_experts
    from jspec.kernels.row import mla as row_mla
    f32 = _deepseek_params("float32").with_draft(None)
    monkeypatch.setenv("JSPEC_KERNELS", "reference")
    want = jspec.generate(f32, DEEPSEEK_PROMPTS, **DEEPSEEK_RUN).tokens
    calls = set()
    for mod, name in ((row_matmul, "row_matmul"), (row_mla, "row_mla_splits"), (mla_inputs, "mla_inputs"),
                      (moe_experts, "expert_matmul")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.add(_n) or _r(*a, **k))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    jspec.clear_caches()
    assert jspec.generate(f32, DEEPSEEK_PROMPTS, **DEEPSEEK_RUN).tokens == want
    assert calls == {"row_matmul", "row_mla_splits", "mla_inputs", "expert_matmul"}


@pytest.mark.slow
def test_deepseek_greedy_speculative_output_through_the_row_kernels(monkeypatch, fresh_compiles):
    """DeepSeek with its MTP draft in bf16, kernels forced (interpret mode): an MTP tree over
    a paged cache gives plain decoding's tokens (chains, dense caches and the 4-token MTP
    tree: `benchmarks/bitwise.py` on the GPU)."""
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    p = _deepseek_params("bfloat16")
    plain = jspec.generate(p.with_draft(None), DEEPSEEK_PROMPTS, **DEEPSEEK_RUN).tokens
    assert jspec.generate(p, DEEPSEEK_PROMPTS, spec=jspec.SpecConfig(2, 2, 4),
                          cache=CacheConfig("paged", page_size=16), **DEEPSEEK_RUN).tokens == plain


def test_the_cli_says_where_outputs_differ_and_why():
    from jspec.__main__ import outputs_line
    assert outputs_line([1, 2, 3], [1, 2, 3], 0.0, Tuning(row_invariant=False)) == "outputs identical"
    line = outputs_line([1, 2, 3], [1, 5, 3], 0.0, Tuning(row_invariant=False))
    assert "from token 1 of 3" in line and "--row-invariant" in line
    assert "unexpected" in outputs_line([1, 2, 3], [1, 2, 4], 0.0, Tuning(row_invariant=True))
    assert "sampled" in outputs_line([1, 2], [2, 2], 0.7, Tuning(row_invariant=True))
