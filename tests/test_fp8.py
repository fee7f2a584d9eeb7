"""FP8 checkpoints (`jspec.quantization`): tiny Qwen3 and DeepSeek-V3 models written in the
block-FP8 layout (F8_E4M3 weights with `weight_scale_inv`, as DeepSeek-V3 and Qwen3-FP8
ship) and a Llama in compressed-tensors FP8 (per-channel and per-tensor scales) load, and
their logits equal transformers' on the dequantized weights; greedy decoding and
speculation (n-gram, MTP) match it. Bad input: a missing or mis-shaped scale, FP8 tensors
without a quantization_config, unsupported methods and schemes."""
from __future__ import annotations

import itertools
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

import jspec
import tiny_models
from jspec import safetensors_io
from test_deepseek import COMMON, YARN
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

PROMPTS = [[5, 9, 2, 77, 31, 8], [100, 101, 102, 7]]
FP8_MAX = 448.0


def quantized_names(tensors: dict) -> list[str]:
    """The weights an FP8 checkpoint quantizes: 2-D projection weights (not the embedding,
    the LM head, norms or a router)."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_head", "e_score_correction_bias")
    return [n for n, a in tensors.items() if n.endswith(".weight") and a.ndim == 2 and not any(s in n for s in skip)]


def block_fp8(w: np.ndarray, bm: int, bn: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float32 -> (F8_E4M3 weight, float32 scale_inv per bm x bn block)."""
    out, inn = w.shape
    gm, gn = -(-out // bm), -(-inn // bn)
    pad = np.zeros((gm * bm, gn * bn), np.float32)
    pad[:out, :inn] = w
    blocks = pad.reshape(gm, bm, gn, bn)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / FP8_MAX  # [gm, gn]
    q = (blocks / scale[:, None, :, None]).reshape(gm * bm, gn * bn)[:out, :inn]
    return q.astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


def write_block_fp8(path: str, block=(128, 128)) -> dict:
    """Rewrites the checkpoint in `path` in the block-FP8 layout -> {name: dequantized float32
    weight} (what transformers is then given)."""
    file = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    deq = {}
    for name in quantized_names(tensors):
        q, s = block_fp8(tensors[name].astype(np.float32), *block)
        tensors[name], tensors[name + "_scale_inv"] = q, s
        full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:q.shape[0], :q.shape[1]]
        deq[name] = q.astype(np.float32) * full
    safetensors_io.save(file, tensors)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": list(block)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq


def with_weights(model, deq: dict):
    """The transformers model with the dequantized weights put in."""
    state = model.state_dict()
    with torch.no_grad():
        for name, w in deq.items():
            state[name].copy_(torch.from_numpy(w))
    return model


def logits_of(params, prompt):
    return np.asarray(jspec.logits(params, [prompt]))[0]


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


@pytest.mark.parametrize("block", [(128, 128), (16, 32)], ids=["128x128", "16x32"])
def test_block_fp8_qwen3_equals_transformers_on_dequantized(tmp_path, block):
    """A tiny Qwen3 in block FP8 (one 128 x 128 block per weight at this size, or 16 x 32
    blocks: several per weight, with partial edge blocks): jspec's logits equal
    transformers' with the dequantized weights; greedy and n-gram speculation match."""
    path = str(tmp_path)
    model = tiny_models.make_model(path, "qwen3", inter=100)
    deq = write_block_fp8(path, block)
    assert deq and all(np.abs(w).max() > 0 for w in deq.values())
    ref = with_weights(model, deq)
    params = jspec.load(path, dtype="float32")
    for p in PROMPTS:
        np.testing.assert_allclose(logits_of(params, p), hf_logits(ref, p), atol=2e-4, rtol=1e-4)
    want = [tiny_models.hf_greedy(ref, p, 12) for p in PROMPTS]
    assert jspec.generate(params, PROMPTS, max_new_tokens=12, stop_token_ids=[]).tokens == want
    ngram = params.with_draft(jspec.NgramDraft())
    assert jspec.generate(ngram, PROMPTS, max_new_tokens=12, stop_token_ids=[]).tokens == want


def dequantized_deepseek(path: str, deq: dict, cfg, dense: str):
    """transformers' DeepSeek-V3 of the block-FP8 checkpoint in `path` with its dequantized
    weights `deq`, read from a copy written to `dense` (transformers fuses the experts it
    reads)."""
    os.makedirs(dense)
    state = {k: np.array(v) for k, v in safetensors_io.load(os.path.join(path, "model.safetensors")).items()}
    safetensors_io.save(os.path.join(dense, "model.safetensors"),
                        {k: deq.get(k, v) for k, v in state.items() if not k.endswith("_scale_inv")})
    cfg.save_pretrained(dense)
    return DeepseekV3ForCausalLM.from_pretrained(dense).eval()


def save_deepseek_v3_with_mtp(path: str):
    """A tiny random DeepSeek-V3 (2 layers: the dense first one, then MoE; q_lora_rank 48)
    with a random MTP layer saved at `path` -> its transformers config."""
    from test_mtp import add_mtp_layer
    torch.manual_seed(0)
    cfg = DeepseekV3Config(num_hidden_layers=2, num_key_value_heads=4, n_group=2, topk_group=1, q_lora_rank=48,
                           rope_scaling=YARN, num_nextn_predict_layers=1, **COMMON)
    DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    add_mtp_layer(path, 2, 0, with_head=True)
    return cfg


