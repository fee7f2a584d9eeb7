"""Shared fixtures: tiny random models saved to temp dirs once per test session, the
cache configurations and draft builders the tests sweep, and compile-cache clearing.

Tests that compile a whole generation loop more than a few times, or train, are marked
`slow`; `pytest -m "not slow"` is the fast subset for day-to-day work."""
from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# XLA's CPU compiler, not running the tiny models, takes most of the suite's time: compile
# with little optimisation and the older elemental emitters (about half the compile time
# of the fusion emitters; docs/experiments.md, "The test suite's time"), without the HLO
# verifier XLA runs after every pass (a check of XLA itself: 13% of a loop's compile).
# Four CPU devices for the tensor-parallel tests (test_sharding); the rest use the first.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false --xla_disable_hlo_passes=hlo-verifier "
                      "--xla_force_host_platform_device_count=4")

# One XLA compilation cache for the run, shared by its processes (the xdist workers, which
# inherit the variable, notebook kernels, CLI and server subprocesses): a program two of
# them compile is compiled once (about 12% of a module's time on 2 cores). Made here, in
# the first process, and removed when that process ends (`pytest_unconfigure`).
_MADE_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _MADE_CACHE_DIR = tempfile.mkdtemp(prefix="jspec-tests-xla-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_MADE_CACHE_DIR, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

import gc  # noqa: E402

import jax  # noqa: E402
import tiny_models  # noqa: E402

# Full garbage collections walk every live object, and a worker's heap only grows (jax keeps
# each program's trace): about 5% of an engine test's time. The imported modules are kept
# out of the walks for good, and full collections fall a fifth as often.
gc.freeze()
gc.set_threshold(700, 10, 50)

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one PyTorch thread each (the references)
    import torch
    torch.set_num_threads(1)


def pytest_unconfigure(config):
    if _MADE_CACHE_DIR is not None:
        shutil.rmtree(_MADE_CACHE_DIR, ignore_errors=True)


PROMPTS = [[5, 7, 9, 11, 13], [20, 21, 22], list(range(30, 47))]


def _caches():
    import jspec
    return {"dense": jspec.CacheConfig("dense"), "paged1": jspec.CacheConfig("paged", page_size=1),
            "paged16": jspec.CacheConfig("paged", page_size=16)}


CACHES = _caches()  # the cache configurations tests sweep, by name

# The EAGLE-3 engine of the in-process server (test_server.py) and of the warm-up test
# (test_engine.py's test_no_compile_while_serving): one set of settings, so that the two
# share their compiled programs (in one worker, or through the XLA compilation cache).
SERVED_ENGINE = dict(max_batch=2, max_prompt_len=64, max_new_tokens=24, rounds_per_chunk=2, prefill_chunk=16,
                     constraint_states=64)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A 2-layer random Llama with a byte-level tokenizer (and its transformers twin): two
    layers, not more, because XLA compiling the loop over every layer is most of the suite's
    time (a test of the engine's programs took 49 s instead of 69 s at four)."""
    path = str(tmp_path_factory.mktemp("llama4"))
    model = tiny_models.make_model(path, "llama", layers=2, tokenizer=True)
    return path, model


@pytest.fixture(scope="session")
def target(llama_dir):
    import jspec
    return jspec.load(llama_dir[0])


@pytest.fixture(scope="session")
def hf_greedy(llama_dir):
    return functools.partial(tiny_models.hf_greedy, llama_dir[1])


@pytest.fixture(scope="session")
def drafts(tmp_path_factory, llama_dir, target):
    """Random drafts for the 2-layer Llama: EAGLE, EAGLE-3 (full and reduced vocab; features of
    layers 1, 2, 2), standalone, DFlash (blocks of 6)."""
    out = {}
    for name, kw in [("eagle", {}), ("eagle3", {}), ("eagle3_reduced", {"draft_vocab": 100}),
                     ("standalone", {}), ("dflash", {})]:
        path = str(tmp_path_factory.mktemp(name))
        tiny_models.make_random_draft(path, name.split("_")[0], target, seed=len(out) + 1, **kw)
        out[name] = path
    return out


@pytest.fixture(scope="session")
def with_draft(target, drafts):
    """with_draft(name) -> the 2-layer target with draft `name` of `drafts` loaded (cached)."""
    from jspec.loading import load_draft
    loaded = {}

    def build(name: str):
        if name not in loaded:
            loaded[name] = target.with_draft(load_draft(drafts[name], target))
        return loaded[name]
    return build


def loader(path: str):
    """get(devices or None, draft="mtp") -> the float32 params of the checkpoint at `path`,
    split over that many devices, each loaded once (a module's fixture of split tests)."""
    import jspec
    out = {}

    def get(n, draft="mtp"):
        if (n, draft) not in out:
            out[n, draft] = jspec.load(path, draft=draft, dtype="float32", devices=n)
        return out[n, draft]
    return get


@pytest.fixture
def fresh_compiles():
    """Every compiled program forgotten before and after the test (for tests that count
    traces or switch the kernel backend)."""
    import jspec
    jspec.clear_caches()
    yield
    jspec.clear_caches()


@pytest.fixture(scope="session")
def perm(tmp_path_factory):
    """A target whose greedy next token is a fixed cycle pi(t), with drafts that agree:
    an EAGLE head predicting pi(token), an EAGLE-3 head predicting pi(pi(token of the
    feature)) (right for the first draft only), and the target itself as a standalone."""
    root = tmp_path_factory.mktemp("perm")
    return tiny_models.make_permutation_family(str(root))


def layer_bodies(params) -> list:
    """The traced layer body of each layer call in the jaxpr of a prompt pass of the target
    (`jspec.models.layers.call_layer`: one body per layer definition)."""
    import jax.numpy as jnp
    from jspec.cache.layout import prefill_meta
    from jspec.models import family_for
    meta = prefill_meta(jnp.full((1,), 4, jnp.int32), 4)
    family = family_for(params.config)
    jaxpr = jax.make_jaxpr(lambda w, t: family.forward(params.config, w, t, None, meta)[0])(
        params.weights, jnp.zeros((1, 4), jnp.int32))
    return [e.params["jaxpr"] for e in jaxpr.jaxpr.eqns if e.params.get("name") == "DecoderLayer"]


def layer_traces(params) -> tuple[int, int]:
    """(layer calls, distinct traced layer bodies) of `layer_bodies`."""
    bodies = layer_bodies(params)
    return len(bodies), len({id(b) for b in bodies})


def loop_inputs(params, prompts, max_new, cache, spec=None):
    """The plan of these greedy requests and the host inputs that admit them, nothing
    compiled -> (plan, (rows, Admission))."""
    from jspec import requests as rq
    from jspec.loop.plan import make_plan
    reqs = rq.check_requests(params, prompts, max_new, [], {})
    plan = make_plan(params, reqs.lens, reqs.max_new, 0, False, cache, rq.spec_config(params, spec))
    return plan, rq.pack(plan, reqs, cache)


def loop_state(params, prompts, max_new, cache, spec=None, rounds=None, tuning=None):
    """The loop's state after `rounds` rounds (None: to the end) of these greedy requests,
    with only the loop itself compiled (under `tuning`, None: the default) -> (plan, state)."""
    import dataclasses
    plan, inputs = loop_inputs(params, prompts, max_new, cache, spec)
    if rounds is not None:
        plan = dataclasses.replace(plan, max_rounds=rounds)
    if tuning is not None:
        plan = dataclasses.replace(plan, tuning=tuning)
    weights = (params.weights, params.draft.weights if params.draft is not None else None)
    return plan, _run_loop(plan, *weights, *inputs)


@functools.partial(jax.jit, static_argnums=0)
def _run_loop(plan, tw, pw, rows, adm):
    from jspec.loop import programs
    return programs.run(plan, tw, pw, rows, adm)


def spec_of(a) -> tuple:
    """A split array's PartitionSpec as a tuple of one entry an axis."""
    return tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))


def replicated_share(params, n: int) -> float:
    """Asserts that each of the n devices holds the split weights' bytes over n plus the
    replicated ones -> the replicated weights' share of all bytes."""
    import jax
    leaves = jax.tree.leaves(params.weights)
    total = sum(a.nbytes for a in leaves)
    replicated = sum(a.nbytes for a in leaves if not any(spec_of(a)))
    for d in range(n):
        on_device = sum(s.data.nbytes for a in leaves for s in a.addressable_shards
                        if s.device == params.mesh.devices[d])
        assert on_device == replicated + (total - replicated) // n
    return replicated / total
