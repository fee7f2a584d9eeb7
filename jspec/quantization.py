"""FP8 checkpoints read into the compute dtype (`loading.read_tensors` calls `dequantize`).

Two layouts, named by config.json's `quantization_config`:

- `quant_method: "fp8"` (DeepSeek-V3, Qwen3-FP8): each quantized `<x>.weight` [out, in] is
  F8_E4M3 beside `<x>.weight_scale_inv`, float32 [ceil(out / bm), ceil(in / bn)] for
  `weight_block_size` [bm, bn] (128 x 128 in every published checkpoint; any block size is
  read); weight = fp8 x scale of its block. Which weights are quantized is read off the
  files (a weight with a scale beside it); the others stay as they are.
- `quant_method: "compressed-tensors"` with 8-bit float weights (the "FP8" and
  "FP8-dynamic" Llama/Qwen checkpoints): `<x>.weight` F8_E4M3 with `<x>.weight_scale`,
  per output channel [out, 1] or per tensor ([] or [1]); an `<x>.input_scale` (static
  activation scales) is dropped: activations stay in the compute dtype.

Where the family keeps FP8 weights (`TargetFamily.fp8_weights`: the Llama, Qwen3.5,
Qwen3-Next and DeepSeek families) and the
scales allow it, a projection stays FP8 in device memory: `dequantize(..., keep=True)`
leaves the weight as it is and puts beside it `<x>.weight` + SCALE_SUFFIX, its scales per
output row and group of GROUP (128) input columns [out, ceil(in / GROUP)] (a block scale
repeated over its rows; a channel or tensor scale over its groups); `Tensors.linear` makes
that a `Linear`'s FP8 `kernel` [in, out] and float32 `kernel_scale` [ceil(in / GROUP),
out]. Scales per output row (not per 128 x 128 block) follow any reordering, fusion or
split of a projection's outputs, for 1/128 of a float32 a weight (3% of the FP8 bytes).
`models.layers.Linear` computes with it: `dequantize_kernel` in the graph, then the
product in the compute dtype (the same values as dequantizing on the host, so the same
logits), or on a GPU at decode sizes (up to `Tuning.fp8.max_rows` rows) `kernels.fp8.matmul`
(Triton) or, up to `Tuning.fp8.mosaic_rows` rows on a Hopper GPU, `kernels.fp8.mosaic`
(Mosaic GPU), which read the FP8 bytes. DeepSeek's and Qwen3.5's routed experts (one tensor an expert,
or fused into one on disk), and DeepSeek's shared experts, stay FP8 as stacks with their
scales (`TargetFamily.fp8_experts`, `Tensors.experts`, `Tensors.fused_experts`,
`Tensors.shared_experts`), read by the expert kernels. Other weights (DeepSeek's
kv_b_proj, block sizes whose columns are not whole groups) are dequantized on the host,
tensor by tensor, into float32 (then the family casts them to the compute dtype): the model computes
with the dequantized weights, so its logits equal transformers' on the same dequantized
weights.

Online (`jspec.load(..., quantization="fp8")`, `quantize_fp8`): a float checkpoint's
projection weights rounded to block FP8 as a block-FP8 checkpoint would hold them (E4M3,
128 x 128 blocks, each block's scale its largest magnitude over 448), kept or dequantized
the same way: the numerics of FP8 weights (not of FP8 activations). Not built: FP8 x FP8 products
(FP8 activations; measured in docs/experiments.md, "FP8 products at decode rows"). The
FP8 KV cache is `CacheConfig(dtype="float8_e4m3fn")`; a checkpoint's per-layer KV-cache scales
(`self_attn.k_scale`, `v_scale`) are read by `kv_cache_scales`, or measured by
`jspec.calibrate_kv_scales`.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
FP8_DTYPES = FP8  # the weight dtypes `dequantize_kernel` and the kernels' `w_scale` take
GROUP = 128  # input columns (kernel rows) sharing a scale in device memory
SCALE_SUFFIX = ".group_scales"  # beside a kept FP8 `<x>.weight`: its scales [out, ceil(in / GROUP)]
METHODS = ("fp8", "compressed-tensors")
E4M3_MAX = 448.0
NOT_QUANTIZED = ("embed", "lm_head", "norm", "mlp.gate.weight", "shared_head", "router")  # as DeepSeek's FP8 checkpoints (router: a params key)


def quantize_fp8(tensors: dict, block=(128, 128), keep: bool = False) -> dict:
    """A float checkpoint's projection weights (2-D `*.weight` tensors but the embeddings,
    LM heads, norms and routers) rounded to block FP8 and dequantized to float32, or with
    `keep` left FP8 beside their group scales (see the module); the rest untouched."""
    out = dict(tensors)
    for name, a in tensors.items():
        if name.endswith(".weight") and a.ndim == 2 and not any(s in name for s in NOT_QUANTIZED):
            q, scale = fp8_blocks(np.asarray(a, np.float32), block)
            if keep and block[1] % GROUP == 0:
                out[name], out[name + SCALE_SUFFIX] = q, block_group_scales(scale, block, q.shape)
            else:
                out[name] = _blocks(q, scale, block, name + "_scale_inv", "")
    return out


def quantize_kernel(kernel):
    """In the graph: a float `kernel` [K, N] rounded to E4M3 in 128 x 128 blocks as
    `fp8_blocks` rounds a checkpoint's weight (each block's scale its largest magnitude over
    448) -> (FP8 kernel [K, N], scales [ceil(K / GROUP), N] float32)."""
    K, N = kernel.shape
    gk, gn = groups_of(K), groups_of(N)
    w = jnp.pad(kernel.astype(jnp.float32), ((0, gk * GROUP - K), (0, gn * GROUP - N))).reshape(gk, GROUP, gn, GROUP)
    scale = jnp.maximum(jnp.abs(w).max(axis=(1, 3)), 1e-12) / E4M3_MAX  # [gk, gn]
    q = (w / scale[:, None, :, None]).reshape(gk * GROUP, gn * GROUP)[:K, :N].astype(jnp.float8_e4m3fn)
    return q, jnp.repeat(scale, GROUP, axis=1)[:, :N]


def quantize_params(params):
    """`jspec.Params` whose target family keeps FP8 weights (`TargetFamily.fp8_weights`) ->
    the same with every projection kernel (not the embedding or the LM head) rounded to FP8
    on its device (`quantize_kernel`), for weights built or trained in Python; as
    `jspec.load(..., quantization="fp8")` but with the blocks taken over the fused kernels
    (a block of q|k|v or gate|up columns can span two projections). The draft is left as
    it is. Routed (and DeepSeek's shared) experts of a family that keeps them FP8
    (`TargetFamily.fp8_experts`; stacks {gate_up, down} whose inputs are whole groups) are
    rounded expert by expert, with their scales beside them (`gate_up_scale`, `down_scale`,
    as `Tensors.experts` reads a checkpoint's)."""
    import dataclasses

    import jax

    from jspec.models import family_for
    family = family_for(params.config)
    if not family.fp8_weights:
        raise ValueError(f"{type(params.config).__name__} targets do not keep FP8 weights in device memory")
    rounded = jax.jit(quantize_kernel)
    stacked = jax.jit(lambda stack: jax.lax.map(quantize_kernel, stack))  # an expert at a time: float32 copies of one

    def walk(tree, keys=()):
        if not isinstance(tree, dict):
            return tree
        if "kernel" in tree and getattr(tree["kernel"], "ndim", 0) == 2 and "kernel_scale" not in tree and \
                not any(s in k for k in keys for s in NOT_QUANTIZED):
            q, scale = rounded(tree["kernel"])
            return {**tree, "kernel": q, "kernel_scale": scale}
        if family.fp8_experts and keys[-1:] in (("experts",), ("shared_experts",)) and "gate_up_scale" not in tree and \
                all(getattr(tree.get(n), "ndim", 0) == 3 and tree[n].shape[1] % GROUP == 0 for n in ("gate_up", "down")):
            (gate_up, gate_up_scale), (down, down_scale) = stacked(tree["gate_up"]), stacked(tree["down"])
            return {**tree, "gate_up": gate_up, "gate_up_scale": gate_up_scale, "down": down, "down_scale": down_scale}
        return {k: walk(v, keys + (k,)) for k, v in tree.items()}
    return dataclasses.replace(params, weights=walk(params.weights))


KV_SCALE_NAMES = ("k_scale", "v_scale")  # an attention layer's FP8 KV-cache scales (vLLM's names)


def kv_cache_scales(k_scale, v_scale, where: str, names: tuple[str, str]) -> np.ndarray:
    """A layer's FP8 KV-cache scales as a checkpoint gives them (one positive float each,
    shape [] or [1]; the cache holds key / k_scale and value / v_scale in E4M3) -> float32
    [2] (key, value), each rounded up to a power of two: a larger scale clips no more than
    the checkpoint's, and a power of two lets attention scale its queries and output
    exactly instead of widening the cache (`cache.kv.cached_attention`). ValueError naming
    the tensor: not one value, or not positive and finite."""
    out = []
    for a, name in zip((k_scale, v_scale), names):
        a = np.asarray(a, np.float32)
        if a.size != 1:
            raise ValueError(f"{where}: KV-cache scale {name!r} has shape {tuple(a.shape)}; expected one value "
                             f"([] or [1]) per layer")
        x = float(a.reshape(()))
        if not (np.isfinite(x) and x > 0):
            raise ValueError(f"{where}: KV-cache scale {name!r} is {x}; it must be positive and finite")
        out.append(power_of_two_at_least(x))
    return np.asarray(out, np.float32)


def power_of_two_at_least(x: float) -> float:
    """The smallest power of two >= x > 0 (an FP8 cache's scale, `kv_cache_scales`)."""
    return float(2.0 ** np.ceil(np.log2(x)))


def groups_of(columns: int) -> int:
    """Scale groups of a weight with `columns` input columns."""
    return -(-columns // GROUP)


def block_group_scales(scale: np.ndarray, block, shape) -> np.ndarray:
    """Block scales [..., ceil(out / bm), ceil(in / bn)] (bn a multiple of GROUP) of a weight
    [..., out, in] (a stack of experts' too) -> its scales per row and group [..., out,
    ceil(in / GROUP)]."""
    bm, bn = block
    rows = np.repeat(scale, bm, axis=-2)[..., :shape[-2], :]
    return np.ascontiguousarray(np.repeat(rows, bn // GROUP, axis=-1)[..., :groups_of(shape[-1])], np.float32)


def dequantize_kernel(kernel, scale, dtype):
    """In the graph: an FP8 `kernel` [..., K, N] (a stack of experts' too) and its `scale`
    [..., ceil(K / GROUP), N] float32 -> [..., K, N] in `dtype` (each value times its scale
    in float32, then rounded once: what dequantizing on the host gives)."""
    K = kernel.shape[-2]
    full = jnp.repeat(scale, GROUP, axis=-2, total_repeat_length=scale.shape[-2] * GROUP)[..., :K, :]
    return (kernel.astype(jnp.float32) * full).astype(dtype)


def expert_scales(stack: dict):
    """A routed experts' stack {gate_up, down[, gate_up_scale, down_scale]} -> (gate_up's
    scales, down's) where it is FP8 (`Tensors.experts`, `quantize_params`), else None: what
    the expert kernels take as `scales`."""
    return (stack["gate_up_scale"], stack["down_scale"]) if "gate_up_scale" in stack else None


def dequantized_experts(gate_up, down, scales, dtype) -> tuple:
    """Routed experts' stacks (gate_up, down) in `dtype`: FP8 ones dequantized in the graph
    with their `scales` (gate_up's, down's; the expert kernels' reference paths), others as
    they are (scales None)."""
    if scales is None:
        return gate_up, down
    return tuple(dequantize_kernel(w, sc, dtype) for w, sc in zip((gate_up, down), scales))


def kernel_of(p: dict, dtype):
    """A projection's params {kernel[, kernel_scale]} -> its kernel in `dtype` (an FP8 one
    dequantized in the graph, `dequantize_kernel`; another as it is)."""
    return dequantize_kernel(p["kernel"], p["kernel_scale"], dtype) if "kernel_scale" in p else p["kernel"]


def dequantize_host(kernel: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """`dequantize_kernel` on the host, to float32 (an FP8 kernel or stack exported or read back)."""
    full = np.repeat(np.asarray(scale, np.float32), GROUP, axis=-2)[..., :kernel.shape[-2], :]
    return np.asarray(kernel).astype(np.float32) * full


def dequantize_uneven_rows(tree, n: int, dtype, rows: tuple[str, ...]):
    """A weight tree with every FP8 kernel of the modules named `rows` (split by rows over
    n devices) whose rows do not split into whole groups of GROUP per device dequantized
    to `dtype` (its scales dropped): a device's block of a layer run per device
    (`jax.shard_map`) must hold whole groups with their scales."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if k in rows and isinstance(v, dict) and "kernel_scale" in v and (v["kernel"].shape[0] // n) % GROUP:
            kernel = dequantize_host(np.asarray(v["kernel"]), np.asarray(v["kernel_scale"]))
            out[k] = {**{x: w for x, w in v.items() if x not in ("kernel", "kernel_scale")},
                      "kernel": jnp.asarray(kernel, dtype)}
        else:
            out[k] = dequantize_uneven_rows(v, n, dtype, rows)
    return out


def fp8_blocks(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float32 -> (E4M3 weight, float32 scale per bm x bn block: amax / 448)."""
    bm, bn = block
    gm, gn = -(-w.shape[0] // bm), -(-w.shape[1] // bn)
    pad = np.zeros((gm * bm, gn * bn), np.float32)
    pad[:w.shape[0], :w.shape[1]] = w
    blocks = pad.reshape(gm, bm, gn, bn)
    scale = (np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / E4M3_MAX).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(gm * bm, gn * bn)[:w.shape[0], :w.shape[1]]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize(tensors: dict, cfg_json, where: str, keep: bool = False) -> dict:
    """The checkpoint's tensors with every FP8 weight dequantized to float32 and its scales
    removed (others untouched; block-scaled experts fused into one tensor [E, out, in] with
    scales [E, ...] too); with `keep`, FP8 weights whose scales allow it stay FP8 beside
    their group scales (`SCALE_SUFFIX`, see the module; a fused stack's [E, out,
    ceil(in / GROUP)]). ValueError: an unsupported
    method or scheme, a quantized weight without its scale or with one of the wrong shape,
    FP8 tensors in a checkpoint that declares no quantization."""
    qc = cfg_json.get("quantization_config") if hasattr(cfg_json, "get") else None
    fp8 = [n for n, a in tensors.items() if np.dtype(a.dtype) in FP8]
    if qc is None:
        if fp8:
            raise ValueError(f"{where}: tensor {fp8[0]!r} is FP8 but config.json has no quantization_config")
        return tensors
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: quantization_config must be a JSON object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
            raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive ints (such "
                             f"as [128, 128]), got {block!r}")
        keeps = keep and block[1] % GROUP == 0

        def blocks(w, s, name):  # (experts fused into one tensor [E, out, in] on disk too)
            _check_blocks(w, s, block, name, where)
            return (w, block_group_scales(s, block, w.shape)) if keeps else _blocks(w, s, block, name, where)
        return _apply(tensors, fp8, "_scale_inv", where, blocks)
    if method == "compressed-tensors":
        _check_compressed(qc, where)
        weights = {n: a for n, a in tensors.items() if not n.endswith(".input_scale")}
        def channels(w, s, name):
            rows = _channel_scales(w, s, name, where)  # [out, 1]
            if not keep:
                return w.astype(np.float32) * rows
            return w, np.ascontiguousarray(np.broadcast_to(rows, (w.shape[0], groups_of(w.shape[1]))))
        return _apply(weights, fp8, "_scale", where, channels)
    raise ValueError(f"{where}: quantization method {method!r} is not supported (jspec reads FP8 checkpoints: "
                     f"quant_method {' or '.join(repr(m) for m in METHODS)})")


def _apply(tensors: dict, fp8: list, suffix: str, where: str, convert) -> dict:
    """Every FP8 tensor through convert(weight, scale, scale's name): a float32 array, or
    (the FP8 weight, its group scales) to keep."""
    out = dict(tensors)
    for name in fp8:
        scale_name = name + suffix
        if scale_name not in out:
            raise ValueError(f"{where}: FP8 tensor {name!r} has no scale {scale_name!r}")
        got = convert(np.asarray(out[name]), np.asarray(out.pop(scale_name), np.float32), scale_name)
        if isinstance(got, tuple):
            out[name], out[name + SCALE_SUFFIX] = got
        else:
            out[name] = got
    stray = sorted(n for n in out if n.endswith(suffix))
    if stray:
        raise ValueError(f"{where}: scale {stray[0]!r} belongs to no FP8 tensor")
    return out


def _blocks(w: np.ndarray, s: np.ndarray, block, name: str, where: str) -> np.ndarray:
    """A block-scaled FP8 weight [out, in] (scales [ceil(out/bm), ceil(in/bn)]), or a stack
    of them [E, out, in] (experts fused into one tensor; scales [E, ...]) -> float32."""
    _check_blocks(w, s, block, name, where)
    bm, bn = block
    full = np.repeat(np.repeat(s, bm, axis=-2), bn, axis=-1)[..., :w.shape[-2], :w.shape[-1]]
    return w.astype(np.float32) * full


def _check_blocks(w: np.ndarray, s: np.ndarray, block, name: str, where: str) -> None:
    if w.ndim not in (2, 3):
        raise ValueError(f"{where}: FP8 tensor {name[:-len('_scale_inv')]!r} has shape {w.shape}; block scales "
                         f"need a 2-D weight (or a 3-D stack of experts)")
    bm, bn = block
    want = w.shape[:-2] + (-(-w.shape[-2] // bm), -(-w.shape[-1] // bn))
    if s.shape != want:
        raise ValueError(f"{where}: scale {name!r} has shape {s.shape}, expected {want} for a weight of shape "
                         f"{w.shape} in blocks of {bm} x {bn}")


def _channel_scales(w: np.ndarray, s: np.ndarray, name: str, where: str) -> np.ndarray:
    """A compressed-tensors FP8 weight [out, in]'s scale per output channel [out, 1] (or
    [out]) or per tensor ([] or [1]) -> its scale per row [out, 1] float32."""
    if s.size == 1:
        return np.full((w.shape[0], 1), s.reshape(()), np.float32)
    if s.shape in ((w.shape[0], 1), (w.shape[0],)):
        return s.reshape(-1, 1).astype(np.float32)
    raise ValueError(f"{where}: scale {name!r} has shape {s.shape}, expected [{w.shape[0]}, 1] (per channel) or "
                     f"[1] (per tensor) for a weight of shape {w.shape}")


def _check_compressed(qc: dict, where: str) -> None:
    """compressed-tensors: every config group's weights 8-bit floats, per channel or tensor."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: compressed-tensors quantization_config has no config_groups")
    for gname, group in groups.items():
        wts = (group or {}).get("weights") or {}
        if wts.get("num_bits") != 8 or wts.get("type") != "float":
            raise ValueError(f"{where}: compressed-tensors group {gname!r} quantizes weights to "
                             f"{wts.get('num_bits')}-bit {wts.get('type')}; jspec reads 8-bit float (FP8) only")
        if wts.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"{where}: compressed-tensors group {gname!r} has weight strategy "
                             f"{wts.get('strategy')!r}; jspec reads 'channel' and 'tensor'")