def test_block_fp8_deepseek_v3_with_mtp(tmp_path):
    """A tiny DeepSeek-V3 (MLA, MoE experts, the dense first layer) in block FP8, with its
    MTP layer's projections in FP8 too (the router and norms stay float): its projections
    stay FP8 in device memory (attention, the dense MLP, the MTP layer's eh_proj; kv_b_proj
    and the experts' stacks are read dequantized), logits equal transformers' on the
    dequantized weights, MTP speculation gives the target's greedy tokens, and split over 2
    devices (q_b_proj and the dense MLP's gate|up columns FP8 with their scales, o_proj and
    down_proj, whose halves are not whole groups of 128 rows, dequantized) it gives the
    same tokens."""
    path = str(tmp_path)
    cfg = save_deepseek_v3_with_mtp(path)
    deq = write_block_fp8(path)
    assert any(".experts." in n for n in deq) and any("kv_a_proj" in n for n in deq)
    assert any(n.startswith("model.layers.2.") for n in deq)  # the MTP layer's
    model = dequantized_deepseek(path, deq, cfg, str(tmp_path / "dequantized"))
    params = jspec.load(path, dtype="float32", draft="mtp")
    layers = params.weights["params"]
    fp8 = [layers["layers_0"]["self_attn"][n] for n in ("qkv_a_proj", "q_b_proj", "o_proj")]
    fp8 += [layers["layers_0"]["mlp"][n] for n in ("gate_up_proj", "down_proj")]
    draft = params.draft.weights["params"]
    fp8 += [draft[k]["eh_proj"] for k in draft if "eh_proj" in draft[k]] or [draft["eh_proj"]]
    for p in fp8:
        assert p["kernel"].dtype == ml_dtypes.float8_e4m3fn and p["kernel_scale"].dtype == np.float32
    assert layers["layers_1"]["mlp"]["experts"]["gate_up"].dtype == np.float32
    plain = params.with_draft(None)
    for p in PROMPTS:
        np.testing.assert_allclose(logits_of(plain, p), hf_logits(model, p), atol=3e-4, rtol=1e-4)
    want = jspec.generate(plain, PROMPTS, max_new_tokens=10, stop_token_ids=[]).tokens
    assert want == [tiny_models.hf_greedy(model, p, 10) for p in PROMPTS]
    kw = dict(max_new_tokens=10, stop_token_ids=[], spec=jspec.SpecConfig(3, 1, 4))
    assert jspec.generate(params, PROMPTS, **kw).tokens == want
    if len(jax.devices()) >= 2:
        two = jspec.load(path, dtype="float32", draft="mtp", devices=2)
        attn, mlp = two.weights["params"]["layers_0"]["self_attn"], two.weights["params"]["layers_0"]["mlp"]
        assert attn["q_b_proj"]["kernel"].dtype == ml_dtypes.float8_e4m3fn
        assert "tp" in mlp["gate_up_proj"]["kernel_scale"].sharding.spec
        assert "kernel_scale" not in attn["o_proj"] and attn["o_proj"]["kernel"].dtype == np.float32
        np.testing.assert_allclose(logits_of(two.with_draft(None), PROMPTS[0]), logits_of(plain, PROMPTS[0]),
                                   atol=2e-5, rtol=1e-5)
        assert jspec.generate(two, PROMPTS, **kw).tokens == want


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8(tmp_path, strategy):
    """A Llama in compressed-tensors FP8 (static input scales present and dropped): logits
    equal transformers' on the dequantized weights."""
    path = str(tmp_path)
    model = tiny_models.make_model(path, "llama")
    file = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    deq = {}
    for name in quantized_names(tensors):
        w = tensors[name].astype(np.float32)
        amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max().reshape(1)
        scale = (np.maximum(amax, 1e-12) / FP8_MAX).astype(np.float32)
        q = (w / scale.reshape(-1, 1) if strategy == "channel" else w / scale).astype(ml_dtypes.float8_e4m3fn)
        tensors[name], tensors[name + "_scale"] = q, scale
        tensors[name[:-len("weight")] + "input_scale"] = np.ones(1, np.float32)
        deq[name] = q.astype(np.float32) * (scale.reshape(-1, 1) if strategy == "channel" else scale)
    safetensors_io.save(file, tensors)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
        "ignore": ["lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    ref = with_weights(model, deq)
    params = jspec.load(path, dtype="float32")
    for p in PROMPTS:
        np.testing.assert_allclose(logits_of(params, p), hf_logits(ref, p), atol=2e-4, rtol=1e-4)


def test_bad_fp8_checkpoints_get_clear_errors(tmp_path):
    path = str(tmp_path)
    tiny_models.make_model(path, "llama")
    write_block_fp8(path)
    file = os.path.join(path, "model.safetensors")
    good = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)

    def expect(tensors, config, match):
        safetensors_io.save(file, tensors)
        with open(cfg_path, "w") as f:
            json.dump(config, f)
        with pytest.raises(ValueError, match=match):
            jspec.load(path)
    expect({k: v for k, v in good.items() if k != name + "_scale_inv"}, cfg,
           f"FP8 tensor '{name}' has no scale '{name}_scale_inv'")
    expect(good | {name + "_scale_inv": np.ones((2, 2), np.float32)}, cfg,
           r"has shape \(2, 2\), expected \(1, 1\) for a weight of shape \(64, 64\) in blocks of 128 x 128")
    expect(good, {k: v for k, v in cfg.items() if k != "quantization_config"}, "is FP8 but config.json has no "
                                                                                "quantization_config")
    for method in ("awq", "gptq", "bitsandbytes"):
        expect(good, cfg | {"quantization_config": {"quant_method": method}},
               f"quantization method '{method}' is not supported")
    expect(good, cfg | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
           "weight_block_size must be two positive ints")
    expect(good, cfg | {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}}, "4-bit int")


def test_online_fp8_rounds_projections_as_a_checkpoint_would(tmp_path):
    """`jspec.load(..., quantization="fp8")` on a float Qwen3 computes what the same model
    written as a block-FP8 checkpoint computes (the same rounding: logits equal), and
    differs from the float model; embeddings, norms and the LM head are left as they are."""
    float_dir, fp8_dir = str(tmp_path / "float"), str(tmp_path / "fp8")
    tiny_models.make_model(float_dir, "qwen3", inter=100)
    tiny_models.make_model(fp8_dir, "qwen3", inter=100)
    write_block_fp8(fp8_dir)
    online = jspec.load(float_dir, dtype="float32", quantization="fp8")
    stored = jspec.load(fp8_dir, dtype="float32")
    plain = jspec.load(float_dir, dtype="float32")
    for p in PROMPTS:
        np.testing.assert_allclose(logits_of(online, p), logits_of(stored, p), atol=1e-5, rtol=1e-5)
        assert np.abs(logits_of(online, p) - logits_of(plain, p)).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(online.weights["params"]["embed_tokens"]["embedding"]),
                                  np.asarray(plain.weights["params"]["embed_tokens"]["embedding"]))
    with pytest.raises(ValueError, match="quantization must be None or 'fp8', got 'int4'"):
        jspec.load(float_dir, quantization="int4")


@pytest.mark.parametrize("block", [(128, 128), (16, 32)], ids=["kept-fp8", "dequantized"])
def test_block_fp8_split_over_devices(tmp_path, block):
    """A block-FP8 checkpoint split over two devices (tensor parallelism) gives one
    device's greedy tokens: kept FP8 with its scales split beside the kernels (128 x 128
    blocks), or dequantized before the split (16 x 32)."""
    import jax
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest asks XLA for 4 CPU devices)")
    path = str(tmp_path)
    tiny_models.make_model(path, "qwen3", hidden=256, inter=512)
    write_block_fp8(path, block)
    kw = dict(max_new_tokens=10, stop_token_ids=[])
    want = jspec.generate(jspec.load(path, dtype="float32"), PROMPTS, **kw).tokens
    assert jspec.generate(jspec.load(path, dtype="float32", devices=2), PROMPTS, **kw).tokens == want


def fp8_and_float_checkpoints(tmp_path, **kw):
    """A tiny Llama in block FP8 (128 x 128) and the same model with the dequantized weights
    as a float checkpoint -> (FP8 directory, float directory, transformers on the latter)."""
    fp8_dir, float_dir = str(tmp_path / "fp8"), str(tmp_path / "float")
    model = tiny_models.make_model(fp8_dir, "llama", **kw)
    ref = with_weights(model, write_block_fp8(fp8_dir))
    ref.save_pretrained(float_dir)
    return fp8_dir, float_dir, ref


