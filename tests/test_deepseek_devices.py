"""DeepSeek targets and their MTP drafts split over 2 and 4 CPU devices (conftest asks XLA
for 4): attention by heads, routed experts by expert (expert parallelism), shared experts
and dense MLPs by columns (`models.deepseek_split.split_deepseek`).

Split output must equal one device's token for token (float32, greedy), the accepted
drafts too; every split weight must really be split, each device reading only its block
from the safetensors files (its own experts, nothing else); the latent cache is
replicated."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import CACHES, PROMPTS, loader, replicated_share, spec_of
from test_deepseek import make_deepseek
from test_mtp import mtp_checkpoint, through_kernels

import jspec
from jspec import loading
from jspec.export import save_target
from jspec.loop import programs
from jspec.tensors import HostParam, StackedParam

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices "
                                "(XLA_FLAGS=--xla_force_host_platform_device_count=4, set by conftest)")

CHAIN = jspec.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
TREE = jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
PAGED64 = jspec.CacheConfig("paged", page_size=64)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    """A 2-layer DeepSeek-V3 (a dense layer, then MoE: 4 heads, 8 routed experts, a shared
    one, a query latent) with its MTP layer."""
    path = str(tmp_path_factory.mktemp("v3_mtp_devices"))
    mtp_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def loaded(mtp_dir):
    """loaded(devices or None, draft) -> params, loaded once per module (`conftest.loader`)."""
    return loader(mtp_dir)


SLOW = pytest.mark.slow
CASES = [  # (devices, spec, cache): plain, chain and tree; dense and paged 1, 16 and 64; 2 and 4 devices
    pytest.param(4, None, "paged16", id="4-plain-paged16"),
    pytest.param(2, CHAIN, "dense", id="2-mtp-chain-dense"),
    pytest.param(4, TREE, "paged1", id="4-mtp-tree-paged1"),
    pytest.param(2, TREE, "paged64", id="2-mtp-tree-paged64", marks=SLOW),
]


@pytest.mark.parametrize("n,spec,cache", CASES)
def test_split_output_equals_one_device(loaded, n, spec, cache):
    """Unequal prompts and lengths; the same tokens and, speculating, the same accepted
    drafts round by round."""
    kw = dict(max_new_tokens=[14, 9, 11], stop_token_ids=[], spec=spec,
              cache=PAGED64 if cache == "paged64" else CACHES[cache])
    want = jspec.generate(loaded(None), PROMPTS, **kw)
    got = jspec.generate(loaded(n), PROMPTS, **kw)
    assert got.tokens == want.tokens
    if spec is not None:
        assert got.stats.accept_lengths == want.stats.accept_lengths
        assert got.stats.mean_accept_length > 1.0  # drafts were accepted: the split MTP layer drafts well


def test_split_logits_without_a_query_latent(tmp_path):
    """Without q_lora_rank each device's q_proj columns (its heads) come with the latent's,
    repeated on every device (V2, softmax routing with group limits). Logits over 2 and 4
    devices equal one device's, and greedy tokens over 4."""
    make_deepseek(str(tmp_path), "v2-group-limited")
    one = jspec.load(str(tmp_path), dtype="float32")
    tokens = [list(range(3, 19)), [40, 41, 42]]
    want = np.asarray(jspec.logits(one, tokens))
    for n in (2, 4):
        got = np.asarray(jspec.logits(jspec.load(str(tmp_path), dtype="float32", devices=n), tokens))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    four = jspec.load(str(tmp_path), dtype="float32", devices=4)
    kw = dict(max_new_tokens=8, stop_token_ids=[], cache=CACHES["paged16"])
    assert jspec.generate(four, PROMPTS, **kw).tokens == jspec.generate(one, PROMPTS, **kw).tokens


