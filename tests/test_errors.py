"""Bad input as a new user meets it: broken model directories (target and drafts), a
`topk` wider than the draft's vocabulary, and a `max_new_tokens` that cannot fit in memory.
Every case is a clear ValueError naming the file, field or argument, raised before anything
compiles (no test here compiles a generation loop)."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import pytest

import jspec
from jspec import requests as rq
from jspec import safetensors_io
from jspec.config import ModelConfig
from jspec.drafts import Eagle3Draft
from jspec.params import DraftParams
from jspec.loop import plan as plan_module
from jspec.loop import programs

DRAFT_KINDS = ["eagle", "eagle3", "standalone"]


@pytest.fixture
def no_compiling(monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled despite bad input")
    monkeypatch.setattr(programs.generate_jit, "lower", no_compile)


def _copy(src: str, tmp_path, name: str = "model") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: str, drop: str):
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    del cfg[drop]
    json.dump(cfg, open(path, "w"))
    return path


def _load(which: str, d: str, target_dir: str):
    """Loads `d` as the target ('target') or as a draft of the tiny target."""
    return jspec.load(d) if which == "target" else jspec.load(target_dir, draft=d)


def _dir(which, llama_dir, drafts, tmp_path) -> str:
    return _copy(llama_dir[0] if which == "target" else drafts[which], tmp_path)


# ----------------------------------------------------------------------------- loading

@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                                   "num_attention_heads"])
def test_config_missing_field_names_file_and_field(llama_dir, tmp_path, field):
    d = _copy(llama_dir[0], tmp_path)
    path = _edit_config(d, field)
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: missing required field '{field}'$"):
        jspec.load(d)


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_draft_config_missing_field_names_file_and_field(llama_dir, drafts, tmp_path, kind):
    d = _copy(drafts[kind], tmp_path)
    path = _edit_config(d, "hidden_size")
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: missing required field 'hidden_size'$"):
        jspec.load(llama_dir[0], draft=d)


def _last_tensor(path: str) -> tuple[str, int, int]:
    """(name, bytes, file offset) of the tensor stored last in a safetensors file."""
    header = safetensors_io.read_header(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
    name = max(header, key=lambda k: header[k]["data_offsets"][1])
    begin, end = header[name]["data_offsets"]
    return name, end - begin, 8 + n + begin


@pytest.mark.parametrize("which", ["target"] + DRAFT_KINDS)
def test_cut_short_safetensors_names_file_and_tensor(llama_dir, drafts, tmp_path, which):
    d = _dir(which, llama_dir, drafts, tmp_path)
    path = os.path.join(d, "model.safetensors")
    name, nbytes, offset = _last_tensor(path)
    size = offset + nbytes // 2  # the download stopped halfway through the last tensor
    os.truncate(path, size)
    msg = (f"{path}: tensor {name!r} needs {nbytes} bytes at offset {offset} but the file has only {size} "
           f"bytes (the file is cut short)")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        _load(which, d, llama_dir[0])


@pytest.mark.parametrize("cut,msg", [
    (20, r"the header needs \d+ bytes but the file has only 20 bytes \(the file is cut short\)"),
    (3, r"not a safetensors file \(only 3 bytes: empty or cut short\)"),
    (0, r"not a safetensors file \(only 0 bytes: empty or cut short\)"),
])
def test_safetensors_header_cut_short(llama_dir, tmp_path, cut, msg):
    d = _copy(llama_dir[0], tmp_path)
    path = os.path.join(d, "model.safetensors")
    os.truncate(path, cut)
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: {msg}$"):
        jspec.load(d)


@pytest.mark.parametrize("header,msg", [
    (b"{not json", "not a safetensors file \\(its header is not valid JSON"),
    (b"[1, 2]", "not a safetensors file \\(its header is not a JSON object\\)"),
    (b'{"w": {"dtype": "F32"}}', "tensor 'w' has a malformed header entry"),
])
def test_safetensors_bad_header(llama_dir, drafts, tmp_path, header, msg):
    for which in ("target", "eagle3"):
        d = _dir(which, llama_dir, drafts, tmp_path / which)
        path = os.path.join(d, "model.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
        with pytest.raises(ValueError, match=f"^{re.escape(path)}: {msg}"):
            _load(which, d, llama_dir[0])


@pytest.mark.parametrize("which", ["target", "eagle3"])
def test_broken_directories_name_the_path(llama_dir, drafts, tmp_path, which):
    target_dir = llama_dir[0]
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"^{re.escape(repr(missing))} is not a directory$"):
        _load(which, missing, target_dir)

    d = _dir(which, llama_dir, drafts, tmp_path)  # no config.json
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ValueError, match=f"^{re.escape(repr(d))} is not a model directory: it has no config.json$"):
        _load(which, d, target_dir)

    d = _dir(which, llama_dir, drafts, tmp_path / "2")  # config.json that is not JSON
    path = os.path.join(d, "config.json")
    open(path, "w").write('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: cannot read config.json"):
        _load(which, d, target_dir)

    d = _dir(which, llama_dir, drafts, tmp_path / "3")  # no weights
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match=f"^{re.escape(repr(d))} has no \\*.safetensors weights$"):
        _load(which, d, target_dir)

    d = _dir(which, llama_dir, drafts, tmp_path / "4")  # a sharded index that is not JSON
    index = os.path.join(d, "model.safetensors.index.json")
    open(index, "w").write("weight_map:")
    with pytest.raises(ValueError, match=f"^{re.escape(index)}: not a safetensors index"):
        _load(which, d, target_dir)


# ----------------------------------------------------------------------------- generate / compile

@pytest.mark.parametrize("name,vocab", [("eagle", 300), ("standalone", 300), ("eagle3_reduced", 100)])
def test_topk_beyond_draft_vocabulary(with_draft, no_compiling, name, vocab):
    params = with_draft(name)
    assert params.draft.config.vocab_size == vocab
    spec = jspec.SpecConfig(num_steps=2, topk=vocab + 1)
    msg = f"SpecConfig.topk={vocab + 1} exceeds the draft's vocabulary of {vocab} tokens; topk must be at most {vocab}"
    for fn in (jspec.generate, jspec.compile):
        with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
            fn(params, [1, 2, 3], max_new_tokens=4, spec=spec)
    # topk == Vd is allowed (checked without compiling).
    assert rq.spec_config(params, jspec.SpecConfig(num_steps=2, topk=vocab)).topk == vocab


@pytest.mark.parametrize("name,cache", [(None, "dense"), (None, "paged"), ("eagle3", "dense"),
                                        ("standalone", "paged")])
def test_max_new_tokens_beyond_memory(target, with_draft, no_compiling, name, cache):
    """A billion new tokens need about a TiB of cache even for the tiny model: refused on
    this machine's physical memory (CPU), naming max_new_tokens, needs and haves."""
    params = target if name is None else with_draft(name)
    for fn in (jspec.generate, jspec.compile):
        with pytest.raises(ValueError) as e:
            fn(params, [[1, 2, 3], [4, 5]], max_new_tokens=10 ** 9, cache=cache)
        msg = str(e.value)
        assert msg.startswith("max_new_tokens=1000000000 does not fit in memory: the caches and token buffers (")
        assert re.search(r"need about [\d,.]+ GiB plus [\d.]+ GiB of weights, but this machine's physical memory "
                         r"has [\d,.]+ GiB; ask for a smaller max_new_tokens, or cap each request with "
                         r"CacheConfig\(max_len=\.\.\.\)", msg), msg
        assert ("num_pages" in msg) == (cache == "paged")