def test_fp8_weights_stay_fp8_in_device_memory(tmp_path):
    """A block-FP8 Llama (hidden 256, MLP 384: several groups of 128 a projection) keeps
    its projections FP8 in device memory with scales per group and column, reports their
    bytes, and computes exactly what the same model with the dequantized weights in float32
    computes (logits bit for bit); greedy, n-gram and EAGLE-3 speculation give
    transformers' greedy tokens."""
    fp8_dir, float_dir, ref = fp8_and_float_checkpoints(tmp_path, hidden=256, inter=384)
    params = jspec.load(fp8_dir, dtype="float32")
    dense = jspec.load(float_dir, dtype="float32")
    layer = params.weights["params"]["layers_0"]
    for mod, (k, n) in (("self_attn", ("qkv_proj", 256)), ("mlp", ("down_proj", 384))):
        kernel, scale = layer[mod][k]["kernel"], layer[mod][k]["kernel_scale"]
        assert kernel.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32
        assert kernel.shape[0] == n and scale.shape == (n // 128, kernel.shape[1])
    assert params.weights["params"]["embed_tokens"]["embedding"].dtype == np.float32
    total, fp8 = params.weight_bytes()
    kernels = [a for a in jax.tree.leaves(params.weights) if a.dtype == ml_dtypes.float8_e4m3fn]
    assert len(kernels) == 2 * 4 and fp8 == sum(a.size for a in kernels)  # 4 projections a layer, 1 byte each
    assert total < dense.weight_bytes()[0] and dense.weight_bytes()[1] == 0
    for p in PROMPTS:
        np.testing.assert_array_equal(logits_of(params, p), logits_of(dense, p))
        np.testing.assert_allclose(logits_of(params, p), hf_logits(ref, p), atol=2e-4, rtol=1e-4)
    want = [tiny_models.hf_greedy(ref, p, 12) for p in PROMPTS]
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    assert jspec.generate(params, PROMPTS, **kw).tokens == want
    assert jspec.generate(params.with_draft(jspec.NgramDraft()), PROMPTS, **kw).tokens == want
    head = str(tmp_path / "eagle3")
    tiny_models.make_random_draft(head, "eagle3", dense, seed=3)
    eagle3 = jspec.load(fp8_dir, dtype="float32", draft=head)
    assert jspec.generate(eagle3, PROMPTS, spec=jspec.SpecConfig(3, 1, 4), **kw).tokens == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_matvec_kernel_equals_its_reference(dtype):
    """The matvec kernel reading FP8 weights (interpret mode) equals the product with the
    weight dequantized in the graph; bad scales are refused."""
    import jax.numpy as jnp
    from jspec.kernels import dispatch
    from jspec.kernels.moe import experts
    from jspec.quantization import dequantize_kernel
    rng = np.random.default_rng(0)
    w32 = rng.normal(0, 0.05, (384, 200)).astype(np.float32)
    q, s = block_fp8(w32.T, 128, 128)  # blocks of the [out, in] layout
    kernel = jnp.asarray(q.T)  # [in, out] FP8
    scale = jnp.asarray(np.repeat(s, 128, axis=0)[:200].T)  # [groups, out]
    x = jnp.asarray(rng.normal(0, 1, (1, 384)), dtype)
    got = experts.matvec(x, kernel, w_scale=scale, interpret=True)
    want = jnp.dot(x.astype(jnp.float32), dequantize_kernel(kernel, scale, jnp.float32))
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2 if dtype == "bfloat16" else 1e-5,
                               atol=2e-2 if dtype == "bfloat16" else 1e-5)
    if dtype == "float32":  # a wrong scale row is not a small error
        off = experts.matvec(x, kernel, w_scale=jnp.roll(scale, 1, axis=0), interpret=True)
        assert np.abs(np.asarray(off) - np.asarray(want)).max() > 1e-2
    with pytest.raises(ValueError, match=r"needs Din a multiple of 128 and float32 scales \[E, Din / 128, Dout\]"):
        experts.matvec(x, kernel, w_scale=scale[:2, :100], interpret=True)
    with pytest.raises(TypeError, match="w_scale goes with an FP8 weight"):
        experts.matvec(x, kernel.astype(jnp.float32), w_scale=scale, interpret=True)


def test_online_fp8_keeps_weights_fp8_and_exports_them_dequantized(tmp_path):
    """Online FP8 (`quantization="fp8"`) keeps the rounded projections FP8 on the Llama
    family, as `quantization.quantize_params` rounds them on the device;
    `jspec.export` writes them dequantized, and that checkpoint computes the same logits."""
    from jspec.export import save_target
    float_dir = str(tmp_path / "float")
    tiny_models.make_model(float_dir, "llama", hidden=128, inter=256)
    online = jspec.load(float_dir, dtype="float32", quantization="fp8")
    assert online.weight_bytes()[1] > 0
    from jspec.quantization import quantize_params  # the same rounding on the device
    on_device = quantize_params(jspec.load(float_dir, dtype="float32"))
    assert jax.tree.structure(on_device.weights) == jax.tree.structure(online.weights)
    flat = dict(jax.tree_util.tree_flatten_with_path(online.weights)[0])
    for path, got in jax.tree_util.tree_flatten_with_path(on_device.weights)[0]:
        want = flat[path]
        assert got.dtype == want.dtype and got.shape == want.shape
        if not any("o_proj" in str(k) or "down_proj" in str(k) for k in path):
            continue  # fused kernels (q|k|v, gate|up) are blocked after the fusion on the device
        fp8 = got.dtype == ml_dtypes.float8_e4m3fn
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # XLA's division on the CPU is not IEEE's (differs from numpy's in the last bit for
        # about half of all quotients): scales within an ulp, FP8 values almost all equal
        if fp8:
            assert (got != want).mean() < 1e-3
        else:
            np.testing.assert_allclose(got, want, rtol=3e-7)
    out = str(tmp_path / "exported")
    save_target(out, online.config, online.weights)
    back = jspec.load(out, dtype="float32")
    assert back.weight_bytes()[1] == 0
    for p in PROMPTS:
        np.testing.assert_array_equal(logits_of(back, p), logits_of(online, p))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_matmul_kernel_equals_its_reference(dtype):
    """`kernels.fp8.matmul` (interpret mode; rows padded to the tile and masked, more rows
    than a tile, one row on the CUDA-core kernel, a bfloat16 row past float16's range, K
    splits that divide the groups, a column count that is not a multiple of the tile: whole
    tiles, then the rest in smaller ones) equals `matmul_reference` and, within FP8's
    rounding of nothing more, the product with the weight dequantized first; a `Linear`
    with an FP8 kernel runs it under JSPEC_KERNELS=pallas, with a fused norm too; a shifted
    scale row is caught."""
    import functools

    import jax
    import jax.numpy as jnp
    from jspec.kernels import dispatch
    from jspec.kernels.fp8 import matmul as fm
    from jspec.kernels.moe.experts import rms_norm
    from jspec.models.layers import Linear
    from jspec.quantization import dequantize_kernel, quantize_kernel

    def fp8(x, kernel, scale, **kw):  # the interpreted kernel as one program, not one per operation
        return jax.jit(functools.partial(fm.fp8_matmul, interpret=True, **kw))(x, kernel, scale)
    rng = np.random.default_rng(1)
    kernel, scale = quantize_kernel(jnp.asarray(rng.normal(0, 0.05, (384, 208)), jnp.float32))  # 3 groups
    x = jnp.asarray(rng.normal(0, 1, (2, 3, 384)), dtype)
    want = fm.matmul_reference(x.reshape(6, 384), kernel, scale, jnp.float32).reshape(2, 3, 208)
    dequantized = jnp.dot(x.astype(jnp.float32), dequantize_kernel(kernel, scale, jnp.float32))
    np.testing.assert_allclose(np.asarray(want), np.asarray(dequantized), rtol=1e-4, atol=1e-4)
    tight = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
    for splits in (1, 3):
        for tiles in (fm.Fp8Tiles(), fm.Fp8Tiles(block_m=32, block_n=64)):
            got = fp8(x, kernel, scale, float32_out=True, tiles=tiles, num_splits=splits)
            assert got.shape == (2, 3, 208) and got.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tight)
    many = jnp.asarray(rng.normal(0, 1, (40, 384)), dtype)  # three 16-row tiles, the last with 8 rows masked
    np.testing.assert_allclose(
        np.asarray(fp8(many, kernel, scale, float32_out=True, tiles=fm.Fp8Tiles(block_m=16))),
        np.asarray(fm.matmul_reference(many, kernel, scale, jnp.float32)), **tight)
    one = x[:1, :1]  # one row: the CUDA-core kernel
    np.testing.assert_allclose(np.asarray(fp8(one, kernel, scale, float32_out=True)),
                               np.asarray(want[:1, :1]), **tight)
    big = many.at[3].multiply(3e5)  # a row past float16's range: divided by a power of two, multiplied back
    big_want = np.asarray(jnp.dot(big.astype(jnp.float32), dequantize_kernel(kernel, scale, jnp.float32)))
    np.testing.assert_allclose(np.asarray(fp8(big, kernel, scale, float32_out=True)),
                               big_want, rtol=tight["rtol"], atol=tight["atol"] * np.abs(big_want).max())
    assert [fm.row_tile(m, fm.Fp8Tiles()) for m in (1, 16, 17, 40, 64, 65)] == [16, 16, 32, 64, 64, 64]
    assert [fm.splits_of(g, 10, fm.Fp8Tiles(target_programs=80)) for g in (32, 112, 3)] == [8, 8, 1]
    assert fm.column_spans(16480, 128) == [(0, 16384, 128), (16384, 96, 32)]  # 208 here: 128, then 80 in tiles of 16
    assert fp8(x, kernel, scale).dtype == jnp.dtype(dtype)
    off = fp8(x, kernel, jnp.roll(scale, 1, axis=0), float32_out=True)
    assert np.abs(np.asarray(off) - np.asarray(want)).max() > 1e-2
    lin = Linear(208, dtype=dtype)
    with dispatch.use_backend("pallas"):
        y = lin.apply({"params": {"kernel": kernel, "kernel_scale": scale}}, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), **tight)
    norm = (jnp.asarray(rng.uniform(0.5, 1.5, 384), dtype), 1e-6)  # a fused RMSNorm: normed, then the kernel
    with dispatch.use_backend("pallas"):
        y = lin.apply({"params": {"kernel": kernel, "kernel_scale": scale}}, x, norm=norm)
        traced = str(jax.make_jaxpr(lambda v: lin.apply({"params": {"kernel": kernel, "kernel_scale": scale}}, v,
                                                        norm=norm))(x))
    assert "jspec_fp8_matmul" in traced  # the kernel, not the weight dequantized in the graph
    normed = rms_norm(x, *norm).reshape(6, 384)
    np.testing.assert_allclose(np.asarray(y, np.float32).reshape(6, 208),
                               np.asarray(fm.matmul_reference(normed, kernel, scale, jnp.float32)), **tight)
    assert not fm.supported(x, kernel[:, :200], scale[:, :200]) and not fm.supported(x[..., :256], kernel[:256], scale)
    with pytest.raises(ValueError, match="fp8_matmul takes x"):
        fm.fp8_matmul(x, kernel.astype(jnp.float32), scale, interpret=True)