def test_weights_split_and_caches_replicated(loaded):
    n = 2
    pn = loaded(n)
    moe, dense = pn.weights["params"]["layers_1"], pn.weights["params"]["layers_0"]
    want = {("self_attn", "q_b_proj", "kernel"): (None, "tp"), ("self_attn", "w_uk"): (None, "tp", None),
            ("self_attn", "w_uv"): ("tp", None, None), ("self_attn", "o_proj", "kernel"): ("tp", None),
            ("mlp", "experts", "gate_up"): ("tp", None, None), ("mlp", "experts", "down"): ("tp", None, None),
            ("mlp", "shared_experts", "gate_up"): (None, None, "tp"),
            ("mlp", "shared_experts", "down"): (None, "tp", None)}
    for path, spec in want.items():
        w = moe
        for k in path:
            w = w[k]
        assert spec_of(w) == spec, path
        axis = spec.index("tp")
        assert all(s.data.shape[axis] == w.shape[axis] // n for s in w.addressable_shards), path
    assert spec_of(dense["mlp"]["gate_up_proj"]["kernel"]) == (None, "tp")
    assert spec_of(dense["mlp"]["down_proj"]["kernel"]) == ("tp", None)
    assert not any(spec_of(moe["self_attn"]["qkv_a_proj"]["kernel"]))  # the latents: replicated
    assert not any(spec_of(moe["mlp"]["router"]["kernel"]))
    assert spec_of(pn.weights["params"]["lm_head"]["kernel"]) == (None, "tp")
    block = pn.draft.weights["params"]["block"]
    assert spec_of(block["mlp"]["experts"]["gate_up"]) == ("tp", None, None)
    assert pn.config.devices == n and pn.draft.config.model.devices == n

    assert replicated_share(pn, n) < 0.25

    # The latent caches (target's and MTP layer's) are whole on every device.
    prog = jspec.compile(pn, PROMPTS, max_new_tokens=6, cache=CACHES["paged16"], spec=CHAIN)
    tw, dw = prog.weights
    inputs = prog.device_inputs(prog.requests())
    st, _ = prog.program(programs.start_jit, *inputs)(tw, dw, *inputs)
    for buf in (st.tcache.latent[0], st.proposal.cache.latent[0]):
        assert all(s.data.shape == buf.shape for s in buf.addressable_shards)


def test_each_device_reads_only_its_block(mtp_dir, monkeypatch):
    """Loading over n devices reads every split weight as n blocks of 1/n, never whole, and
    each routed expert's tensors once (by the one device that holds it)."""
    n = 2
    placed, reads = [], []
    original_place = loading.place

    def place(tree, shardings=None):
        placed.extend(zip(jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, HostParam)),
                          jax.tree.leaves(shardings)))
        return original_place(tree, shardings)

    def recording(cls):
        original = cls.read

        def read(self, index=()):
            out = original(self, index)
            reads.append((id(self), out.shape))
            return out
        monkeypatch.setattr(cls, "read", read)
    monkeypatch.setattr(loading, "place", place)
    recording(HostParam)
    recording(StackedParam)
    jspec.load(mtp_dir, draft="mtp", dtype="float32", devices=n)
    split = [w for w, s in placed if isinstance(w, HostParam) and any(s.spec)]
    assert len(split) > 20
    for w in split:
        got = [shape for i, shape in reads if i == id(w)]
        assert len(got) == n and all(np.prod(g) * n == np.prod(w.shape) for g in got), w.shape
    experts = [w for w, s in placed if isinstance(w, StackedParam) and s.spec[:1] == ("tp",)]
    assert len(experts) == 4  # gate_up and down of the target's MoE layer and of the MTP layer
    for w in experts:  # every expert's tensors read once: by its own device only
        assert all(sum(i == id(m) for i, _ in reads) == 1 for m in w.members)


def test_sampled_split_equals_one_device(loaded):
    """Seeded sampling with the MTP chain: the same tokens on 4 devices as on one."""
    kw = dict(max_new_tokens=10, stop_token_ids=[], spec=CHAIN, temperature=0.8, top_k=20, seed=[3, 4, 5])
    assert jspec.generate(loaded(4), PROMPTS, **kw).tokens == jspec.generate(loaded(None), PROMPTS, **kw).tokens


def test_split_errors(mtp_dir, tmp_path):
    with pytest.raises(ValueError, match="4 attention heads cannot be split over 3 devices"):
        jspec.load(mtp_dir, devices=3)
    with pytest.raises(ValueError, match="split over 2 devices .* export the model loaded on one device"):
        two = jspec.load(mtp_dir, dtype="float32", devices=2)
        save_target(str(tmp_path / "x"), two.config, two.weights)



def test_split_through_pallas_kernels(monkeypatch, fresh_compiles):
    """Over 2 devices each device runs the MLA and expert kernels (interpret mode) on its
    block under shard_map: the reference path's tokens on one device, every kernel called
    (the shared expert's 32 columns split to 16 a device, the kernel's least)."""
    through_kernels(monkeypatch, devices=2, moe_width=32)