def test_max_new_tokens_capped_by_max_len_is_not_refused(target):
    """With a cache max_len, max_new_tokens is cut to the cache's room: nothing to refuse."""
    plan = _plan(target, [1, 2, 3], 10 ** 9, jspec.CacheConfig("dense", max_len=64), None)
    assert plan.layout.capacity <= 128


def test_device_memory_reads_gpu_bytes_limit(monkeypatch):
    class FakeGPU:
        platform, id = "gpu", 0

        def memory_stats(self):
            return {"bytes_limit": 106 * 2 ** 30, "bytes_in_use": 0}

    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGPU()])
    assert plan_module.device_memory() == (106 * 2 ** 30, "GPU device 0")


def _plan(params, prompts, max_new, cache, spec):
    """The Plan `jspec.compile` makes for these requests (nothing compiled)."""
    reqs = rq.check_requests(params, prompts, max_new, [], {})
    return plan_module.make_plan(params, reqs.lens, reqs.max_new, 0, reqs.samples, rq.cache_config(cache), spec)


LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, dtype="bfloat16")


def _params_8b(draft: bool) -> jspec.Params:
    """8B shapes with abstract weights (nothing allocated), optionally an EAGLE-3 head."""
    def w(n):
        return {"w": jax.ShapeDtypeStruct((n,), jnp.bfloat16)}
    p = jspec.Params(config=LLAMA3_8B, weights=w(LLAMA3_8B.num_params()))
    if draft:
        head = Eagle3Draft(LLAMA3_8B.replace(num_layers=1, sliding_windows=(0,)), target_hidden_size=4096,
                           aux_layers=(2, 16, 29), draft_vocab_size=32000)
        p = p.with_draft(DraftParams(head, w(300_000_000)))
    return p