def test_fp8_kv_cache(tmp_path):
    """`CacheConfig(dtype="float8_e4m3fn")`: keys and values stored in E4M3 (a quarter of a
    float32 cache's bytes), dense and paged; with the same cache, n-gram and EAGLE-3 chain
    and tree speculation and seeded sampling give plain decoding's tokens; values past the
    format's 448 are clipped, not NaN; unknown dtypes are refused; the row-invariant mode
    takes an FP8 cache."""
    import jax.numpy as jnp
    from jspec.cache.kv import stored
    from jspec.loop.plan import make_plan, plan_bytes
    path, head = str(tmp_path / "llama"), str(tmp_path / "eagle3")
    tiny_models.make_model(path, "llama")
    params = jspec.load(path, dtype="float32")
    tiny_models.make_random_draft(head, "eagle3", params, seed=3)
    eagle3 = jspec.load(path, dtype="float32", draft=head)
    fp8 = dict(dtype="float8_e4m3fn")
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    dense, paged = jspec.CacheConfig(**fp8), jspec.CacheConfig(kind="paged", **fp8)
    want = jspec.generate(params, PROMPTS, cache=dense, **kw).tokens
    assert jspec.generate(params.with_draft(jspec.NgramDraft()), PROMPTS, cache=dense, **kw).tokens == want
    assert jspec.generate(eagle3, PROMPTS, cache=dense, spec=jspec.SpecConfig(3, 1, 4), **kw).tokens == want
    assert jspec.generate(params, PROMPTS, cache=paged, **kw).tokens == want
    assert jspec.generate(eagle3, PROMPTS, cache=paged, spec=jspec.SpecConfig(3, 2, 6), **kw).tokens == want
    sampled = dict(kw, temperature=0.8, seed=5)
    assert (jspec.generate(eagle3, PROMPTS, cache=paged, spec=jspec.SpecConfig(3, 1, 4), **sampled).tokens ==
            jspec.generate(params, PROMPTS, cache=paged, **sampled).tokens)
    plans = [make_plan(params, [6, 4], [12, 12], 1, False, c, None) for c in (jspec.CacheConfig(), dense)]
    assert plans[1].layout.kv_dtype == "float8_e4m3fn"
    kv32 = plan_bytes(plans[0]) - plan_bytes(plans[1])  # 3/4 of the float32 cache's bytes
    c = params.config  # float32 keys and values [B, C + 1, 2, Hkv, Dh] a layer
    kv_bytes = c.num_layers * plans[0].batch * (plans[0].layout.capacity + 1) * 2 * c.num_kv_heads * c.head_dim * 4
    assert kv32 == kv_bytes * 3 // 4
    big = stored(jnp.asarray([1000.0, -1e6, 3.0, 0.1]), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(big, np.float32), [448.0, -448.0, 3.0, 0.1015625])
    with pytest.raises(ValueError, match=r"CacheConfig.dtype must be one of \(None, 'float8_e4m3fn'\)"):
        jspec.CacheConfig(dtype="int8")
    # the row-invariant kernels read an FP8 cache too (tests/test_row_attention.py): the mode is
    # refused here for this tiny model's LM head [64, 300], which the row kernel does not take, not the cache
    with pytest.raises(ValueError, match=r"row_invariant=True\): the row kernel takes weights") as refused:
        make_plan(params, [6, 4], [12, 12], 1, False, dense, None, tuning=jspec.Tuning(row_invariant=True))
    assert "FP8" not in str(refused.value)


def test_fp8_kv_cache_scales(tmp_path):
    """Per-layer FP8 KV-cache scales (`self_attn.k_scale` / `v_scale`, vLLM's names) are read
    rounded up to powers of two, and an FP8 cache holds key / k_scale and value / v_scale.
    A model rescaled by powers of two (queries / 4, keys x 4, values x 4096, the output
    projection / 4096: the same function, its values far past E4M3's 448) with scales 4
    and 4096 decodes over an FP8 cache bit for bit as the original does over its own, and
    without the scales it clips and does not; `calibrate_kv_scales` measures powers of
    two, on the rescaled model the original's times (4, 4096), decoding as the original
    calibrated bit for bit; n-gram and EAGLE-3 speculation over the
    scaled cache give its plain tokens; export writes the scales back; a scale without its
    pair, or not one positive value, is refused by name."""
    from jspec.export import save_target
    path, head = str(tmp_path / "llama"), str(tmp_path / "eagle3")
    tiny_models.make_model(path, "llama")
    fp8 = jspec.CacheConfig(dtype="float8_e4m3fn")
    kw = dict(max_new_tokens=12, stop_token_ids=[], logprobs=1)
    original = jspec.load(path, dtype="float32")
    want = jspec.generate(original, PROMPTS, cache=fp8, **kw)  # the original, scale 1
    calibrated = jspec.calibrate_kv_scales(original, PROMPTS)
    measured = np.asarray(calibrated.weights["params"]["layers_1"]["self_attn"]["kv_scale"])
    assert np.all(np.exp2(np.round(np.log2(measured))) == measured)  # powers of two
    want_calibrated = jspec.generate(calibrated, PROMPTS, cache=fp8, **kw)
    file = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    layers = sorted({k.split(".")[2] for k in tensors if k.startswith("model.layers.")})
    for i, (name, factor) in itertools.product(layers, (("q", 0.25), ("k", 4.0), ("v", 4096.0), ("o", 1 / 4096))):
        tensors[f"model.layers.{i}.self_attn.{name}_proj.weight"] *= np.float32(factor)
    safetensors_io.save(file, tensors)
    unscaled = jspec.load(path, dtype="float32")
    # calibration sees the rescaled range: scales times (4, 4096), the same decoding bit for bit
    recalibrated = jspec.calibrate_kv_scales(unscaled, PROMPTS)
    np.testing.assert_array_equal(np.asarray(recalibrated.weights["params"]["layers_1"]["self_attn"]["kv_scale"]),
                                  measured * [4, 4096])
    got = jspec.generate(recalibrated, PROMPTS, cache=fp8, **kw)
    assert got.tokens == want_calibrated.tokens
    assert [[x.logprob for x in r] for r in got.logprobs] == [[x.logprob for x in r] for r in want_calibrated.logprobs]
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(3.0, np.float32)  # read as 4
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.asarray([4000.0], np.float32)  # read as 4096
    safetensors_io.save(file, tensors)
    params = jspec.load(path, dtype="float32")
    np.testing.assert_array_equal(np.asarray(params.weights["params"]["layers_0"]["self_attn"]["kv_scale"]),
                                  [4.0, 4096.0])
    scaled = jspec.generate(params, PROMPTS, cache=fp8, **kw)
    assert scaled.tokens == want.tokens
    assert [[x.logprob for x in r] for r in scaled.logprobs] == [[x.logprob for x in r] for r in want.logprobs]
    assert jspec.generate(unscaled, PROMPTS, cache=fp8, **kw).tokens != want.tokens  # values clipped at 448
    tiny_models.make_random_draft(head, "eagle3", params, seed=3)
    eagle3 = jspec.load(path, dtype="float32", draft=head)
    plain = dict(max_new_tokens=12, stop_token_ids=[])
    paged = jspec.CacheConfig(kind="paged", page_size=4, dtype="float8_e4m3fn")
    assert jspec.generate(params.with_draft(jspec.NgramDraft()), PROMPTS, cache=fp8, **plain).tokens == want.tokens
    assert (jspec.generate(eagle3, PROMPTS, cache=paged, spec=jspec.SpecConfig(3, 2, 6), **plain).tokens ==
            jspec.generate(params, PROMPTS, cache=paged, **plain).tokens)
    out = str(tmp_path / "exported")  # export writes the scales; they load back
    save_target(out, params.config, params.weights)
    np.testing.assert_array_equal(np.asarray(jspec.load(out, dtype="float32").weights["params"]["layers_1"]
                                             ["self_attn"]["kv_scale"]), [4.0, 4096.0])
    a = "model.layers.0.self_attn."
    for drop, bad, match in ((a + "v_scale", {}, r"missing tensor 'model.layers.0.self_attn.v_scale'"),
                             (None, {a + "k_scale": np.asarray([1.0, 2.0], np.float32)},
                              r"'model.layers.0.self_attn.k_scale' has shape \(2,\)"),
                             (None, {a + "v_scale": np.asarray(-1.0, np.float32)},
                              r"'model.layers.0.self_attn.v_scale' is -1.0")):
        broken = {k: v for k, v in tensors.items() if k != drop}
        broken.update(bad)
        safetensors_io.save(file, broken)
        with pytest.raises(ValueError, match=match):
            jspec.load(path, dtype="float32")


