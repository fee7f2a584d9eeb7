"""Target models: logits parity with transformers, loading, shapes."""
from __future__ import annotations

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
from conftest import layer_bodies, layer_traces
from jspec.cache import kv as kvc
from jspec.cache.layout import CacheLayout, make_meta, prefill_meta
from jspec.config import ModelConfig, RopeConfig
from jspec.tuning import Tuning
from jspec.models.llama import LLAMA


def _hf_logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor(toks)).logits.float().numpy()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_logits_match_transformers(tmp_path, family, tie):
    model = tiny_models.make_model(str(tmp_path), family, tie=tie)
    params = jspec.load(str(tmp_path))
    toks = np.random.RandomState(0).randint(3, tiny_models.VOCAB, size=(2, 13))
    got = np.asarray(jspec.logits(params, toks))
    chex.assert_shape(got, (2, 13, tiny_models.VOCAB))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _hf_logits(model, toks), atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16},
                                  {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    model = tiny_models.make_model(str(tmp_path), "llama", rope_scaling=rope)
    params = jspec.load(str(tmp_path))
    assert params.config.rope.kind == rope["rope_type"]
    toks = np.random.RandomState(1).randint(3, 300, size=(1, 40))
    np.testing.assert_allclose(np.asarray(jspec.logits(params, toks)), _hf_logits(model, toks), atol=1e-4, rtol=0)


def test_sliding_window_matches_transformers(tmp_path):
    model = tiny_models.make_model(str(tmp_path), "mistral", sliding_window=5)
    params = jspec.load(str(tmp_path))
    assert params.config.sliding_windows == (5, 5)
    toks = np.random.RandomState(2).randint(3, 300, size=(1, 20))
    np.testing.assert_allclose(np.asarray(jspec.logits(params, toks)), _hf_logits(model, toks), atol=1e-4, rtol=0)


def test_ragged_logits_rows_match_unpadded(target):
    a, b = [5, 6, 7, 8, 9], [11, 12]
    both = np.asarray(jspec.logits(target, [a, b]))
    chex.assert_shape(both, (2, 5, 300))
    np.testing.assert_allclose(both[1, :2], np.asarray(jspec.logits(target, b))[0], atol=1e-5)
    with pytest.raises(TypeError, match="token ids"):
        jspec.logits(target, "text")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jspec.logits(target, [1, 999])


def test_sharded_checkpoint_and_dtypes(tmp_path):
    """Sharded loading is exact; in bfloat16/float16 jspec's logits are about as far from
    the float32 ones as transformers' own in the same dtype (rounding, not a bug)."""
    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    model = tiny_models.make_model(single, "qwen2")
    tiny_models.make_model(sharded, "qwen2", max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    toks = [[3, 4, 5, 6, 7, 8, 9, 10]]
    ref = np.asarray(jspec.logits(jspec.load(single), toks))
    np.testing.assert_array_equal(ref, np.asarray(jspec.logits(jspec.load(sharded), toks)))
    rel = lambda x: float(np.linalg.norm(x - ref) / np.linalg.norm(ref))
    for dtype in ("bfloat16", "float16"):
        p = jspec.load(single, dtype=dtype)
        assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(p.weights))
        got = np.asarray(jspec.logits(p, toks))
        hf = _hf_logits(model.to(getattr(torch, dtype)), toks)
        assert got.dtype == np.float32
        assert rel(got) <= 2 * rel(hf) + 1e-3, (dtype, rel(got), rel(hf))


def test_bf16_checkpoint_keeps_its_dtype(tmp_path):
    tiny_models.make_model(str(tmp_path), "llama", dtype=torch.bfloat16)
    p = jspec.load(str(tmp_path))
    assert p.config.dtype == "bfloat16"
    assert p.weights["params"]["embed_tokens"]["embedding"].dtype == jnp.bfloat16


LLAMA31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), dtype="bfloat16")