@pytest.mark.parametrize("cache", ["dense", "paged"])
@pytest.mark.parametrize("spec", [None, jspec.SpecConfig(num_steps=3), jspec.SpecConfig(5, 8, 16)])
def test_8b_batch32_plans_fit_an_h200(monkeypatch, cache, spec):
    """What runs today must still pass: 8B shapes, batch 32, 1k-token prompts and a few
    thousand new tokens fit the ~106 GiB jax may use of a 141 GB H200 (its default 75%);
    a million new tokens do not."""
    monkeypatch.setattr(plan_module, "device_memory", lambda: (106 * 2 ** 30, "GPU device 0"))
    params = _params_8b(draft=spec is not None)
    prompts = [[1] * 1024] * 32
    for max_new in (1024, 4096):
        assert _plan(params, prompts, max_new, cache, spec).batch == 32
    with pytest.raises(ValueError, match="max_new_tokens=1000000 does not fit in memory.* but GPU device 0 has "
                                         "106.0 GiB"):
        _plan(params, prompts, 10 ** 6, cache, spec)


def test_plan_bytes_counts_caches_and_token_buffers():
    """Dense 8B target alone: keys and values of 32 layers x 8 heads x 128 in bf16 for every
    slot (trash included), plus the int32 token buffer."""
    params = _params_8b(draft=False)
    plan = _plan(params, [[1] * 1024] * 32, 1024, "dense", None)
    B, C = plan.batch, plan.layout.capacity
    assert plan_module.plan_bytes(plan) == 32 * 2 * 8 * 128 * 2 * B * (C + 1) + 4 * B * plan.buffer_len


def test_eagle3_default_aux_layers_fit_any_depth():
    """One rule for loading and training: inputs of layers 1..n. The defaults are SGLang's
    (2, n/2, n-3) from four layers on and stay inside 1..n below."""
    from jspec.drafts.eagle3 import check_aux_layers, default_aux_layers
    for n in range(1, 80):
        layers = default_aux_layers(n)
        assert check_aux_layers(layers, n, "") == layers and len(layers) == 3
        if n >= 4:
            assert layers == (2, n // 2, n - 3)
    assert default_aux_layers(3) == (2, 1, 1) and default_aux_layers(1) == (1, 1, 1)
    for bad in ((0, 1, 2), (1, 2, 5), ()):
        with pytest.raises(ValueError, match="each must be in 1..4 .ids 0..3.; fix it"):
            check_aux_layers(bad, 4, "fix it")


def test_prompt_longer_than_the_context_names_both_numbers(target):
    """A prompt past the model's context (max_position_embeddings, 512 for the tiny Llama)
    is refused before anything compiles, naming both numbers."""
    with pytest.raises(ValueError, match=r"prompt has 513 tokens, more than the model's context of 512 tokens"):
        jspec.compile(target, [1] * 513, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt\[1\] has 600 tokens, more than the model's context of 512"):
        jspec.generate(target, [[1, 2], [3] * 600], max_new_tokens=4)