def test_fp8_latent_cache(tmp_path):
    """`CacheConfig(dtype="float8_e4m3fn")` on a DeepSeek-V3 target: its latent rows
    stored in E4M3 (the MTP layer's too), dense and paged; with the same cache the MTP
    chain and tree give plain greedy decoding's tokens, and seeded MTP sampling plain
    sampling's; the cache's rounding moves the logits (it is not a no-op); the row-invariant
    mode is refused with it (its MLA kernel does not read FP8)."""
    from jspec.loop.plan import make_plan, plan_bytes
    path = str(tmp_path)
    save_deepseek_v3_with_mtp(path)
    params = jspec.load(path, dtype="float32", draft="mtp")
    plain = params.with_draft(None)
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    dense = jspec.CacheConfig(dtype="float8_e4m3fn")
    paged = jspec.CacheConfig(kind="paged", page_size=4, dtype="float8_e4m3fn")
    want = jspec.generate(plain, PROMPTS, cache=dense, **kw, logprobs=1)
    float_cache = jspec.generate(plain, PROMPTS, **kw, logprobs=1)
    moved = [abs(a.logprob - b.logprob) for x, y in zip(float_cache.logprobs, want.logprobs) for a, b in zip(x, y)]
    assert max(moved) > 0  # decoding reads the rounded latent rows
    assert jspec.generate(params, PROMPTS, cache=dense, spec=jspec.SpecConfig(3, 1, 4), **kw).tokens == want.tokens
    assert jspec.generate(params, PROMPTS, cache=paged, spec=jspec.SpecConfig(3, 2, 6), **kw).tokens == want.tokens
    sampled = dict(kw, temperature=0.8, seed=5)
    assert (jspec.generate(params, PROMPTS, cache=paged, spec=jspec.SpecConfig(2, 1, 3), **sampled).tokens ==
            jspec.generate(plain, PROMPTS, cache=paged, **sampled).tokens)
    with pytest.raises(ValueError, match=r"row_invariant=True\): an FP8 latent cache"):
        make_plan(params, [6, 4], [12, 12], 1, False, dense, None, tuning=jspec.Tuning(row_invariant=True))
    plans = [make_plan(params, [6, 4], [12, 12], 1, False, c, None) for c in (jspec.CacheConfig(), dense)]
    c, layout = params.config, plans[0].layout  # float32 latent rows [B, C + 1, Dc + Dr] a layer (the MTP layer's too)
    rows = plans[0].batch * (layout.capacity + 1) * (c.kv_lora_rank + c.qk_rope_head_dim)
    assert plan_bytes(plans[0]) - plan_bytes(plans[1]) == (c.num_layers + 1) * rows * 3


def test_fp8_kv_cache_scales_hybrid(tmp_path):
    """A Qwen3.5 hybrid's gated full-attention layers read their KV-cache scales too: with
    their values times 4096 (the output projection / 4096) and v_scale 4096 the model
    decodes over an FP8 cache bit for bit as the original over its own; without the scales
    the values clip."""
    from test_qwen3_next import make_hybrid
    path = str(tmp_path)
    make_hybrid(path, "qwen3_5")
    fp8 = jspec.CacheConfig(dtype="float8_e4m3fn")
    kw = dict(max_new_tokens=10, stop_token_ids=[], logprobs=1)
    want = jspec.generate(jspec.load(path, dtype="float32"), PROMPTS, cache=fp8, **kw)
    file = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    attn = sorted({k[:k.index("self_attn.") + 10] for k in tensors if k.startswith("model.layers.") and
                   ".self_attn." in k})
    assert attn  # the full-attention layers
    for a in attn:
        tensors[a + "v_proj.weight"] *= np.float32(4096)
        tensors[a + "o_proj.weight"] /= np.float32(4096)
    safetensors_io.save(file, tensors)
    assert jspec.generate(jspec.load(path, dtype="float32"), PROMPTS, cache=fp8, **kw).tokens != want.tokens
    for a in attn:
        tensors[a + "k_scale"], tensors[a + "v_scale"] = np.float32(1.0), np.float32(4096.0)
    safetensors_io.save(file, tensors)
    got = jspec.generate(jspec.load(path, dtype="float32"), PROMPTS, cache=fp8, **kw)
    assert got.tokens == want.tokens
    assert [[x.logprob for x in r] for r in got.logprobs] == [[x.logprob for x in r] for r in want.logprobs]


