"""Prompts of tens of thousands of tokens on the CPU: prefilled in blocks of
`Tuning.prefill_block` (a loop inside the program), attention through the blocked
reference, so memory stays bounded by the block, and the tokens are transformers' greedy
ones: plain, EAGLE-3 chains and trees, dense and paged caches, and the engine."""
from __future__ import annotations

import numpy as np
import pytest

import jspec
from jspec import api
import tiny_models

LONG = 32_000  # prompt tokens
pytestmark = pytest.mark.slow  # tens of thousands of tokens through the CPU: not in the fast subset
# These programs run long: compiled with LLVM's optimizations, which the suite's XLA_FLAGS
# (conftest) turn off to compile faster, a 32k-token run takes 3.5 s instead of 23 s.
OPTIMIZED = jspec.Tuning(xla_options={"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False})


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """A 2-layer random Llama with a 33k-token context, the same with an EAGLE-3 head, a
    32k-token prompt, transformers' 6 greedy tokens after it, and the transformers model."""
    path = str(tmp_path_factory.mktemp("long_llama"))
    model = tiny_models.make_model(path, "llama", layers=2, hidden=32, heads=2, kv_heads=1, inter=64,
                                   max_position_embeddings=LONG + 1024, tokenizer=True)
    target = jspec.load(path)
    draft = str(tmp_path_factory.mktemp("long_eagle3"))
    tiny_models.make_random_draft(draft, "eagle3", target, seed=1, aux_layers=(1, 1, 2))
    from jspec.loading import load_draft
    prompt = np.random.default_rng(0).integers(3, tiny_models.VOCAB, LONG).tolist()
    return target, target.with_draft(load_draft(draft, target)), prompt, tiny_models.hf_greedy(model, prompt, 6), model


def temp_bytes(compiled: jspec.Compiled) -> int:
    return compiled.executable.memory_analysis().temp_size_in_bytes


def test_a_32k_prompt_in_blocks(long_llama):
    """Plain decoding after a 32k-token prompt, paged cache: transformers' tokens, from a
    program whose scratch memory is under 256 MB (prefilled whole, the same prompt's
    program needs its [T, T] causal mask: gigabytes)."""
    target, _, prompt, want, _ = long_llama
    prog = jspec.compile(target, prompt, max_new_tokens=6, cache="paged", tuning=OPTIMIZED)
    assert prog.plan.prefill_chunk == jspec.Tuning().prefill_block == 2048
    assert prog.run().tokens == want
    assert temp_bytes(prog) < 2 ** 28
    whole = jspec.compile(target, prompt, max_new_tokens=6, cache="paged", tuning=jspec.Tuning(prefill_block=0))
    assert whole.plan.prefill_chunk == 0 and temp_bytes(whole) > 2 ** 30  # compiled, not run


@pytest.mark.parametrize("cache,spec", [("dense", jspec.SpecConfig(3)), ("paged", jspec.SpecConfig(2, topk=2,
                                                                                                  num_draft_tokens=5))])
def test_speculation_after_a_32k_prompt(long_llama, cache, spec):
    """EAGLE-3 chains and trees after a 32k-token prompt (the draft's cache prefilled in
    the same blocks): transformers' tokens."""
    _, drafted, prompt, want, _ = long_llama
    assert jspec.generate(drafted, prompt, max_new_tokens=6, cache=cache, spec=spec, tuning=OPTIMIZED).tokens == want


def test_one_program_for_every_prompt_length(long_llama):
    """With `CacheConfig(max_len=...)` the plan takes every prompt up to it (Tp rounded up
    to whole blocks), so prompts of any length run one compiled program; the loop runs only
    the blocks the longest prompt has."""
    target, _, prompt, _, model = long_llama
    cache = jspec.CacheConfig("paged", page_size=16, max_len=4096)
    prog = jspec.compile(target, prompt[:20], max_new_tokens=6, cache=cache,
                         tuning=OPTIMIZED.replace(prefill_block=256))
    assert (prog.plan.prompt_len, prog.plan.prefill_chunk) == (4096, 256)
    before = api.compiled_programs()
    for n in (3, 256, 257, 1000, 4000):
        out = prog.run(prompt[:n], max_new_tokens=6)
        assert out.tokens == tiny_models.hf_greedy(model, prompt[:n], 6), n
    assert api.compiled_programs() == before


def test_engine_serves_a_32k_prompt(long_llama):
    """The engine prefills a 32k-token prompt in blocks between chunks: transformers' tokens."""
    target, _, prompt, want, _ = long_llama
    with jspec.Engine(target, max_batch=1, max_prompt_len=LONG, max_new_tokens=6, prefill_chunk=2048,
                      tuning=OPTIMIZED) as engine:
        assert engine.generate(prompt, max_new_tokens=6).tokens == want


MID = 16_000  # prompt tokens of the DeepSeek and Qwen3.5 tests


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_5"])
def test_a_16k_prompt_on_mla_and_hybrid_targets(tmp_path, family):
    """A 16k-token prompt on a tiny DeepSeek-V2 (MLA + MoE: later blocks attend over the
    latent cache through the blocked MLA reference) and a tiny Qwen3.5 (hybrid: gated
    attention and gated-delta layers), both in blocks of 2048: transformers' greedy tokens."""
    import torch
    import transformers
    from test_deepseek import COMMON, hf_greedy_tokens
    from test_qwen3_next import SHAPE
    torch.manual_seed(0)
    if family == "deepseek_v2":
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(  # one MLA + MoE layer
            num_hidden_layers=1, q_lora_rank=None, topk_method="greedy", attn_implementation="sdpa",
            **{**COMMON, "first_k_dense_replace": 0, "max_position_embeddings": MID + 64,
               "num_attention_heads": 2}))  # (transformers' reference materialises [H, T, T]: 2 heads, not 4)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            intermediate_size=96, **{**SHAPE, "max_position_embeddings": MID + 64}))
    model.eval().save_pretrained(str(tmp_path))
    prompt = np.random.default_rng(0).integers(3, COMMON["vocab_size"], MID).tolist()
    target = jspec.load(str(tmp_path), dtype="float32")
    prog = jspec.compile(target, prompt, max_new_tokens=6, stop_token_ids=[], cache="paged", tuning=OPTIMIZED)
    assert prog.plan.prefill_chunk == 2048  # the hybrid's linear layers continue their states block to block
    assert prog.run().tokens == hf_greedy_tokens(model, prompt, 6)


@pytest.mark.parametrize("cache", ["paged"])
def test_hybrid_blocks_leave_the_states_of_a_whole_prefill(tmp_path_factory, cache):
    """Qwen3.5 prompts prefilled in blocks of 16 (each later block continuing the linear
    layers' conv and delta-rule states from where the blocks before left them): the states,
    the KV cache and the first token equal a whole-prompt prefill's (float32), and the MTP
    chain that follows gives transformers' greedy tokens."""
    import jax
    from jspec import requests as rq
    from jspec.loop import programs
    from jspec.loop.plan import make_plan
    from test_qwen3_next import make_hybrid
    from test_deepseek import hf_greedy_tokens
    path = str(tmp_path_factory.mktemp("hybrid_blocks"))
    model = make_hybrid(path, "qwen3_5")
    params = jspec.load(path, dtype="float32", draft="mtp")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, n).tolist() for n in (70, 33, 16)]
    reqs = rq.check_requests(params, prompts, 6, [], {})
    states = []
    for block in (0, 16):
        plan = make_plan(params, reqs.lens, reqs.max_new, 0, False, rq.cache_config(cache), jspec.SpecConfig(2),
                         jspec.Tuning(prefill_block=block))
        assert plan.prefill_chunk == block
        rows, adm = rq.pack(plan, reqs, rq.cache_config(cache))
        st = jax.jit(programs.start, static_argnums=0)(plan, params.weights, params.draft.weights, rows, adm)
        states.append(st)
    whole, blocks = states
    for a, b in zip(whole.tcache.conv + whole.tcache.ssm, blocks.tcache.conv + blocks.tcache.ssm):
        np.testing.assert_allclose(np.asarray(a)[:3], np.asarray(b)[:3], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(whole.root)[:3], np.asarray(blocks.root)[:3])
    out = jspec.generate(params, prompts, max_new_tokens=6, stop_token_ids=[], cache=cache,
                         spec=jspec.SpecConfig(2), tuning=jspec.Tuning(prefill_block=16))
    assert out.tokens == [hf_greedy_tokens(model, p, 6) for p in prompts]
