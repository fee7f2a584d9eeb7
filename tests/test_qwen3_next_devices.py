"""Qwen3.5 / Qwen3-Next hybrid targets and their MTP layer split over 2 CPU devices
(conftest asks XLA for 4): gated attention by heads, Gated DeltaNet by key heads with their
value heads (conv and delta-rule states with them), routed experts by expert, the shared
expert and dense MLPs by columns (`models.qwen3_next_split`).

Split output must equal one device's token for token (float32; greedy and seeded
sampling; plain, MTP chain and tree, and an n-gram chain whose rounds accept several
tokens), every split weight and state must really be split, and the variants' logits
(Qwen3-Next's grouped projections and dense layers, a KV head repeated over the devices)
must equal one device's."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import PROMPTS, loader
from test_qwen3_next import make_hybrid

import jspec
from jspec.cache.layout import CacheLayout
from jspec.export import save_target
from jspec.models import family_for

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices "
                                "(XLA_FLAGS=--xla_force_host_platform_device_count=4, set by conftest)")

CHAIN = jspec.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
TREE = jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
PAGED16 = jspec.CacheConfig("paged", page_size=16)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A 3-layer Qwen3.5-MoE (linear, full, linear; 4 heads over 2 KV heads, 2 linear key
    heads over 4 value heads, 8 experts and a shared one) with its MTP layer."""
    path = str(tmp_path_factory.mktemp("q35_moe_devices"))
    make_hybrid(path, "qwen3_5_moe")
    return path


@pytest.fixture(scope="module")
def loaded(moe_dir):
    """loaded(devices or None, draft) -> params, loaded once per module (`conftest.loader`)."""
    return loader(moe_dir)


@pytest.mark.parametrize("draft,spec,cache,sampled,commit", [
    pytest.param("mtp", None, PAGED16, False, "replay", id="plain-paged16"),
    pytest.param("mtp", TREE, PAGED16, False, "checkpoint", id="mtp-tree-paged16-checkpoint"),
    pytest.param("mtp", CHAIN, jspec.CacheConfig("dense"), True, "replay", id="mtp-chain-dense-sampled"),
    pytest.param("ngram", CHAIN, PAGED16, False, "replay", id="ngram-chain-paged16"),
])
def test_split_output_equals_one_device(loaded, draft, spec, cache, sampled, commit):
    """Unequal prompts and lengths; the same tokens and, speculating, the same accepted
    drafts round by round (the n-gram chain accepts several tokens a round, so the split
    states are committed past drafts; the tree commits from per-node checkpoints)."""
    prompts = PROMPTS if draft == "mtp" else [p * 3 for p in PROMPTS]  # repeats for the n-gram drafts
    kw = dict(max_new_tokens=[14, 9, 11], stop_token_ids=[], spec=spec, cache=cache,
              tuning=jspec.Tuning(recurrent_commit=commit))
    if sampled:
        kw |= dict(temperature=0.8, top_k=20, seed=[3, 4, 5])
    want = jspec.generate(loaded(None, draft), prompts, **kw)
    got = jspec.generate(loaded(2, draft), prompts, **kw)
    assert got.tokens == want.tokens
    if spec is not None:
        assert got.stats.accept_lengths == want.stats.accept_lengths
    if draft == "ngram":
        assert max(max(a) for a in got.stats.accept_lengths if a) > 1


def test_weights_and_states_are_split(loaded):
    """Each device holds its block of every split weight, and the cache's keys and values,
    conv and delta-rule states are split by head and channel."""
    params = loaded(2)
    c = params.config
    p = params.weights["params"]
    def spec(a):  # a PartitionSpec padded to the array's rank
        return tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
    lin, full = p[f"layers_{c.linear_layers[0]}"], p[f"layers_{c.full_layers[0]}"]
    assert spec(lin["linear_attn"]["in_proj"]["kernel"]) == (None, "tp")
    assert spec(lin["linear_attn"]["conv_weight"]) == ("tp", None)
    assert spec(lin["linear_attn"]["A_log"]) == ("tp",)
    assert spec(lin["linear_attn"]["out_proj"]["kernel"]) == ("tp", None)
    assert spec(full["self_attn"]["qkv_proj"]["kernel"]) == (None, "tp")
    assert spec(full["mlp"]["experts"]["gate_up"]) == ("tp", None, None)
    assert spec(full["mlp"]["shared_expert"]["down_proj"]["kernel"]) == ("tp", None)
    assert spec(full["mlp"]["router"]["kernel"]) == (None, None)
    mtp = params.draft.weights["params"]["layers_0"]
    assert spec(mtp["self_attn"]["o_proj"]["kernel"]) == ("tp", None)
    shard = lin["linear_attn"]["in_proj"]["kernel"].addressable_shards[0].data
    assert shard.shape[1] * 2 == lin["linear_attn"]["in_proj"]["kernel"].shape[1]
    kind = family_for(c).cache_kind(c)
    with jax.set_mesh(params.mesh):
        cache = jax.jit(lambda: kind.init(CacheLayout(paged=False, capacity=16), 2))()
    assert spec(cache.conv[0])[2] == "tp" and spec(cache.ssm[0])[1] == "tp"
    assert spec(cache.kv.kv[0])[-2] == "tp"


@pytest.mark.parametrize("name,edit,quantization", [("qwen3_next", {}, None),
                                                     ("qwen3_5", {"num_key_value_heads": 1}, "fp8")],
                         ids=["next-grouped-dense", "q35-repeated-kv-head-fp8"])
def test_split_logits_of_the_variants(tmp_path, name, edit, quantization):
    """Qwen3-Next's grouped projections with a dense MLP layer among MoE ones, and a KV head
    repeated over 2 devices with the weights quantized to FP8 online: the logits of a split
    model equal one device's."""
    make_hybrid(str(tmp_path), name, **edit)
    tokens = [PROMPTS[2][:8], PROMPTS[0]]
    kw = dict(dtype="float32", quantization=quantization)
    want = np.asarray(jspec.logits(jspec.load(str(tmp_path), **kw), tokens))
    two = jspec.load(str(tmp_path), devices=2, **kw)
    if edit:
        assert two.config.num_kv_heads == 2  # one KV head, repeated
    if quantization:  # the weights were rounded to FP8: other logits than the float32 weights'
        unrounded = np.asarray(jspec.logits(jspec.load(str(tmp_path), dtype="float32"), tokens))
        assert np.abs(unrounded - want).max() > 1e-3
    np.testing.assert_allclose(np.asarray(jspec.logits(two, tokens)), want, atol=2e-5, rtol=2e-5)


def test_split_errors(moe_dir, tmp_path):
    with pytest.raises(ValueError, match="2 KV heads cannot be split over 3 devices, nor repeated"):
        jspec.load(moe_dir, devices=3)
    with pytest.raises(ValueError, match="2 linear attention key heads cannot be split over 4 devices"):
        jspec.load(moe_dir, devices=4)
    two = jspec.load(moe_dir, dtype="float32", devices=2)
    with pytest.raises(ValueError, match="split over 2 devices .* export the model loaded on one device"):
        save_target(str(tmp_path / "x"), two.config, two.weights)