def test_fp8_latent_cache_scale(tmp_path):
    """An MLA layer's FP8 latent-cache scale (`self_attn.k_scale`, as vLLM applies it to the
    latent; a `v_scale` beside it dropped), rounded up to a power of two: a DeepSeek-V3
    whose latent rows are 4096 times larger (the latent norm and the roped key part times
    4096, kv_b_proj and the queries' roped part / 4096: the same function), MTP layer
    included, decodes over an FP8 cache with scale 4096 bit for bit as the original over
    its own, plainly and with the MTP chain; without the scale the rows clip;
    `calibrate_kv_scales` measures the original's scale times 4096 on it, decoding as the
    original calibrated bit for bit."""
    path = str(tmp_path)
    cfg = save_deepseek_v3_with_mtp(path)
    dense = jspec.CacheConfig(dtype="float8_e4m3fn")
    kw = dict(max_new_tokens=10, stop_token_ids=[], logprobs=1)
    original = jspec.load(path, dtype="float32")
    want = jspec.generate(original, PROMPTS, cache=dense, **kw)
    calibrated = jspec.calibrate_kv_scales(original, PROMPTS)
    measured = np.asarray(calibrated.weights["params"]["layers_1"]["self_attn"]["kv_scale"])
    assert measured.shape == (1,)
    want_calibrated = jspec.generate(calibrated, PROMPTS, cache=dense, **kw)
    H, Dn, Dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    file = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    layers = sorted({k.split(".")[2] for k in tensors if k.startswith("model.layers.")})
    big = np.float32(4096)
    for i in layers:
        a = f"model.layers.{i}.self_attn."
        tensors[a + "kv_a_layernorm.weight"] *= big
        tensors[a + "kv_a_proj_with_mqa.weight"][-Dr:] *= big  # the roped key part
        tensors[a + "kv_b_proj.weight"] /= big
        q_b = tensors[a + "q_b_proj.weight"].reshape(H, Dn + Dr, -1)
        q_b[:, Dn:] /= big  # each head's roped query part
        tensors[a + "q_b_proj.weight"] = q_b.reshape(H * (Dn + Dr), -1)
    safetensors_io.save(file, tensors)
    rescaled = jspec.load(path, dtype="float32")
    assert jspec.generate(rescaled, PROMPTS, cache=dense, **kw).tokens != want.tokens
    recalibrated = jspec.calibrate_kv_scales(rescaled, PROMPTS)  # the original's scale times 4096
    np.testing.assert_array_equal(np.asarray(recalibrated.weights["params"]["layers_1"]["self_attn"]["kv_scale"]),
                                  measured * 4096)
    got = jspec.generate(recalibrated, PROMPTS, cache=dense, **kw)
    assert got.tokens == want_calibrated.tokens
    assert [[x.logprob for x in r] for r in got.logprobs] == [[x.logprob for x in r] for r in want_calibrated.logprobs]
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(3000.0, np.float32)  # read as 4096
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.asarray(1.0, np.float32)  # dropped
    safetensors_io.save(file, tensors)
    params = jspec.load(path, dtype="float32", draft="mtp")
    np.testing.assert_array_equal(np.asarray(params.weights["params"]["layers_0"]["self_attn"]["kv_scale"]), [4096])
    got = jspec.generate(params.with_draft(None), PROMPTS, cache=dense, **kw)
    assert got.tokens == want.tokens
    assert [[x.logprob for x in r] for r in got.logprobs] == [[x.logprob for x in r] for r in want.logprobs]
    paged = jspec.CacheConfig(kind="paged", page_size=4, dtype="float8_e4m3fn")
    assert jspec.generate(params, PROMPTS, cache=paged, spec=jspec.SpecConfig(3, 1, 4), max_new_tokens=10,
                          stop_token_ids=[]).tokens == want.tokens


def test_block_fp8_hybrid_keeps_fp8_and_splits(tmp_path):
    """A block-FP8 Qwen3.5-MoE with its MTP layer (hidden and expert widths 128: one group
    of 128 a row) keeps its projections FP8 in device memory (attention, Gated DeltaNet,
    shared expert, the MTP layer's fc) and its routed experts' stacks with their scales,
    its logits equal transformers' on the dequantized weights, the MTP chain gives its
    greedy tokens, and split over 2 devices (column-split kernels FP8 with their scales,
    row-split ones whose halves are not whole groups dequantized, the experts and their
    scales by expert) it gives the same tokens."""
    from test_qwen3_next import hf_greedy_tokens, make_hybrid
    path = str(tmp_path)
    model = make_hybrid(path, "qwen3_5_moe", hidden_size=128, moe_intermediate_size=128)
    deq = write_block_fp8(path)
    ref = with_weights(model, fused_experts(deq, model.state_dict()))
    params = jspec.load(path, draft="mtp", dtype="float32")
    layers = params.weights["params"]
    c = params.config
    lin, full = layers[f"layers_{c.linear_layers[0]}"], layers[f"layers_{c.full_layers[0]}"]
    for p in (lin["linear_attn"]["in_proj"], full["self_attn"]["qkv_proj"], full["mlp"]["shared_expert"]["down_proj"],
              params.draft.weights["params"]["fc"]):
        assert p["kernel"].dtype == ml_dtypes.float8_e4m3fn and p["kernel_scale"].dtype == np.float32
    experts = full["mlp"]["experts"]
    assert experts["gate_up"].dtype == experts["down"].dtype == ml_dtypes.float8_e4m3fn
    assert experts["gate_up_scale"].dtype == experts["down_scale"].dtype == np.float32
    for p in PROMPTS:
        np.testing.assert_allclose(logits_of(params, p), hf_logits(ref, p), atol=2e-4, rtol=1e-4)
    want = [hf_greedy_tokens(ref, p, 10) for p in PROMPTS]
    kw = dict(max_new_tokens=10, stop_token_ids=[], spec=jspec.SpecConfig(3, 1, 4))
    assert jspec.generate(params, PROMPTS, **kw).tokens == want
    if len(jax.devices()) >= 2:
        two = jspec.load(path, draft="mtp", dtype="float32", devices=2)
        in_proj = two.weights["params"][f"layers_{c.linear_layers[0]}"]["linear_attn"]["in_proj"]
        assert in_proj["kernel"].dtype == ml_dtypes.float8_e4m3fn and "tp" in in_proj["kernel_scale"].sharding.spec
        split = two.weights["params"][f"layers_{c.full_layers[0]}"]["mlp"]["experts"]
        assert split["gate_up"].dtype == ml_dtypes.float8_e4m3fn and "tp" in split["gate_up_scale"].sharding.spec
        assert jspec.generate(two, PROMPTS, **kw).tokens == want


