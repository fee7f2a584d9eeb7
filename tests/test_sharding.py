"""Tensor parallelism (`jspec.sharding`) on 2 and 4 CPU devices (conftest asks XLA for 4).

Split output must equal one device's token for token (float32, greedy), and the weights
and caches must really be split: each device holds its share, read from the safetensors
files block by block."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jspec
import tiny_models
from conftest import CACHES, PROMPTS, replicated_share, spec_of
from jspec import sharding
from jspec.kernels import dispatch
from jspec.loop import programs
from jspec.tensors import HostParam

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices "
                                "(XLA_FLAGS=--xla_force_host_platform_device_count=4, set by conftest)")

CHAIN = jspec.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
TREE = jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


@pytest.fixture(scope="module")
def split(llama_dir, drafts):
    """split(n, draft name or None) -> the 2-layer target (and draft) loaded over n devices."""
    loaded = {}

    def build(n, draft=None):
        if (n, draft) not in loaded:
            loaded[n, draft] = jspec.load(llama_dir[0], draft=drafts[draft] if draft else None, devices=n)
        return loaded[n, draft]
    return build


@pytest.fixture(scope="module")
def single(target, with_draft):
    return lambda draft=None: with_draft(draft) if draft else target


SLOW = pytest.mark.slow
CASES = [  # (devices, draft, spec, cache); the tiny standalone draft has 2 heads: 2 devices at most
    pytest.param(2, None, None, "dense", id="2-plain"),
    pytest.param(4, None, None, "paged16", id="4-plain-paged16"),
    pytest.param(2, "eagle3", TREE, "dense", id="2-eagle3-tree-dense"),
    pytest.param(4, "eagle3", CHAIN, "dense", id="4-eagle3-chain-dense", marks=SLOW),
    pytest.param(2, "standalone", TREE, "paged1", id="2-standalone-tree-paged1", marks=SLOW),
    pytest.param(4, "eagle", TREE, "paged16", id="4-eagle-tree-paged16", marks=SLOW),
    pytest.param(2, "dflash", None, "paged16", id="2-dflash-block6-paged16"),
    pytest.param(4, "dflash", TREE, "dense", id="4-dflash-tree-dense", marks=SLOW),  # KV heads repeated
]


@pytest.mark.parametrize("n,draft,spec,cache", CASES)
def test_split_output_equals_one_device(split, single, n, draft, spec, cache):
    kw = dict(max_new_tokens=[14, 9, 11], cache=CACHES[cache], spec=spec)
    want = jspec.generate(single(draft), PROMPTS, **kw)
    got = jspec.generate(split(n, draft), PROMPTS, **kw)
    assert got.tokens == want.tokens
    assert got.finish_reasons == want.finish_reasons
    if draft:  # the same drafts were accepted, round by round
        assert got.stats.accept_lengths == want.stats.accept_lengths


def test_split_on_four_devices_repeats_kv_heads(split, single):
    """4 devices, 2 KV heads: each KV head is repeated on two devices; outputs do not change."""
    p4 = split(4, "eagle3")
    assert p4.config.num_kv_heads == 4 and p4.draft.config.model.num_kv_heads == 4
    assert single().config.num_kv_heads == 2
    kw = dict(max_new_tokens=12, cache=CACHES["paged16"], spec=TREE)
    assert jspec.generate(p4, PROMPTS, **kw).tokens == jspec.generate(single("eagle3"), PROMPTS, **kw).tokens
    np.testing.assert_allclose(np.asarray(jspec.logits(p4, PROMPTS[2])), np.asarray(jspec.logits(single(), PROMPTS[2])),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_split_logits_of_other_families(tmp_path, family):
    """Biases (Qwen2), q/k norms (Qwen3), sliding windows (Mistral) split as well."""
    kw = {"sliding_window": 4} if family == "mistral" else {}
    tiny_models.make_model(str(tmp_path), family, layers=2, **kw)
    one = jspec.load(str(tmp_path))
    two = jspec.load(str(tmp_path), devices=2)
    tokens = [list(range(3, 19)), [40, 41, 42]]
    np.testing.assert_allclose(np.asarray(jspec.logits(two, tokens)), np.asarray(jspec.logits(one, tokens)),
                               rtol=1e-5, atol=1e-5)


def test_weights_and_caches_are_split(split, single):
    n = 2
    pn = split(n, "eagle3")
    layer = pn.weights["params"]["layers_0"]
    want = {("self_attn", "qkv_proj"): (None, "tp"), ("self_attn", "o_proj"): ("tp", None),
            ("mlp", "gate_up_proj"): (None, "tp"), ("mlp", "down_proj"): ("tp", None)}
    for (a, b), spec in want.items():
        w = layer[a][b]["kernel"]
        assert spec_of(w) == spec, (a, b)
        axis = spec.index("tp")
        for shard in w.addressable_shards:  # each device holds 1/n of the columns or rows
            assert shard.data.shape[axis] == w.shape[axis] // n
    assert spec_of(pn.weights["params"]["embed_tokens"]["embedding"]) == ("tp", None)
    assert spec_of(layer["input_layernorm"]["weight"]) == (None,)  # norms replicated
    dp = pn.draft.weights["params"]
    assert spec_of(dp["midlayer"]["self_attn"]["qkv_proj"]["kernel"]) == (None, "tp")
    assert spec_of(dp["lm_head"]["kernel"]) == (None, "tp")

    assert replicated_share(pn, n) < 0.1  # only norms

    # Caches: the target's and the draft's split by KV head.
    prog = jspec.compile(pn, PROMPTS, max_new_tokens=6, cache=CACHES["paged16"], spec=CHAIN)
    tw, dw = prog.weights
    st, _ = prog.program(programs.start_jit, *prog.device_inputs(prog.requests()))(tw, dw, *prog.device_inputs(prog.requests()))
    for cache in (st.tcache.kv[0], st.proposal.cache.kv[0]):
        assert spec_of(cache)[-2:] == ("tp", None)
        Hkv = cache.shape[-2]
        assert all(s.data.shape[-2] == Hkv // n for s in cache.addressable_shards)


def test_weights_are_read_block_by_block(llama_dir, monkeypatch):
    """Loading over n devices reads each split weight once, one 1/n block per device: never
    the whole tensor (no full copy in host memory or on one device)."""
    reads = []
    original = HostParam.read

    def read(self, index=()):
        out = original(self, index)
        reads.append((self.shape, out.shape))
        return out
    monkeypatch.setattr(HostParam, "read", read)
    n = 2
    pn = jspec.load(llama_dir[0], devices=n)
    leaves = jax.tree.leaves(pn.weights)
    split_shapes = {a.shape for a in leaves if any(spec_of(a))}
    split_reads = [(full, got) for full, got in reads if full in split_shapes]
    assert split_reads and all(np.prod(got) * n == np.prod(full) for full, got in split_reads)
    read_bytes = sum(np.prod(got) for full, got in split_reads)
    assert read_bytes == sum(np.prod(a.shape) for a in leaves if any(spec_of(a)))


def test_sampled_split_equals_one_device(split, single):
    kw = dict(max_new_tokens=10, spec=CHAIN, temperature=0.8, top_p=0.9, seed=[3, 4, 5])
    want = jspec.generate(single("eagle3"), PROMPTS, **kw)
    assert jspec.generate(split(2, "eagle3"), PROMPTS, **kw).tokens == want.tokens


@pytest.mark.slow
def test_stream_split(split, single):
    kw = dict(max_new_tokens=9, spec=CHAIN)
    chunks = list(jspec.stream(split(2, "eagle3"), PROMPTS[0], rounds_per_chunk=2, **kw))
    assert sum((c.tokens for c in chunks), []) == jspec.generate(single("eagle3"), PROMPTS[0], **kw).tokens


@pytest.mark.slow
def test_split_pallas_kernel_over_heads(split, single, fresh_compiles):
    """With the Pallas attention kernel (interpret mode here), each device runs it on its
    own heads under shard_map; dense (queries parked in the cache) and paged."""
    for cache in ("dense", "paged16"):
        kw = dict(max_new_tokens=6, cache=CACHES[cache], spec=CHAIN)
        want = jspec.generate(single("eagle3"), PROMPTS[:2], **kw).tokens
        with dispatch.use_backend("pallas"):
            assert jspec.generate(split(2, "eagle3"), PROMPTS[:2], **kw).tokens == want


@pytest.mark.slow
def test_shard_in_memory_params(target, with_draft):
    """jspec.shard splits weights already in memory as load(devices=) does."""
    p2 = jspec.shard(with_draft("standalone"), 2)
    assert spec_of(p2.weights["params"]["layers_0"]["mlp"]["down_proj"]["kernel"]) == ("tp", None)
    assert spec_of(p2.draft.weights["params"]["lm_head"]["kernel"]) == (None, "tp")
    kw = dict(max_new_tokens=8, spec=CHAIN)
    assert jspec.generate(p2, PROMPTS[0], **kw).tokens == jspec.generate(with_draft("standalone"), PROMPTS[0],
                                                                        **kw).tokens
    with pytest.raises(ValueError, match="split over devices already"):
        jspec.shard(p2, 2)


def test_split_errors(llama_dir, drafts):
    with pytest.raises(ValueError, match=r"\(standalone draft\): 2 attention heads cannot be split over 4"):
        jspec.load(llama_dir[0], draft=drafts["standalone"], devices=4)
    with pytest.raises(ValueError, match="4 attention heads cannot be split over 3 devices"):
        jspec.load(llama_dir[0], devices=3)
    with pytest.raises(ValueError, match="has 4 cpu device"):
        jspec.load(llama_dir[0], devices=5)
    with pytest.raises(ValueError, match="has 4 cpu device"):
        jspec.load(llama_dir[0], devices=0)
    with pytest.raises(TypeError, match="devices must be"):
        jspec.load(llama_dir[0], devices="two")
    with pytest.raises(ValueError, match="twice"):
        jspec.load(llama_dir[0], devices=[jax.devices()[0]] * 2)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",))
    with pytest.raises(ValueError, match="one axis 'tp'"):
        jspec.load(llama_dir[0], devices=mesh)
    assert sharding.make_mesh(jax.devices()[2:4]).devices.tolist() == jax.devices()[2:4]


@pytest.mark.parametrize("n", [2, 4])
def test_lookup_rows_is_the_tables_rows_per_device(n):
    """Under a mesh, an embedding lookup runs per device on its share of the vocabulary (no
    gather of the table) and returns exactly the table's rows, across the shard edges; a
    vocabulary the mesh does not divide falls back to a plain lookup."""
    mesh = sharding.make_mesh(n)
    table = jax.random.normal(jax.random.key(0), (64, 8), dtype=np.float32)
    ids = np.array([[0, 15, 16, 17, 31, 32, 47, 48, 63, 5]], np.int32)
    split_table = jax.device_put(table, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.AXIS)))
    with jax.set_mesh(mesh):
        f = jax.jit(sharding.lookup_rows)
        got = f(split_table, ids)
        hlo = f.lower(split_table, ids).compile().as_text()
        odd = sharding.lookup_rows(table[:63], ids[:, :8])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table)[ids])
    np.testing.assert_array_equal(np.asarray(odd), np.asarray(table)[ids[:, :8]])
    assert "all-gather" not in hlo and "all-reduce" in hlo


def test_constrained_split_equals_one_device(split, single):
    """Structured output over 2 devices (the constraint tables replicated): the same tokens
    as on one device, EAGLE-3 tree."""
    pytest.importorskip("outlines_core")
    kw = dict(max_new_tokens=24, stop_token_ids=[], spec=TREE,
              constraint=[jspec.Regex(r"[a-c]+d"), jspec.Choice(["one", "two"]), None])
    want = jspec.generate(single("eagle3"), PROMPTS[:3], **kw)
    assert jspec.generate(split(2, "eagle3"), PROMPTS[:3], **kw).tokens == want.tokens


def test_a_split_program_has_a_twin():
    """`programs.twin` of a program split over two of the four devices: another loaded
    copy (an engine alternates its chunk programs with theirs) on the same two devices,
    with the same outputs and donation."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[1:3])
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    f = jax.jit(lambda w, s: (s + w * s, s.sum()), donate_argnums=1)
    w = jax.device_put(np.arange(8, dtype=np.float32), spec)
    program = f.lower(w, jax.device_put(np.ones(8, np.float32), spec)).compile()
    twin = programs.twin(program)
    assert twin is not None and twin is not program
    assert twin.runtime_executable().local_devices() == program.runtime_executable().local_devices()
    outs = [p(w, jax.device_put(np.ones(8, np.float32), spec)) for p in (program, twin)]
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert float(outs[1][1]) == 8.0 and outs[1][0].sharding == spec
    donated = jax.device_put(np.ones(8, np.float32), spec)
    twin(w, donated)
    assert donated.is_deleted()