def test_eval_shape_llama31_8b_allocates_nothing():
    cfg = LLAMA31_8B
    shapes = jax.eval_shape(lambda k: LLAMA.init_weights(cfg, k), jax.random.key(0))
    p = shapes["params"]
    chex.assert_shape(p["embed_tokens"]["embedding"], (128256, 4096))
    chex.assert_shape(p["layers_0"]["self_attn"]["qkv_proj"]["kernel"], (4096, (32 + 2 * 8) * 128))
    chex.assert_shape(p["layers_31"]["mlp"]["gate_up_proj"]["kernel"], (4096, 2 * 14336))
    chex.assert_shape(p["layers_31"]["mlp"]["down_proj"]["kernel"], (14336, 4096))
    chex.assert_shape(p["lm_head"]["kernel"], (4096, 128256))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(p))
    assert n == cfg.num_params() == 8_030_261_248
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    cache = jax.eval_shape(lambda: LLAMA.cache_kind(cfg).init(CacheLayout(paged=False, capacity=1024), 32))
    assert len(cache.kv) == 32
    chex.assert_shape(cache.kv[0], (32, 1025, 2, 8, 128))  # + each row's trash slot; keys, values


def test_layers_are_traced_once(target):
    """A program traces and lowers the stack's layers of one definition once, called from
    each layer's place (`jspec.models.layers.call_layer`): two Llama layers, one body;
    under other kernels (`dispatch.use_backend`, read while tracing) another body."""
    from jspec.kernels import dispatch
    assert layer_traces(target) == (2, 1)
    with dispatch.use_backend("pallas"):
        forced = layer_bodies(target)
    assert len({id(b) for b in forced}) == 1 and forced[0] is not layer_bodies(target)[0]


def test_layer_weights_wait_for_the_layer_input(target):
    """In a prompt's pass a layer's weights reach its body only through an optimization
    barrier with its input (`models.layers.after_input`): nothing computed from the weights
    alone (an FP8 projection dequantized for the pass) can be scheduled before the layer
    and be held live from the program's start, every layer's at once (a GPU program's
    temporaries grew 0.42 GB a layer; docs/experiments.md, "Dequantized projections live
    from the start"). A decoding step has no barrier."""
    body = layer_bodies(target)[0].jaxpr
    n = len(jax.tree.leaves(target.weights["params"]["layers_0"]))
    weights, x = body.invars[:n], body.invars[n]
    barrier = body.eqns[0]
    assert barrier.primitive.name == "optimization_barrier"
    assert set(weights) | {x} <= set(barrier.invars)
    assert not set(weights) & {v for e in body.eqns[1:] for v in e.invars if not hasattr(v, "val")}  # Literals hold a val
    c = target.config  # a decoding step: no barrier (XLA takes weight-only work out of the loop of rounds)
    cache = kvc.init_kv_cache(c.num_layers, c.num_kv_heads, c.head_dim, jnp.float32, batch=1, max_len=16)
    meta = make_meta(CacheLayout(paged=False, capacity=16), None, positions=jnp.full((1, 1), 3),
                     prefix_len=jnp.full((1,), 3), local_mask=jnp.ones((1, 1, 1), bool), write_valid=jnp.ones((1, 1), bool))
    step = jax.make_jaxpr(lambda w, cache, meta: LLAMA.forward(c, w, jnp.ones((1, 1), jnp.int32), cache, meta))(
        target.weights, cache, meta).jaxpr
    bodies = [e.params["jaxpr"].jaxpr for e in step.eqns if e.params.get("name") == "DecoderLayer"]
    assert bodies and not any("optimization_barrier" in _count_primitives(b) for b in bodies)


def test_forward_shapes_with_cache(target):
    c = target.config
    B, T, S = 3, 5, 32
    cache = kvc.init_kv_cache(c.num_layers, c.num_kv_heads, c.head_dim, jnp.float32, batch=B, max_len=S)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    meta = make_meta(CacheLayout(paged=False, capacity=S), None, positions=pos, prefix_len=jnp.zeros(B, jnp.int32),
                     local_mask=jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0),
                     write_valid=jnp.ones((B, T), bool), prefill=True)
    hidden, aux, new = LLAMA.forward(c, target.weights, jnp.ones((B, T), jnp.int32), cache, meta, capture=(1, 2))
    chex.assert_shape(hidden, (B, T, c.hidden_size))
    assert sorted(aux) == [1, 2]
    chex.assert_trees_all_equal_shapes(cache, new)
    for part in (0, 1):  # keys and values of the T prompt slots written, nothing else
        buf = new.kv[0][:, :, part]
        assert float(jnp.abs(buf[:, :T]).sum()) > 0 and float(jnp.abs(buf[:, T:]).sum()) == 0


def native_products(fn, *args) -> bool:
    """Whether the program of fn(*args) has a product on the native CPU loops
    (`kernels.cpu.matmul`); skips the test where those are not built."""
    from jspec.kernels.cpu import matmul as cpu_matmul
    if jax.default_backend() != "cpu" or not cpu_matmul.available():
        pytest.skip("the native CPU products are not built here")
    return "jspec_matmul" in jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("name", [None, "eagle", "eagle3", "standalone"])