def fused_experts(deq: dict, state: dict) -> dict:
    """The dequantized weights of a checkpoint saved with one tensor per expert, as the
    names of a transformers model that keeps them fused (`experts.gate_up_proj` [E, 2Fm, D],
    `experts.down_proj` [E, D, Fm])."""
    out = {k: v for k, v in deq.items() if k in state}
    for name, w in state.items():
        pre = name.rsplit(".", 1)[0] + "."
        if name.endswith("mlp.experts.gate_up_proj"):
            out[name] = np.stack([np.concatenate([deq[f"{pre}{e}.gate_proj.weight"], deq[f"{pre}{e}.up_proj.weight"]])
                                  for e in range(w.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            out[name] = np.stack([deq[f"{pre}{e}.down_proj.weight"] for e in range(w.shape[0])])
    return out


def fuse_fp8_experts(path: str) -> None:
    """Rewrites a block-FP8 checkpoint's per-expert tensors (the target's, not the MTP
    layer's) as transformers' fused ones: `experts.gate_up_proj` [E, 2Fm, D] and
    `experts.down_proj` [E, D, Fm], each with its block scales per expert [E, ...]."""
    file = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    for name in [n for n in tensors if n.endswith("experts.0.gate_proj.weight") and not n.startswith("mtp.")]:
        pre = name[:-len("0.gate_proj.weight")]
        E = sum(1 for n in tensors if n.startswith(pre) and n.endswith(".down_proj.weight"))
        take = lambda e, part, suffix="": tensors.pop(f"{pre}{e}.{part}_proj.weight{suffix}")
        for fused, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            for suffix in ("", "_scale_inv"):
                tensors[pre + fused + suffix] = np.stack([np.concatenate([take(e, p, suffix) for p in parts])
                                                          for e in range(E)])
    safetensors_io.save(file, tensors)


def test_block_fp8_experts_fused_on_disk_stay_fp8(tmp_path):
    """A block-FP8 Qwen3.5-MoE whose routed experts are fused into one tensor each on disk
    (transformers' `experts.gate_up_proj` [E, 2Fm, D] and `experts.down_proj` [E, D, Fm],
    block scales per expert [E, ...]) loads with those stacks FP8 and their group scales,
    the same bytes and scales as the one-tensor-an-expert checkpoint gives, and gives
    transformers' logits on the dequantized weights; a fused scale of the wrong shape is
    refused by name."""
    import shutil
    from test_qwen3_next import make_hybrid
    path = str(tmp_path / "fused")
    model = make_hybrid(path, "qwen3_5_moe", hidden_size=128, moe_intermediate_size=128)
    deq = write_block_fp8(path)
    ref = with_weights(model, fused_experts(deq, model.state_dict()))
    shutil.copytree(path, str(tmp_path / "per_expert"))
    fuse_fp8_experts(path)
    params = jspec.load(path, dtype="float32")
    c = params.config
    full = params.weights["params"][f"layers_{c.full_layers[0]}"]
    assert full["self_attn"]["qkv_proj"]["kernel"].dtype == ml_dtypes.float8_e4m3fn
    experts = full["mlp"]["experts"]
    assert experts["gate_up"].dtype == experts["down"].dtype == ml_dtypes.float8_e4m3fn
    per_expert = jspec.load(str(tmp_path / "per_expert"), dtype="float32")
    want = per_expert.weights["params"][f"layers_{c.full_layers[0]}"]["mlp"]["experts"]
    assert sorted(experts) == sorted(want) == ["down", "down_scale", "gate_up", "gate_up_scale"]
    for name in want:
        np.testing.assert_array_equal(np.asarray(experts[name], np.float32), np.asarray(want[name], np.float32), name)
    for p in PROMPTS:
        np.testing.assert_allclose(logits_of(params, p), hf_logits(ref, p), atol=2e-4, rtol=1e-4)
    file = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    bad = next(n for n in tensors if n.endswith("experts.down_proj_scale_inv"))
    tensors[bad] = tensors[bad][:1]  # one expert's scales for E experts
    safetensors_io.save(file, tensors)
    with pytest.raises(ValueError, match=bad):
        jspec.load(path, dtype="float32")


def test_quantize_params_of_a_hybrid_keeps_the_router(tmp_path):
    """`quantize_params` on a Qwen3.5-MoE in memory: its projections FP8 with their scales,
    the router, norms, embedding and the experts' stacks as they were."""
    from jspec.quantization import quantize_params
    from test_qwen3_next import make_hybrid
    make_hybrid(str(tmp_path), "qwen3_5_moe")
    params = jspec.load(str(tmp_path), dtype="float32")
    q = quantize_params(params)
    full = q.weights["params"][f"layers_{params.config.full_layers[0]}"]
    assert full["self_attn"]["qkv_proj"]["kernel"].dtype == ml_dtypes.float8_e4m3fn
    assert full["mlp"]["router"]["kernel"].dtype == np.float32 and "kernel_scale" not in full["mlp"]["router"]
    assert full["mlp"]["experts"]["gate_up"].dtype == np.float32
    got, want = logits_of(q, PROMPTS[0]), logits_of(params, PROMPTS[0])
    assert np.isfinite(got).all() and 0 < np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_block_fp8_deepseek_keeps_its_experts_fp8(tmp_path):
    """A tiny block-FP8 DeepSeek-V3 whose hidden and expert widths are whole groups of 128:
    its routed and shared experts stay FP8 in device memory with their group scales, so
    FP8 is most of its weight bytes; its logits equal transformers' on the dequantized
    weights and greedy decoding gives transformers' tokens; exported, the experts come back
    dequantized and the export computes the same logits; split over 2 devices (the routed
    experts and their scales by expert; the shared expert's 64 columns a device, not whole
    groups, dequantized) the logits are the same. `quantize_params` rounds a float model's
    experts to the same bytes and scales."""
    import shutil

    from jspec.export import save_target
    from jspec.quantization import quantize_params
    path = str(tmp_path / "fp8")
    torch.manual_seed(0)
    cfg = DeepseekV3Config(num_hidden_layers=2, num_key_value_heads=4, n_group=2, topk_group=1, q_lora_rank=48,
                           rope_scaling=YARN, **(COMMON | dict(hidden_size=128, moe_intermediate_size=128,
                                                                intermediate_size=256)))
    DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    shutil.copytree(path, str(tmp_path / "float"))
    deq = write_block_fp8(path)
    model = dequantized_deepseek(path, deq, cfg, str(tmp_path / "dequantized"))
    params = jspec.load(path, dtype="float32")
    mlp = params.weights["params"]["layers_1"]["mlp"]
    rounded = quantize_params(jspec.load(str(tmp_path / "float"), dtype="float32"))  # the same rounding on the device
    for stack in ("experts", "shared_experts"):
        for name, a in rounded.weights["params"]["layers_1"]["mlp"][stack].items():  # scales to an ulp (XLA's division)
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(mlp[stack][name], np.float32),
                                       rtol=1e-6, atol=0, err_msg=f"{stack} {name}")
    experts, shared = mlp["experts"], mlp["shared_experts"]
    assert experts["gate_up"].dtype == experts["down"].dtype == ml_dtypes.float8_e4m3fn
    assert experts["gate_up_scale"].shape == (8, 1, 256) and experts["down_scale"].shape == (8, 1, 128)
    assert shared["gate_up"].dtype == shared["down"].dtype == ml_dtypes.float8_e4m3fn
    assert shared["gate_up_scale"].shape == (1, 1, 256) and shared["down_scale"].shape == (1, 1, 128)
    total, in_fp8 = params.weight_bytes()
    assert in_fp8 > total / 3
    for p in PROMPTS:
        np.testing.assert_allclose(logits_of(params, p), hf_logits(model, p), atol=3e-4, rtol=1e-4)
    want = jspec.generate(params, PROMPTS, max_new_tokens=8, stop_token_ids=[]).tokens
    assert want == [tiny_models.hf_greedy(model, p, 8) for p in PROMPTS]
    out = str(tmp_path / "exported")
    save_target(out, params.config, params.weights)
    exported = jspec.load(out, dtype="float32")
    assert exported.weights["params"]["layers_1"]["mlp"]["experts"]["gate_up"].dtype == np.float32
    np.testing.assert_allclose(logits_of(exported, PROMPTS[0]), logits_of(params, PROMPTS[0]), atol=1e-5, rtol=1e-5)
    if len(jax.devices()) >= 2:
        two = jspec.load(path, dtype="float32", devices=2)
        split = two.weights["params"]["layers_1"]["mlp"]["experts"]
        assert split["gate_up"].dtype == ml_dtypes.float8_e4m3fn and "tp" in split["down_scale"].sharding.spec
        split_shared = two.weights["params"]["layers_1"]["mlp"]["shared_experts"]
        assert split_shared["down"].dtype == np.float32 and "down_scale" not in split_shared
        np.testing.assert_allclose(logits_of(two, PROMPTS[0]), logits_of(params, PROMPTS[0]), atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_block_fp8_deepseek_shared_experts_split_fp8(tmp_path):
    """A tiny block-FP8 DeepSeek-V3 whose shared expert is 256 wide: split over 2 devices,
    each holds 128 of its columns, whole groups, so it stays FP8 with its scales split
    the same way (gate|up's columns reordered by device with the weights'), and the
    logits equal one device's."""
    path = str(tmp_path / "fp8")
    torch.manual_seed(1)
    cfg = DeepseekV3Config(num_hidden_layers=2, num_key_value_heads=4, n_group=2, topk_group=1, q_lora_rank=48,
                           rope_scaling=YARN, **(COMMON | dict(hidden_size=128, moe_intermediate_size=256,
                                                                intermediate_size=256, n_routed_experts=4)))
    DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    write_block_fp8(path)
    one = jspec.load(path, dtype="float32")
    two = jspec.load(path, dtype="float32", devices=2)
    shared = two.weights["params"]["layers_1"]["mlp"]["shared_experts"]
    assert shared["gate_up"].dtype == shared["down"].dtype == ml_dtypes.float8_e4m3fn
    assert shared["gate_up_scale"].shape == (1, 1, 512) and shared["down_scale"].shape == (1, 2, 128)
    assert "tp" in shared["gate_up_scale"].sharding.spec and "tp" in shared["down_scale"].sharding.spec
    for p in PROMPTS[:2]:
        np.testing.assert_allclose(logits_of(two, p), logits_of(one, p), atol=2e-5, rtol=1e-5)


def test_fp8_expert_kernel_reads_fp8_experts_beside_shared_ones():
    """The expert kernel (interpret mode) over FP8 routed experts with their group scales
    and float32 shared (extra) experts read unscaled, or FP8 shared experts with scales of
    their own, both products, equals the reference on the dequantized stacks; a wrong
    scale is not a small error."""
    import jax.numpy as jnp
    from jspec.kernels.moe import experts
    from jspec.quantization import dequantize_kernel
    rng = np.random.default_rng(1)
    E, D, Fm = 4, 128, 128

    def fp8_stack(shape):  # [E, K, N] float32 -> (FP8 stack, scales [E, K / 128, N]) in 128 x 128 blocks
        qs, ss = zip(*(block_fp8(rng.normal(0, 0.05, shape[1:]).astype(np.float32).T, 128, 128) for _ in range(shape[0])))
        return (jnp.asarray(np.stack([q.T for q in qs])),
                jnp.asarray(np.stack([np.repeat(s, 128, axis=0)[:shape[2]].T for s in ss])))
    (gu, gu_s), (down, down_s) = fp8_stack((E, D, 2 * Fm)), fp8_stack((E, Fm, D))
    extra = (jnp.asarray(rng.normal(0, 0.05, (1, D, 2 * Fm)), jnp.float32),
             jnp.asarray(rng.normal(0, 0.05, (1, Fm, D)), jnp.float32))
    x = jnp.asarray(rng.normal(0, 1, (3, D)), jnp.float32)
    ids = jnp.asarray([[0, 3, 4], [2, -1, 4], [1, 0, 4]], jnp.int32)  # two routed, then the shared one (id E)
    got = experts.routed_experts(x, ids, gu, down, extra, scales=(gu_s, down_s), interpret=True)
    want = experts.routed_experts_reference(x, ids, dequantize_kernel(gu, gu_s, jnp.float32),
                                            dequantize_kernel(down, down_s, jnp.float32), extra)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    off = experts.routed_experts(x, ids, gu, down, extra, scales=(jnp.roll(gu_s, 1, axis=0), down_s), interpret=True)
    assert np.abs(np.asarray(off) - np.asarray(want)).max() > 1e-3
    with pytest.raises(TypeError, match="extra experts beside FP8 ones are float32, bfloat16 or float16, or FP8"):
        experts.routed_experts(x, ids, gu, down, tuple(e.astype(gu.dtype) for e in extra), scales=(gu_s, down_s),
                               interpret=True)
    # FP8 shared experts with their own scales (DeepSeek's, kept FP8): read as FP8 too
    (egu, egu_s), (edown, edown_s) = fp8_stack((1, D, 2 * Fm)), fp8_stack((1, Fm, D))
    got = experts.routed_experts(x, ids, gu, down, (egu, edown), scales=(gu_s, down_s),
                                 extra_scales=(egu_s, edown_s), interpret=True)
    want = experts.routed_experts_reference(
        x, ids, dequantize_kernel(gu, gu_s, jnp.float32), dequantize_kernel(down, down_s, jnp.float32),
        (dequantize_kernel(egu, egu_s, jnp.float32), dequantize_kernel(edown, edown_s, jnp.float32)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    off = experts.routed_experts(x, ids, gu, down, (egu, edown), scales=(gu_s, down_s),
                                 extra_scales=(egu_s, edown_s * 2), interpret=True)
    assert np.abs(np.asarray(off) - np.asarray(want)).max() > 1e-3
    with pytest.raises(ValueError, match="scales"):  # an extra scale of the wrong shape is named
        experts.routed_experts(x, ids, gu, down, (egu, edown), scales=(gu_s, down_s),
                               extra_scales=(egu_s[:, :, :8], edown_s), interpret=True)


@pytest.mark.parametrize("width", [128, 96])
def test_fp8_dense_mlp_reads_its_fp8_projections_in_the_expert_kernel(width):
    """DeepSeek's dense MLP at one row runs as one wide expert of the expert kernel; with
    FP8 projections the kernel reads gate|up as FP8 with its scales (and down too where its
    rows are whole groups of 128: width 128; width 96 keeps down dequantized), nothing is
    dequantized for it in the graph, and the output equals the MLP on the dequantized
    weights (interpret mode)."""
    import jax.numpy as jnp
    from jspec.kernels import dispatch
    from jspec.models.deepseek import MLP
    from jspec.quantization import dequantize_kernel, quantize_kernel
    rng = np.random.default_rng(3)
    D = 128
    dense = {"gate_up_proj": {"kernel": jnp.asarray(rng.normal(0, 0.05, (D, 2 * width)), jnp.float32)},
             "down_proj": {"kernel": jnp.asarray(rng.normal(0, 0.05, (width, D)), jnp.float32)}}
    fp8 = {}
    for name, p in dense.items():
        q, scale = quantize_kernel(p["kernel"])
        fp8[name] = {"kernel": q, "kernel_scale": scale}
        dense[name] = {"kernel": dequantize_kernel(q, scale, jnp.float32)}
    x = jnp.asarray(rng.normal(0, 1, (1, 1, D)), jnp.float32)
    norm = (jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32), 1e-6)
    mlp = MLP(width, "float32")
    with dispatch.use_backend("pallas"):
        got = mlp.apply({"params": fp8}, x, norm)
        want = mlp.apply({"params": dense}, x, norm)
        traced = jax.make_jaxpr(lambda v: mlp.apply({"params": fp8}, v, norm))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    widened = [e for e in traced.jaxpr.eqns if e.primitive.name == "convert_element_type"
               and e.invars[0].aval.dtype == ml_dtypes.float8_e4m3fn]
    assert len(widened) == (0 if width % 128 == 0 else 1)  # only a down projection of partial groups
    assert "jspec_expert_matmul" in str(traced)


def test_fp8_grouped_kernel_reads_fp8_experts():
    """The grouped expert kernel (a prompt's pairs sorted by expert; interpret mode) over FP8
    stacks with their group scales equals the ragged_dot reference on the dequantized
    stacks; a wrong scale is not a small error, and bad scales are refused."""
    import jax.numpy as jnp
    from jspec.kernels.moe import grouped
    from jspec.quantization import dequantize_kernel
    rng = np.random.default_rng(2)
    E, D, Fm, N, k = 4, 128, 128, 8, 2

    def fp8_stack(shape):
        qs, ss = zip(*(block_fp8(rng.normal(0, 0.05, shape[1:]).astype(np.float32).T, 128, 128) for _ in range(shape[0])))
        return (jnp.asarray(np.stack([q.T for q in qs])),
                jnp.asarray(np.stack([np.repeat(s, 128, axis=0)[:shape[2]].T for s in ss])))
    (gu, gu_s), (down, down_s) = fp8_stack((E, D, 2 * Fm)), fp8_stack((E, Fm, D))
    xs = jnp.asarray(rng.normal(0, 1, (N, D)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, E, (N, k)), jnp.int32).at[3, 1].set(-1)  # a pair of no expert here
    got = grouped.grouped_experts(xs, ids, gu, down, scales=(gu_s, down_s), interpret=True)
    want = grouped.grouped_experts_reference(xs, ids, dequantize_kernel(gu, gu_s, jnp.float32),
                                             dequantize_kernel(down, down_s, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(want)).max() > 1e-2
    off = grouped.grouped_experts(xs, ids, gu, down, scales=(gu_s, jnp.roll(down_s, 1, axis=0)), interpret=True)
    assert np.abs(np.asarray(off) - np.asarray(want)).max() > 1e-3
    with pytest.raises(ValueError, match=r"float32 scales \[E, Din / 128, Dout\]"):
        grouped.grouped_experts(xs, ids, gu, down, scales=(gu_s[:, :1, :8], down_s), interpret=True)