def test_tuning_reaches_every_product(target, with_draft, name):
    """The family's and the drafts' forward and logits pass their tuning down to every
    layer: with `cpu_matmul_max_rows=0` no product of the program runs the native CPU
    loops, with the default tuning (few float32 rows) they do."""
    p = target if name is None else with_draft(name)
    c, T = p.config, 3
    meta = prefill_meta(jnp.full((1,), T, jnp.int32), T)
    tokens = jnp.ones((1, T), jnp.int32)

    def uses(tuning):
        if name is None:
            def fn(w, tokens):
                return LLAMA.logits(c, w, LLAMA.forward(c, w, tokens, None, meta, tuning=tuning)[0], tuning=tuning)
            return native_products(fn, p.weights, tokens)
        d = p.draft.config
        hidden, aux, _ = LLAMA.forward(c, p.weights, tokens, None, meta, d.target_layers)
        feats = d.target_features(hidden, aux)

        def fn(tw, dw, tokens, feats):
            h, _ = d.forward(c, tw, dw, tokens, feats, None, meta, True, tuning=tuning)
            return d.logits(c, tw, dw, h, tuning=tuning)
        return native_products(fn, p.weights, p.draft.weights, tokens, feats)

    assert uses(Tuning())
    assert not uses(Tuning(cpu_matmul_max_rows=0))


def _count_primitives(jaxpr, counts=None):
    """Primitive name -> number of equations, nested jaxprs included."""
    counts = {} if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
        for sub in jax.core.jaxprs_in_params(eqn.params):
            _count_primitives(sub, counts)
    return counts


@pytest.mark.parametrize("B", [1, 2])
def test_decode_step_writes_each_layer_once(target, B):
    # A one-token step writes a layer's keys and values in one operation (they sit side by
    # side in one buffer): one in-place update for a single row, one scatter for several.
    c = target.config
    cache = kvc.init_kv_cache(c.num_layers, c.num_kv_heads, c.head_dim, jnp.float32, batch=B, max_len=16)
    meta = make_meta(CacheLayout(paged=False, capacity=16), None, positions=jnp.full((B, 1), 3),
                     prefix_len=jnp.full((B,), 3), local_mask=jnp.ones((B, 1, 1), bool),
                     write_valid=jnp.ones((B, 1), bool))
    fn = lambda w, cache, meta: LLAMA.forward(c, w, jnp.ones((B, 1), jnp.int32), cache, meta)
    counts = _count_primitives(jax.make_jaxpr(fn)(target.weights, cache, meta).jaxpr)
    writes = {p: counts.get(p, 0) for p in ("dynamic_update_slice", "scatter")}
    assert writes == ({"dynamic_update_slice": c.num_layers, "scatter": 0} if B == 1 else
                      {"dynamic_update_slice": 0, "scatter": c.num_layers}), counts


# ---------------------------------------------------------------------------- loading errors

def _corrupt(src, dst, fn):
    from jspec import safetensors_io
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    t = {k: np.array(v) for k, v in safetensors_io.load(os.path.join(src, "model.safetensors")).items()}
    fn(t)
    safetensors_io.save(os.path.join(dst, "model.safetensors"), t)


def test_loading_errors_name_the_problem(tmp_path, llama_dir):
    src = llama_dir[0]
    bad = str(tmp_path / "missing")
    _corrupt(src, bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        jspec.load(bad)
    bad = str(tmp_path / "extra")
    _corrupt(src, bad, lambda t: t.__setitem__("model.layers.0.surprise", np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="unexpected tensors.*surprise"):
        jspec.load(bad)
    bad = str(tmp_path / "shape")
    _corrupt(src, bad, lambda t: t.__setitem__("model.norm.weight", np.zeros(7, np.float32)))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(7,\), expected \(64,\)"):
        jspec.load(bad)
    bad = str(tmp_path / "arch")
    _corrupt(src, bad, lambda t: None)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        jspec.load(bad)
    with pytest.raises(ValueError, match="not a directory"):
        jspec.load(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        jspec.load(str(empty))
    (empty / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        jspec.load(str(empty))
    with pytest.raises(TypeError):
        jspec.load(42)
    with pytest.raises(ValueError, match="dtype"):
        jspec.load(src, dtype="int8")
